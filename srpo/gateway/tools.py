"""Tools on any model: how tool definitions reach the prompt, and how tool calls are read back.

**Into the prompt.**  A chat template that renders ``tools`` (Qwen, Hermes, Llama 3, Mistral ...)
gets them as its authors meant.  Any other model — SmolLM2, Gemma 3, the tiny test models, a
base model — gets the **generic tool format** by rewriting the messages before its own template
runs (:func:`with_generic_tools`):

- the tool list goes into the system message (one JSON schema per line inside ``<tools></tools>``)
  with the instruction to call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- an assistant message's ``tool_calls`` become that text in its content;
- ``tool`` messages become a user message ``<tool_response>...</tool_response>`` (consecutive
  ones merged, so templates that insist on alternating roles still render).

This is the Hermes format (what Qwen 2.5/3 and NousResearch's models were trained on), so a model
fine-tuned with srpo on it speaks the most common open format.  ``model.chat_template`` replaces a
model's template (a Jinja string, a file, or ``chatml_tools``: ChatML with the Hermes tool block,
shipped here as :data:`CHATML_TOOLS`).

**Out of the reply.**  Calls are parsed by the tokenizer's own response parser when the model
ships one (transformers' ``tokenizer.parse_response`` with the model's ``response_template``),
else by a tool parser (:mod:`srpo.gateway.parsers`: the role's own, or the template's family):
Hermes/Qwen ``<tool_call>`` JSON (one object or a
list per block), Llama 3 JSON (``{"name", "parameters"}``, optionally after ``<|python_tag|>``),
Mistral ``[TOOL_CALLS]`` (a JSON list, or ``name[ARGS]{...}``).  JSON is read with a real decoder,
so a literal ``</tool_call>`` inside an argument string does not cut the call.  Text that does not
parse is returned as content; the recorded token ids are never touched.

**Forcing a call.**  ``tool_choice: required`` or a named function is honoured by writing the
start of a call after the generation prompt (:func:`forced_prefix`): the model continues from
``<tool_call>\\n{"name": "`` (or with the name and ``"arguments": `` already written).  The forced
text is part of the prompt the member is trained on, not of its completion.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from srpo.gateway.errors import ProtocolError
from srpo.gateway.parsers import TOOL_PARSERS, openai_call


CHATML_TOOLS = (
    "{% set tool_block %}{% if tools %}You can call these tools (functions):\n<tools>"
    "{% for tool in tools %}\n{{ (tool.function if tool.function is defined else tool) | tojson }}{% endfor %}"
    "\n</tools>\nTo call a tool, reply with one block per call:\n<tool_call>\n"
    "{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\n</tool_call>{% endif %}{% endset %}"
    "{% if messages and messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}{% if tools %}\n\n{{ tool_block }}{% endif %}<|im_end|>\n"
    "{% set rest = messages[1:] %}{% else %}"
    "{% if tools %}<|im_start|>system\n{{ tool_block }}<|im_end|>\n{% endif %}{% set rest = messages %}{% endif %}"
    "{% for message in rest %}"
    "{% if message.role == 'tool' %}"
    "{% if not (loop.previtem is defined and loop.previtem.role == 'tool') %}<|im_start|>user\n{% endif %}"
    "<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.nextitem is defined and loop.nextitem.role == 'tool' %}\n{% else %}<|im_end|>\n{% endif %}"
    "{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}\n{% endif %}"
    "{% for call in message.tool_calls %}{% if not loop.first %}\n{% endif %}<tool_call>\n"
    "{\"name\": {{ call.function.name | tojson }}, \"arguments\": "
    "{{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
).replace("%}\n", "%}{{ '\\n' }}")  # transformers renders with trim_blocks: a newline right after a tag would vanish
"""ChatML with Hermes-style tools (``model.chat_template: chatml_tools``): SmolLM2's and the tiny
models' template, plus the tool block, tool calls and tool responses."""

NAMED_TEMPLATES = {"chatml_tools": CHATML_TOOLS}


def resolve_chat_template(value: str) -> str:
    """``model.chat_template``: a named template, a file path, or the Jinja text itself."""
    from pathlib import Path

    if value in NAMED_TEMPLATES:
        return NAMED_TEMPLATES[value]
    if "{" not in value and Path(value).is_file():
        return Path(value).read_text(encoding="utf-8")
    return value


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders a ``tools`` list (it names the variable)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def reply_parser(tokenizer, tool_parser: str | None = None) -> str:
    """The tool parser a role's replies are read with: its own (``tool_parser``), else the one of
    its tokenizer's chat template family (:func:`tool_format`)."""
    return tool_parser or tool_format(getattr(tokenizer, "chat_template", None))


def tool_format(chat_template: str | None) -> str:
    """The tool-call format of a template: hermes, llama3, mistral, or generic (it renders no
    tools: srpo's generic format, which is Hermes text)."""
    if not template_renders_tools(chat_template):
        return "generic"
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return "llama3"
    return "hermes"  # an unknown family that renders tools: Hermes is the likeliest


# -- into the prompt ------------------------------------------------------------------------------
def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function", tool) if isinstance(tool.get("function"), dict) else tool


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass  # written back as the model wrote it
    return "<tool_call>\n" + json.dumps({"name": fn.get("name", ""), "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


def tool_block(tools: list[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(_function(t), ensure_ascii=False) for t in tools)
    return ("You can call these tools (functions):\n<tools>\n" + lines + "\n</tools>\n"
            "To call a tool, reply with one block per call:\n<tool_call>\n"
            '{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>')


def with_generic_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages rewritten for a template that renders no tools (the generic format above)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            text = "\n".join(([m["content"]] if m.get("content") else []) + [_call_text(c) for c in m["tool_calls"]])
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    out = [{k: v for k, v in m.items() if k != "_tool"} for m in out]
    if tools:
        block = tool_block(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def forced_prefix(fmt: str, choice: Any) -> str:
    """The start of a tool call written for the model (tool_choice ``required`` or a named
    function); '' for ``auto``/``none``.  ``fmt``: a tool parser's name (its ``start``)."""
    if choice in (None, "auto", "none"):
        return ""
    name = choice if isinstance(choice, str) and choice != "required" else None
    start = TOOL_PARSERS[fmt].start
    if start is None:
        raise ProtocolError(f"'tool_choice': this model's tool-call format ({fmt}) cannot be forced",
                            param="tool_choice")
    return start(name)


def flat_function_tools(raw: Any, *, is_served: Callable[[dict], bool], schema_key: str,
                        not_served: Callable[[Any], str]) -> list[dict[str, Any]] | None:
    """A request's list of flat tools (``{name, description, <schema_key>}``: the Responses API's
    function tools, Anthropic's client tools) as chat function tools; None when there are none.
    ``is_served(tool)`` says whether srpo can offer one; ``not_served(kind)`` is the refusal."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise ProtocolError("'tools' must be a list", param="tools")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or not is_served(t) or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise ProtocolError(f"tools[{i}]: {not_served(kind)}", param=f"tools[{i}]")
        fn = {"name": t["name"], "parameters": t.get(schema_key) or {"type": "object", "properties": {}}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def tool_choice(value: Any, tools: list[dict[str, Any]] | None, *, flat: bool = False) -> Any:
    """Check ``tool_choice``: 'none' | 'auto' | 'required' | {function: {name}} (chat) or
    {type: function, name} (Responses, ``flat``).  Returns 'none', 'auto', 'required' or the
    function's name."""
    if value is None:
        return "auto"
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise ProtocolError("'tool_choice' is 'required' but no tools were given", param="tool_choice")
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name") if flat else (value.get("function") or {}).get("name")
        if not flat and name is None:
            name = value.get("name")
        names = [_function(t).get("name") for t in tools or []]
        if not isinstance(name, str) or name not in names:
            raise ProtocolError(f"'tool_choice' names the function {name!r}, which is not among the tools "
                                f"({', '.join(map(str, names)) or 'none given'})", param="tool_choice")
        return name
    raise ProtocolError("'tool_choice' must be 'none', 'auto', 'required' or a function "
                        "({'type': 'function', 'function': {'name': ...}})", param="tool_choice")


# -- out of the reply -----------------------------------------------------------------------------
def parse_tool_calls(text: str, fmt: str, tokenizer=None, prompt_text: str | None = None) -> tuple[str, list[dict[str, Any]]]:
    """The reply's content and OpenAI-shaped ``tool_calls``.  The tokenizer's own response parser
    first, when the model ships a ``response_template``; then the tool parser ``fmt`` (a name in
    :data:`srpo.gateway.parsers.TOOL_PARSERS`: the template's family, or the role's own)."""
    if tokenizer is not None and getattr(tokenizer, "response_template", None) and hasattr(tokenizer, "parse_response"):
        try:
            parsed = tokenizer.parse_response(text, prefix=prompt_text)
            calls = [openai_call({"name": (c.get("function") or c).get("name"),
                                   "arguments": (c.get("function") or c).get("arguments", {})})
                     for c in parsed.get("tool_calls") or []]
            if calls and all(c is not None for c in calls):
                return parsed.get("content") or "", calls
            if not parsed.get("tool_calls"):
                return text, []
        except Exception:  # noqa: BLE001 — a parser that trips over odd text: fall back to ours
            pass
    return TOOL_PARSERS[fmt].parse(text)
