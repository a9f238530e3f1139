"""Constrained decoding in srpo's sampler: a reply drawn only from the tokens a grammar allows.

Structured output (``response_format`` ``json_object`` / ``json_schema``, the Responses API's
``text.format``, the Agents SDK's ``output_type``) reaches the sampler as a
:class:`srpo.types.Grammar` on a row's :class:`~srpo.types.SamplingParams`.  At every step the row's
logits are masked to the tokens the grammar allows next, and the token is drawn from that masked
distribution; the grammar then advances on it.  The grammar library is **llguidance** (JSON Schema
to a token-level matcher): chosen over xgrammar by ``benchmarks/bench_grammar.py`` — both accept
every schema tried and both cost far less than a decode step per token (xgrammar 3–9 µs, llguidance
30–76 µs on SmolLM2's 49k vocabulary), but xgrammar brings triton (~1 GB) and a TVM runtime with
it, llguidance nothing; vLLM uses it too (its ``guidance`` backend), so both engines enforce a
schema with the same library.

**What is recorded.**  The behaviour log-prob of a constrained token is that of the distribution
it was drawn from — the masked one, renormalised: with ``p`` the model's distribution (after
temperature) and ``A_t`` the allowed tokens, ``q_t(y) = p_t(y) / Z_t`` for ``y ∈ A_t``, where
``Z_t = Σ_{a ∈ A_t} p_t(a)``.  The trainer's π_old is the model's ``p`` (it recomputes without a
mask), so each constrained token is off-policy by ``π_old/π_beh = Z_t ≤ 1``: the loss's truncated
importance weight (``train.tis_cap``) corrects exactly that, as it corrects any sampler/trainer gap
(the method page derives it).
"""

from __future__ import annotations

import json
import threading

import torch

from srpo.types import Grammar, SamplingParams

_LOCK = threading.Lock()
#: (id(tokenizer), vocabulary size, eos ids) → (tokenizer, llguidance's view of it): preparing one
#: takes ~1 s, so it is done once per tokenizer (the tokenizer is held so its id stays its own).
_PREPARED: dict[tuple, tuple[object, object]] = {}


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as err:  # a dependency of srpo; absent only in a hand-made environment
        raise ImportError("structured output needs llguidance: pip install llguidance") from err
    return llguidance


#: JSON without free whitespace (``{"a":1}``): a model that may write any run of spaces and newlines
#: between tokens spends its budget on them (a random model does nothing else); the same setting
#: as vLLM's ``guidance`` backend with ``disable_any_whitespace`` (srpo's vLLM engine sets it), so
#: both engines enforce a schema alike.  A schema's own ``x-guidance`` options override it.
JSON_OPTIONS = {"whitespace_flexible": False}


def lark_text(grammar: Grammar) -> str:
    """A grammar with ``or_call`` in Lark (llguidance's dialect): the answer — its schema inlined,
    with :data:`JSON_OPTIONS` — or a tool call's start followed by anything (ValueError: the schema
    is not JSON)."""
    try:
        schema = json.loads(grammar.schema)
    except json.JSONDecodeError as err:
        raise ValueError(f"the schema is not JSON: {err}") from None
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {"x-guidance": JSON_OPTIONS, **schema}
    return (f"start: answer | call\nanswer: %json {json.dumps(schema)}\n"
            f"call: {json.dumps(grammar.or_call)} /(.|\\n)*/\n")


def compiled(grammar: Grammar) -> str:
    """llguidance's grammar for the schema, or for :func:`lark_text` with ``or_call`` (ValueError:
    the schema is not JSON)."""
    ll = _llguidance()
    if not grammar.or_call:
        return ll.LLMatcher.grammar_from_json_schema(grammar.schema, defaults=JSON_OPTIONS)
    return ll.LLMatcher.grammar_from_lark(lark_text(grammar))


def compile_error(grammar: Grammar) -> str | None:
    """Why the grammar library cannot compile this schema, or None when it can."""
    try:
        grammar_text = compiled(grammar)
    except ValueError as err:
        return str(err)
    return _llguidance().LLMatcher.validate_grammar(grammar_text) or None


def _prepared(tokenizer, vocab: int, eos: tuple[int, ...]):
    key = (id(tokenizer), vocab, eos)
    with _LOCK:
        held = _PREPARED.get(key)
        if held is None or held[0] is not tokenizer:
            ll = _llguidance()
            held = (tokenizer, ll.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(eos)))
            _PREPARED[key] = held
        return held[1]


def _allowed(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """(k, ⌈V/32⌉) int32 bitmasks → (k, V) bool: bit j of word w allows token 32·w + j."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bits.unsqueeze(-1) >> shifts) & 1).bool().reshape(bits.shape[0], -1)[:, :vocab]


class GrammarRows:
    """The grammars of one decode batch's rows (indexed by the batch's row handles): at each step
    :meth:`masked` removes what each constrained row may not draw next, :meth:`advance` feeds it
    the token drawn.  Rows without a grammar are left alone; rows join with :meth:`add` and leave
    with :meth:`drop`."""

    def __init__(self, tokenizer, params: list[SamplingParams], vocab: int, eos: set[int]):
        self.tokenizer, self.vocab, self.eos = tokenizer, vocab, tuple(sorted(eos))
        self.matchers = {}
        for i, p in enumerate(params):
            self.add(i, p)

    def add(self, i: int, params: SamplingParams) -> None:
        """Row ``i`` samples with ``params`` (nothing to do unless it has a grammar)."""
        if params.grammar is None:
            return
        ll = _llguidance()
        prepared = _prepared(self.tokenizer, self.vocab, self.eos)
        self._fill = ll.torch.fill_next_token_bitmask
        self._eos = torch.tensor(self.eos, dtype=torch.long)
        matcher = ll.LLMatcher(prepared, compiled(params.grammar))
        if matcher.is_error():  # the gateway validated it: this is a schema the tokenizer cannot serve
            raise ValueError(f"structured output: the schema {params.grammar.name or ''} cannot be enforced "
                             f"with this tokenizer: {matcher.get_error()}")
        self.matchers[i] = matcher

    def drop(self, i: int) -> None:
        """Row ``i`` left the batch."""
        self.matchers.pop(i, None)

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def masked(self, logits: torch.Tensor, live: list[int]) -> torch.Tensor:
        """``logits`` (b, V), rows in ``live`` order (original indices), with −inf wherever a row's
        grammar does not allow the token next (a new tensor; unconstrained rows unchanged)."""
        rows = [b for b, i in enumerate(live) if i in self.matchers]
        if not rows:
            return logits
        bits = torch.full((len(rows), (self.vocab + 31) // 32), -1, dtype=torch.int32)
        for k, b in enumerate(rows):
            self._fill(self.matchers[live[b]], bits, k)
        allowed = _allowed(bits, self.vocab)
        for k in (~allowed.any(-1)).nonzero().flatten().tolist():  # allows nothing (its matcher failed): end it
            allowed[k, self._eos] = True
        index = torch.tensor(rows, device=logits.device)
        out = logits.clone()
        out[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
        return out

    def advance(self, i: int, token: int) -> None:
        """Row ``i`` drew ``token`` (one its mask allowed)."""
        matcher = self.matchers.get(i)
        if matcher is not None:
            matcher.consume_token(token)
