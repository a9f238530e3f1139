"""An OpenAI- and Anthropic-compatible endpoint in front of srpo's policies: train a team written
against either API unchanged (``workflow.name: openai_agent``), and serve what was trained
(``srpo serve``).

- :mod:`srpo.gateway.protocol` — requests checked, responses and errors shaped as OpenAI's;
- :mod:`srpo.gateway.responses`, :mod:`srpo.gateway.anthropic` — the Responses and Messages APIs
  as the chat requests they mean;
- :mod:`srpo.gateway.tools`, :mod:`srpo.gateway.parsers` — tools into prompts, tool calls and
  thinking out of replies (parsers are a registry: a role may bring its own);
- :mod:`srpo.gateway.dataflow` — which outputs acted together, recovered from the calls;
- :mod:`srpo.gateway.backends` — what answers: a training episode (recorded) or the server;
- :mod:`srpo.gateway.server` — the HTTP routes, per-episode URLs, the server thread.
"""
