"""Which grammar library constrains srpo's sampler: xgrammar against llguidance, side by side.

Structured output (``response_format`` JSON modes, the Responses API's ``text.format``, the Agents
SDK's ``output_type``) is served by masking the logits at every decode step to the tokens a
grammar allows.  Both libraries compile a JSON schema against the tokenizer and, per token, fill a
bitmask of the allowed next tokens and advance on the token drawn.  What this measures, for the
demo's tokenizer (SmolLM2, 49,152 tokens), alternating the two in one run:

- preparing the tokenizer (once per process) and compiling a schema (once per request);
- per token, filling the mask and advancing, over a valid reply of each schema;
- how many schemas of a set a structured-output user would send each library accepts.

    pip install xgrammar   # not a dependency of srpo: installed for the comparison only
    python benchmarks/bench_grammar.py [--repeats 5] [--model smollm2-135m]

Nothing is timed against a goal: the figures choose the library (benchmarks/README.md says which
and why).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

#: The schemas a structured-output user sends, with a valid reply each: the Agents SDK's wrapped
#: output type, a nested object with enums and arrays, a strict OpenAI-style schema, json_object.
SCHEMAS = {
    "agents_sdk_output": ({"type": "object", "properties": {"response": {"type": "integer"}},
                           "required": ["response"], "additionalProperties": False, "title": "final_output"},
                          '{"response": 42}'),
    "nested_enum_array": ({"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "object", "properties": {
            "day": {"type": "integer", "minimum": 1}, "high": {"type": "number"}},
            "required": ["day", "high"], "additionalProperties": False}}},
        "required": ["city", "unit", "days"], "additionalProperties": False},
        '{"city": "Paris", "unit": "celsius", "days": [{"day": 1, "high": 21.5}, {"day": 2, "high": 19}]}'),
    "strict_with_refs": ({"type": "object", "$defs": {"step": {"type": "object", "properties": {
        "explanation": {"type": "string"}, "output": {"type": "string"}},
        "required": ["explanation", "output"], "additionalProperties": False}},
        "properties": {"steps": {"type": "array", "items": {"$ref": "#/$defs/step"}},
                       "final_answer": {"type": "string"}},
        "required": ["steps", "final_answer"], "additionalProperties": False},
        '{"steps": [{"explanation": "add", "output": "3"}], "final_answer": "3"}'),
    "json_object": ({"type": "object"}, '{"answer": [1, 2, {"ok": true}], "why": "because"}'),
}


def _tokenizer(model: str):
    from transformers import AutoTokenizer

    from srpo.policies.models import converted_checkpoint

    return AutoTokenizer.from_pretrained(converted_checkpoint(model))


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int):
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, vocab
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.mask = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True)

    def walk(self, compiled, ids: list[int]) -> None:
        matcher = self.xgr.GrammarMatcher(compiled)
        for tok in ids:
            matcher.fill_next_token_bitmask(self.mask)
            if not matcher.accept_token(tok):
                raise RuntimeError(f"xgrammar refused token {tok}")


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.fill = llguidance.torch.fill_next_token_bitmask
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.mask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        error = self.ll.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise ValueError(error)
        return grammar

    def walk(self, grammar, ids: list[int]) -> None:
        matcher = self.ll.LLMatcher(self.tok, grammar)
        for tok in ids:
            self.fill(matcher, self.mask)
            if not matcher.consume_token(tok):
                raise RuntimeError(f"llguidance refused token {tok}: {matcher.get_error()}")


def _timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    tokenizer = _tokenizer(args.model)
    vocab = len(tokenizer)
    libs, setup = [], {}
    for cls in (XGrammar, LLGuidance):
        try:
            seconds, lib = _timed(cls, tokenizer, vocab)
        except ImportError:  # xgrammar is not a dependency of srpo (it brings triton, ~1 GB)
            print(f"{cls.name} is not installed (pip install {cls.name}): measured without it")
            continue
        libs.append(lib)
        setup[lib.name] = seconds
    rows = []
    for name, (schema, reply) in SCHEMAS.items():
        ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
        row = {"schema": name, "tokens": len(ids)}
        for _ in range(args.repeats):
            for lib in libs:  # alternating: the machine's drift falls on both
                compile_s, compiled = _timed(lib.compile, schema)
                walk_s, _ = _timed(lib.walk, compiled, ids)
                row.setdefault(f"{lib.name}_compile_ms", []).append(1e3 * compile_s)
                row.setdefault(f"{lib.name}_us_per_token", []).append(1e6 * walk_s / len(ids))
        rows.append({k: statistics.median(v) if isinstance(v, list) else v for k, v in row.items()})
    print(f"tokenizer {args.model} ({vocab} tokens); one thread; medians of {args.repeats}")
    print("setup (once per process): " + ", ".join(f"{k} {v:.2f} s" for k, v in setup.items()))
    print(f"{'schema':<20}{'tokens':>7}" + "".join(f"{lib.name + ' compile ms':>24}{lib.name + ' µs/token':>22}"
                                                  for lib in libs))
    for row in rows:
        print(f"{row['schema']:<20}{row['tokens']:>7}" + "".join(
            f"{row[lib.name + '_compile_ms']:>24.1f}{row[lib.name + '_us_per_token']:>22.0f}" for lib in libs))


if __name__ == "__main__":
    main()
