"""Robust parsing of role outputs that steer a workflow (router choices, decisions, tool tags).

Model text is adversarial by nature: every parser here accepts anything, never evaluates it,
and returns ``None`` (the caller's defined fallback) when it finds no valid choice.
"""

from __future__ import annotations

import re

MAX_PARSE_CHARS = 4000  # parse only the head of a (possibly huge) output: bounded time

_INT = re.compile(r"\d{1,4}")
_SEARCH = re.compile(r"<search>(.*?)(?:</search>|$)", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL)
_FORGED_TAGS = re.compile(r"</?\s*information\s*>", re.IGNORECASE)


def parse_router_choice(text: str, num_workers: int) -> list[int] | None:
    """Worker indices (1-based, sorted, unique) chosen by a router, or ``None`` if unparseable.

    Looks after the last ``WORKERS:`` if present, else anywhere; numbers outside 1..N are ignored.
    """
    text = (text or "")[:MAX_PARSE_CHARS]
    upper = text.upper()
    if "WORKERS" in upper:
        text = text[upper.rfind("WORKERS") + len("WORKERS"):]
        text = text.splitlines()[0] if text.strip() else text
    chosen = sorted({int(m) for m in _INT.findall(text) if 1 <= int(m) <= num_workers})
    return chosen or None


def parse_decision(text: str, options: tuple[str, ...]) -> str | None:
    """The first of ``options`` (case-insensitive, whole word) appearing in ``text``, else ``None``."""
    text = (text or "")[:MAX_PARSE_CHARS].upper()
    best, best_pos = None, len(text) + 1
    for opt in options:
        m = re.search(rf"\b{re.escape(opt.upper())}\b", text)
        if m and m.start() < best_pos:
            best, best_pos = opt, m.start()
    return best


def parse_search_step(text: str) -> tuple[str, str]:
    """``("answer", a)`` if the text gives an answer, ``("search", q)`` if it issues a (non-empty)
    query, else ``("none", "")``; the first tag in the text wins."""
    text = (text or "")[:MAX_PARSE_CHARS]
    a, s = _ANSWER.search(text), _SEARCH.search(text)
    if a and (not s or a.start() < s.start()):
        return "answer", a.group(1).strip()
    if s and s.group(1).strip():
        return "search", " ".join(s.group(1).split())[:300]
    return "none", ""


def search_call_context(text: str) -> str:
    """The part of a search turn that goes back into the agent's context.

    The turn is cut right after its first ``</search>`` (what the tool acted on; anything the
    model wrote after it — an extra closing tag, a forged result — is dropped), and any
    ``<information>`` tag the model wrote itself is rendered harmless as ``[information]``, so
    only the tool can open an information block.
    """
    text = text or ""
    end = text.find("</search>")
    text = text[:end] if end >= 0 else text
    return _FORGED_TAGS.sub(lambda m: "[" + m.group(0).strip("<>").strip() + "]", text) + "</search>"
