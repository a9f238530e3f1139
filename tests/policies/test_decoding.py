"""Continuous batching in the sampler: rows that join a decode batch while others are generating
continue exactly as they would alone, and the running rows are not disturbed by them."""

from __future__ import annotations

import pytest
import torch

from srpo.policies import LoraSettings, build_policies, load_model
from srpo.policies.decoding import DecodeBatch
from srpo.policies.sampling import sample
from srpo.types import SamplingParams

GREEDY = SamplingParams(max_new_tokens=10, temperature=0)


def _ids(tok, text):
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok(prompt, add_special_tokens=False)["input_ids"]


def _joined_run(model, tok, adapters=None, **kw):
    """Row 0 starts alone; after 3 steps row 1 (a longer prompt: the running row is re-aligned) and
    row 2 (shorter) join; after 2 more, row 3 (a repeat of row 0's prompt) joins.  Returns the rows'
    samples in that order."""
    texts = ["2+2?", "a much longer question than the first one, with many more words in it", "q", "2+2?"]
    prompts = [_ids(tok, t) for t in texts]
    names = adapters or [None] * 4
    batch = DecodeBatch(model, tok, mixed_adapters=adapters is not None, **kw)
    handles = batch.add(prompts[:1], [GREEDY], adapters and names[:1])
    for _ in range(3):
        batch.step()
    assert batch.running == 1
    handles += batch.add(prompts[1:3], [GREEDY, GREEDY], adapters and names[1:3])
    for _ in range(2):
        batch.step()
    handles += batch.add(prompts[3:], [GREEDY], adapters and names[3:])
    while batch.running:
        batch.step()
    alone = [sample(model, tok, [p], GREEDY, adapter_names=adapters and [n], **kw)[0] for p, n in zip(prompts, names)]
    return [batch.pop(h) for h in handles], alone


@pytest.mark.parametrize("fast_decode", [True, False])
def test_rows_that_join_mid_generation_continue_as_they_would_alone(fast_decode):
    model, tok = load_model("tiny-llama")
    model.eval()
    joined, alone = _joined_run(model, tok, fast_decode=fast_decode)
    assert [s.completion_ids for s in joined] == [s.completion_ids for s in alone]
    assert all(len(s.completion_ids) == 10 or s.finish_reason == "eos" for s in joined)
    for a, b in zip(joined, alone):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_mixed_adapter_rows_join_with_their_own_adapters():
    ps = build_policies("lora", "tiny-llama", ["a", "b"], lora=LoraSettings(r=4, alpha=8))
    with torch.no_grad():  # adapters that differ, so that a row decoded with the wrong one shows
        for name, p in ps.model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    joined, alone = _joined_run(ps.model, ps.tokenizer, adapters=["a", "b", "b", "b"])
    assert [s.completion_ids for s in joined] == [s.completion_ids for s in alone]
    for a, b in zip(joined, alone):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert joined[0].completion_ids != joined[3].completion_ids  # one prompt, two adapters: two replies


def test_a_cancelled_row_leaves_and_the_batch_empties():
    model, tok = load_model("tiny-llama")
    model.eval()
    batch = DecodeBatch(model, tok)
    a, b = batch.add([_ids(tok, "hi"), _ids(tok, "2+2?")], [GREEDY, GREEDY])
    batch.step()
    batch.cancel(a)
    assert batch.running == 1
    while batch.running:
        batch.step()
    assert batch.cache is None and batch.live == []  # empty: the next add starts a new batch
    assert batch.pop(a).finish_reason == "cancelled"
    assert batch.pop(b).finish_reason in ("length", "eos")


def test_a_reply_handed_over_while_its_row_is_still_in_the_batch_disturbs_nothing():
    """Rows that finish stay in the decode batch until a quarter of it has (then they are dropped in
    one copy); serving hands each reply over at once — the others continue as they would alone."""
    model, tok = load_model("tiny-llama")
    model.eval()
    prompts = [_ids(tok, t) for t in ["hi", "2+2?", "q", "name a colour", "7*8", "count"]]
    params = [SamplingParams(max_new_tokens=2, temperature=0)] + [GREEDY] * 5
    batch = DecodeBatch(model, tok)
    handles = batch.add(prompts, params)
    done = {}
    while batch.running:
        for h in batch.step():
            done[h] = batch.pop(h)  # the 2-token row's reply leaves while its row is still in the batch
    alone = sample(model, tok, prompts, params)
    assert [done[h].completion_ids for h in handles] == [s.completion_ids for s in alone]
