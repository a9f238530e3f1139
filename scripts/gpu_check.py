"""The scale path on a CUDA machine, all at once, in under 10 minutes:

    make gpu-check            # = python scripts/gpu_check.py (needs CUDA, vllm, the embedded model)

1. vLLM engine: generation, then the trainer's teacher-forced log-probs of the same tokens
   (agreement), an in-place weight sync after a weight change, and agreement again.
2. FSDP: one `srpo train` step with `train.parallel: fsdp` under torchrun over the GPUs (≤ 2),
   nccl, a sharded checkpoint written.
3. One SRPO training step of a `parallel_aggregate` team on the vLLM engine.

Prints one line per check and a summary; exits 1 when any check failed.  Written and run on CPU
only up to the CUDA guard: no GPU was available to the session that wrote it (see
docs/scaling.md) — the first GPU run verifies the whole path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOL = 2e-2  # |engine − trainer| per token log-prob, float32 on both sides (TF32 matmuls allowed)


def check_engine() -> str:
    import torch

    from srpo.policies.layouts import GenerationRequest, build_policies
    from srpo.policies.sampling import SamplingParams
    from srpo.rollout.vllm import EngineSettings, VLLMRollout

    policies = build_policies("shared", "smollm2-135m", ["a"])
    policies.model.to("cuda")
    engine = VLLMRollout(policies, "smollm2-135m", dtype="float32", seed=0,
                         settings=EngineSettings(gpu_memory_utilization=0.3, max_model_len=1024))
    try:
        tok = policies.tokenizer
        requests = [GenerationRequest("a", tok(p)["input_ids"], SamplingParams(temperature=1.0, max_new_tokens=32))
                    for p in ["What is 2 + 3?", "Name a colour:", "Count to five:", "The capital of France is"]]

        def gap() -> float:
            samples = engine.generate(requests, torch.Generator().manual_seed(0))
            worst = 0.0
            for r, s in zip(requests, samples):
                ids = torch.tensor([r.prompt_ids + s.completion_ids], device="cuda")
                P = len(r.prompt_ids)
                with torch.no_grad():
                    lp = policies.logprobs("a", ids, torch.ones_like(ids), P, temperature=1.0)[0]
                worst = max(worst, float((lp.cpu() - torch.tensor(s.logprobs)).abs().max()))
            return worst

        before = gap()
        with torch.no_grad():
            for p in policies.parameters("a"):
                p.mul_(1.01)
        engine.update_weights()
        after = gap()
        ok = before < TOL and after < TOL
        return f"{'ok' if ok else 'FAILED'}: max |Δ log p| {before:.2e} before, {after:.2e} after a weight sync (tol {TOL})"
    finally:
        engine.close()


def srpo_train(run: Path, overrides: list[str], nproc: int = 0) -> subprocess.CompletedProcess:
    base = [f"run.output_dir={run}", "run.steps=1", "run.device=cuda", "model.name=smollm2-135m",
            "workflow.options={num_workers: 2}", "workflow.max_new_tokens=64", "train.tasks_per_step=2",
            "train.group_size=4", "task.train.n=8", "log.tensorboard=false", "train.skip_zero_advantage=false",
            *overrides]
    cmd = ["-m", "srpo.cli", "train", "--config", str(ROOT / "configs/math/parallel_aggregate/srpo.yaml"),
           *[x for o in base for x in ("--set", o)]]
    if nproc:
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", str(nproc), *cmd]
    else:
        cmd = [sys.executable, *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=420, env={**os.environ, "PYTHONPATH": str(ROOT)})


def check_fsdp(tmp: Path) -> str:
    import torch

    n = min(torch.cuda.device_count(), 2)
    done = srpo_train(tmp / "fsdp", ["train.parallel=fsdp", "train.activation_checkpointing=true"], nproc=n)
    if done.returncode:
        return f"FAILED (rc {done.returncode}): {done.stderr[-800:]}"
    ok = (tmp / "fsdp" / "checkpoints" / "step_0000001" / "dcp").is_dir()
    return f"{'ok' if ok else 'FAILED'}: one FSDP step on {n} GPU(s), sharded checkpoint {'written' if ok else 'missing'}"


def check_team_on_vllm(tmp: Path) -> str:
    done = srpo_train(tmp / "team", ["rollout.engine=vllm", "rollout.gpu_memory_utilization=0.3", "train.tis_cap=2"])
    if done.returncode:
        return f"FAILED (rc {done.returncode}): {done.stderr[-800:]}"
    row = json.loads((tmp / "team" / "metrics.jsonl").read_text().splitlines()[-1])
    return (f"ok: a parallel_aggregate step on the vLLM engine — reward {row['reward']:.3f}, mismatch "
            f"{row.get('mismatch/mean_abs', float('nan')):.2e} mean |Δ log p|, TIS weight "
            f"{row.get('objective/tis/weight_mean', float('nan')):.3f}, {row['time/rollout_s']:.1f} s rollout")


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("gpu-check: pip install 'srpo[vllm]' first", file=sys.stderr)
        return 2
    started = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("vLLM engine", check_engine), ("FSDP step", lambda: check_fsdp(Path(tmp))),
                         ("team step on vLLM", lambda: check_team_on_vllm(Path(tmp)))):
            t = time.perf_counter()
            try:
                results[name] = fn()
            except Exception as err:  # noqa: BLE001 - report every check, then fail
                results[name] = f"FAILED: {err.__class__.__name__}: {err}"
            print(f"[{time.perf_counter() - t:5.0f} s] {name}: {results[name]}", flush=True)
    print(f"gpu-check: {torch.cuda.get_device_name(0)} × {torch.cuda.device_count()}, "
          f"{(time.perf_counter() - started) / 60:.1f} min")
    return 0 if all(r.startswith("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
