"""Structured output by constrained decoding (srpo.policies.grammar): the tokens are drawn from the
model's distribution masked to what the grammar allows, the behaviour log-probs logged are those of
that masked distribution, and the trainer's truncated importance weight is the mass the mask kept."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("llguidance")

from helpers.grammar_replay import replayed  # noqa: E402
from srpo.objective import LossInputs, LossSettings, policy_loss  # noqa: E402
from srpo.policies.models import load_model  # noqa: E402
from srpo.policies.sampling import sample  # noqa: E402
from srpo.types import Grammar, SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {"verdict": {"enum": ["yes", "no", "maybe"]}, "n": {"type": "integer"}},
          "required": ["verdict", "n"], "additionalProperties": False}


def test_constrained_tokens_log_the_masked_distribution_and_tis_weighs_them_by_the_mass_kept():
    model, tok = load_model("tiny-llama", seed=0)
    prompt = tok("Is it so?", add_special_tokens=False)["input_ids"]
    grammar = Grammar(json.dumps(SCHEMA), "verdict")
    params = [SamplingParams(temperature=t, max_new_tokens=24, grammar=grammar) for t in (1.0, 1.0, 0.7)]
    samples = sample(model, tok, [prompt] * 3, params, generator=torch.Generator().manual_seed(0))
    olds, behs = [], []
    for s, p in zip(samples, params):
        assert s.text.startswith('{"verdict":"') and '"n":' in s.text  # the form, whatever the weights
        old, log_z = replayed(model, tok, prompt, s.completion_ids, p)
        beh = torch.tensor(s.logprobs)
        # The recorded behaviour log-prob is the masked, renormalised one: log p(y) − log Z_t ...
        assert torch.allclose(beh, old - log_z, atol=1e-4), (beh, old - log_z)
        olds.append(old)
        behs.append(beh)
    log_z = torch.cat(olds) - torch.cat(behs)
    # ... and the mask removed known mass: most of it at the steps where the grammar left few tokens.
    assert (log_z < -1e-3).float().mean() > 0.5 and float(log_z.min()) < math.log(0.5)
    # The trainer's π_old is the model's (unmasked); the loss weighs each unit by min(π_old/π_beh, C).
    T = max(len(o) for o in olds)
    pad = lambda rows: torch.stack([torch.nn.functional.pad(r, (0, T - len(r))) for r in rows])  # noqa: E731
    old, beh = pad(olds), pad(behs)
    mask = pad([torch.ones(len(o)) for o in olds])
    inputs = dict(logprobs=old.clone().requires_grad_(True), old_logprobs=old, behaviour_logprobs=beh, mask=mask,
                  event_index=torch.tensor([0, 0, 1]), advantages=torch.tensor([1.0, -1.0]))
    cap = 2.0
    _, per_token = policy_loss("grpo", LossInputs(**inputs), LossSettings(tis_cap=cap))
    z = torch.exp(old - beh)[mask.bool()]
    assert float(per_token["tis/weight_mean"]) == pytest.approx(float(z.clamp(max=cap).mean()), rel=1e-5)
    _, per_set = policy_loss("srpo", LossInputs(**inputs), LossSettings(set_reduction="sqrt", tis_cap=cap))
    sets = [(2 ** -0.5) * float((old - beh)[:2][mask[:2].bool()].sum()), float((old - beh)[2][mask[2].bool()].sum())]
    assert float(per_set["tis/weight_mean"]) == pytest.approx(sum(min(math.exp(s), cap) for s in sets) / 2, rel=1e-5)


def test_rows_without_a_grammar_are_drawn_as_before():
    """A grammar on one row leaves the others' draws, log-probs and the generator's stream alone."""
    model, tok = load_model("tiny-llama", seed=0)
    prompt = tok("Hello", add_special_tokens=False)["input_ids"]
    plain = SamplingParams(max_new_tokens=8)
    alone = sample(model, tok, [prompt, prompt], [plain, plain], generator=torch.Generator().manual_seed(3))
    mixed = sample(model, tok, [prompt, prompt],
                   [plain, SamplingParams(max_new_tokens=8, grammar=Grammar('{"type": "object"}'))],
                   generator=torch.Generator().manual_seed(3))
    assert mixed[0].completion_ids == alone[0].completion_ids and mixed[0].logprobs == alone[0].logprobs
    assert mixed[1].text.startswith("{")


def test_structured_replies_write_properties_in_the_schemas_order():
    """``response_format`` with ``reasoning`` listed before ``answer``: the grammar the gateway builds
    keeps that order and the sampled reply writes ``reasoning`` first (a sorted schema would put
    ``answer`` first, before the model has reasoned)."""
    from srpo.gateway.protocol import parse_request

    schema = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 12},
                                               "answer": {"type": "integer"}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    req = parse_request({"model": "s", "messages": [{"role": "user", "content": "2+2?"}],
                         "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
                        chat=True)
    assert req.grammar.schema.index('"reasoning"') < req.grammar.schema.index('"answer"')
    model, tok = load_model("tiny-llama", seed=0)
    prompt = tok("2+2?", add_special_tokens=False)["input_ids"]
    params = [SamplingParams(temperature=1.0, max_new_tokens=40, grammar=req.grammar)] * 2
    for s in sample(model, tok, [prompt] * 2, params, generator=torch.Generator().manual_seed(1)):
        assert s.text.startswith('{"reasoning":'), s.text
