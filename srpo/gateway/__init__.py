"""An OpenAI-compatible endpoint in front of srpo's policies: train a team written against the
OpenAI API unchanged (``workflow.name: openai_agent``), and serve what was trained (``srpo serve``).

- :mod:`srpo.gateway.protocol` — requests checked, responses and errors shaped as OpenAI's;
- :mod:`srpo.gateway.dataflow` — which outputs acted together, recovered from the calls;
- :mod:`srpo.gateway.backends` — what answers: a training episode (recorded) or the server;
- :mod:`srpo.gateway.server` — the HTTP routes, per-episode URLs, the server thread.
"""
