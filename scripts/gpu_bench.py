"""``make gpu-bench``: srpo's SRPO step against TRL's GRPOTrainer on one GPU, same work, same GPU.

Random-weight models of real shapes (Qwen3-0.6B and Qwen3-4B configs, their 151,936-token
vocabulary; nothing is downloaded) are built on the spot and saved with a synthetic byte-level
tokenizer padded to the model's vocabulary, so both trainers load the same local folder.  Random
weights rarely draw the end token, so every completion runs to ``--max-new`` tokens and the work is
fixed.  Each (model, side) runs in a fresh child process:

- ``srpo``: the ``single`` workflow with the ``srpo`` method, srpo's own sampler, FSDP2 on one rank
  (``train.parallel: fsdp``), bf16 autocast, every event forwarded (``train.skip_zero_advantage:
  false``, as TRL does);
- ``trl``: ``GRPOTrainer`` (bf16, ``loss_type: grpo``, no KL) with the same prompts, group size,
  completion length, learning rate and reward (a hash of the reply's text — srpo's workflow answer,
  TRL's completion — varied and cheap; with every event forwarded the work does not depend on it).

Reported per run (steps after the first, which warms up): step time and its split (generation /
the rest: the update, and for TRL its reward and bookkeeping), generation tokens/s, update tokens/s (completion tokens trained per second of update),
peak GPU memory (``torch.cuda.max_memory_allocated``), and model FLOP utilisation against the
GPU's dense bf16 peak — FLOPs counted as 2·N per generated token plus 6·N per trained token (N =
all parameters; attention's own FLOPs and srpo's π_old pass are not counted, so MFU is a lower
bound).  A JSON (``--out``) and a markdown table.

    python scripts/gpu_bench.py                                       # the GPU run (make gpu-bench)
    python scripts/gpu_bench.py --device cpu --models tiny --steps 2  # its plumbing on a CPU (tests)

GPU minutes (estimated, not yet measured: no GPU has run it): building and saving the 4B model
~1–2 min on 16 cores, each of the four runs 30–90 s (load, 4 steps of 8 × 8 completions of 256
tokens) — about 6–8 minutes in all on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _child import report, run_child  # noqa: E402 — benchmarks/_child.py: the child-process protocol
from _trl import step_timer  # noqa: E402

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                       max_position_embeddings=40960, rope_theta=1_000_000.0),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                     max_position_embeddings=40960, rope_theta=1_000_000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=2048, tie_word_embeddings=True,
                 max_position_embeddings=1024),
}
# Dense bf16 tensor-core peak, TFLOP/s (NVIDIA's data sheets, without sparsity).
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
SEED, LR = 0, 1e-6


def synthetic_tokenizer(vocab_size: int):
    """srpo's byte-level test tokenizer (``srpo.policies.tiny``) with its vocabulary padded by
    unique byte strings to ``vocab_size``: every id the model can draw decodes to some text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from srpo.policies.tiny import CHATML

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    specials = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
    width = 2
    while len(vocab) < vocab_size - len(specials):  # two-byte strings first (65,536), then three
        for i in range(len(alphabet) ** width):
            if len(vocab) >= vocab_size - len(specials):
                break
            word = "".join(alphabet[(i // len(alphabet) ** k) % len(alphabet)] for k in range(width))
            vocab.setdefault(word, len(vocab))
        width += 1
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>", eos_token="<|im_end|>",
                                  bos_token="<|im_start|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    tok.padding_side = "left"
    assert len(tok) == vocab_size, (len(tok), vocab_size)
    return tok


def build_model_dir(name: str, root: Path) -> tuple[Path, int]:
    """A random-weight model of ``name``'s shape and its tokenizer, saved to ``root/name`` (bf16);
    its folder and its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    out = root / name
    tok = synthetic_tokenizer(SHAPES[name]["vocab_size"])
    config = Qwen3Config(**SHAPES[name], pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def reward_of(text: str) -> float:
    """A varied, cheap reward both sides share: a hash of the completion's text in [0, 1]."""
    return (zlib.crc32(text.encode("utf-8", "replace")) % 1000) / 999


def prompts(n: int) -> list[str]:
    """The benchmark's questions (the train part of srpo's synthetic arithmetic, in a fixed order)."""
    from srpo.build import config_from_dict, train_tasks

    tasks = train_tasks(config_from_dict({"task": {"kind": "math", "train": {
        "source": "synthetic_arithmetic", "level": 2, "n": max(n, 64), "seed": SEED}}}))
    return [t.question for t in tasks]


def run_srpo(args, path: Path) -> dict:
    import torch

    from srpo.build import config_from_dict
    from srpo.train import Trainer

    cfg = config_from_dict({
        "run": {"output_dir": tempfile.mkdtemp(), "steps": args.steps, "seed": SEED, "device": args.device},
        "model": {"name": str(path), "layout": "shared", "autocast_bf16": True},
        "workflow": {"name": "single", "max_new_tokens": args.max_new, "temperature": 1.0,
                     "roles": {"solver": {"system": ""}}},
        "task": {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 2, "n": 1000, "seed": SEED}},
        "method": {"name": "srpo"},
        "train": {"tasks_per_step": args.prompts, "group_size": args.group, "lr": LR, "max_grad_norm": 1.0,
                  "skip_zero_advantage": False, "parallel": "fsdp"},
        "checkpoint": {"every": 0}, "log": {"backends": []}, "eval": {"every": 0},
    })
    trainer = Trainer(cfg, progress=False, reward_fn=lambda task, answer: reward_of(answer))
    trainer.save = lambda: None  # checkpoint writing is not part of a step
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if args.device.startswith("cuda") else None
    return {"step_s": [h["time/step_s"] for h in history], "generation_s": [h["time/rollout_s"] for h in history],
            "update_s": [h["time/update_s"] for h in history],
            "completion_tokens": [h["team_tokens"] for h in history], "peak_gpu_gib": peak}


def run_trl(args, path: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    data = Dataset.from_list([{"prompt": [{"role": "user", "content": q}]} for q in prompts(args.prompts * args.steps)])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    timer = step_timer()
    generate, generation_s, tokens = model.generate, {}, []

    def timed_generate(*a, **k):  # the generation time of the step in progress, apart from the rest
        start = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            step = len(timer.times)  # steps finished so far: this call belongs to the next
            generation_s[step] = generation_s.get(step, 0.0) + time.perf_counter() - start
    model.generate = timed_generate

    def reward(completions, completion_ids=None, **_):
        if completion_ids is not None:
            tokens.append(sum(len(c) for c in completion_ids))
        return [reward_of(c[0]["content"]) for c in completions]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=args.device == "cpu", bf16=True, max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
        max_completion_length=args.max_new, learning_rate=LR, loss_type="grpo", temperature=1.0, beta=0.0,
        seed=SEED, logging_steps=1, report_to=[], save_strategy="no", dataloader_num_workers=0, max_grad_norm=1.0,
        disable_tqdm=True, shuffle_dataset=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(path), callbacks=[timer])
    trainer.train()
    steps = timer.times
    gen = [generation_s.get(i, 0.0) for i in range(len(steps))]
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if args.device.startswith("cuda") else None
    return {"step_s": steps, "generation_s": gen, "update_s": [s - g for s, g in zip(steps, gen)],
            "completion_tokens": tokens[:len(steps)], "peak_gpu_gib": peak}


SIDES = {"srpo": run_srpo, "trl": run_trl}


def summarise(run: dict, parameters: int, peak_tflops: float | None) -> dict:
    """Medians over the steps after the first; MFU from 2·N per generated and 6·N per trained token."""
    keep = slice(1, None) if len(run["step_s"]) > 1 else slice(None)
    step, gen, upd = (statistics.median(run[k][keep]) for k in ("step_s", "generation_s", "update_s"))
    tokens = statistics.median(run["completion_tokens"][keep]) if run["completion_tokens"] else float("nan")
    n = parameters
    flops = 8 * n * tokens  # 2·N generating each token, 6·N training on it
    return {"step_s": step, "generation_s": gen, "update_s": upd, "completion_tokens": tokens,
            "generation_tokens_per_s": tokens / gen if gen else float("nan"),
            "update_tokens_per_s": tokens / upd if upd > 0 else float("nan"),
            "peak_gpu_gib": run.get("peak_gpu_gib"),
            "mfu": flops / step / (peak_tflops * 1e12) if peak_tflops and n else None}


def side_missing(side: str) -> str | None:
    """Why ``side`` cannot run here (a package not installed), or None."""
    needs = {"srpo": ["pydantic"], "trl": ["trl", "datasets"]}[side]
    missing = [m for m in needs if subprocess.run([sys.executable, "-c", f"import {m}"], capture_output=True).returncode]
    return f"{', '.join(missing)} cannot be imported (not installed?)" if missing else None


def table(results: list[dict]) -> str:
    lines = ["| model | trainer | step (s) | generation (s) | update (s) | gen tokens/s | update tokens/s | "
             "peak GPU (GiB) | MFU |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['side']} | skipped: {r['skipped']} |||||||")
            continue
        s = r["summary"]
        peak = f"{s['peak_gpu_gib']:.1f}" if s["peak_gpu_gib"] is not None else "—"
        mfu = f"{100 * s['mfu']:.1f} %" if s["mfu"] is not None else "—"
        lines.append(f"| {r['model']} | {r['side']} | {s['step_s']:.2f} | {s['generation_s']:.2f} | {s['update_s']:.2f} | "
                     f"{s['generation_tokens_per_s']:.0f} | {s['update_tokens_per_s']:.0f} | {peak} | {mfu} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", default="qwen3-0.6b,qwen3-4b", help=f"comma-separated: {', '.join(SHAPES)}")
    p.add_argument("--sides", default="srpo,trl")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--out", default="runs/gpu_bench.json")
    p.add_argument("--child", choices=list(SIDES), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        report(SIDES[args.child](args, Path(args.model_dir)))
        return 0
    peak = None
    if args.device.startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name()
        peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in gpu), None)
        print(f"{gpu}: bf16 peak {peak} TFLOP/s" if peak else f"{gpu}: bf16 peak unknown, MFU not reported", flush=True)
    results = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            t0 = time.perf_counter()
            path, parameters = build_model_dir(model, Path(tmp))
            print(f"{model}: built and saved in {time.perf_counter() - t0:.0f} s", flush=True)
            for side in args.sides.split(","):
                why = side_missing(side)
                if why:
                    results.append({"model": model, "side": side, "skipped": why})
                    print(f"{model} {side}: skipped ({why})", flush=True)
                    continue
                t0 = time.perf_counter()
                run = run_child([__file__, "--child", side, "--model-dir", path, "--device", args.device,
                                 "--steps", args.steps, "--prompts", args.prompts, "--group", args.group,
                                 "--max-new", args.max_new], env=env, what=f"{model} {side}")
                results.append({"model": model, "side": side, "run": run, "summary": summarise(run, parameters, peak),
                                "wall_s": time.perf_counter() - t0})
                print(f"{model} {side}: {json.dumps(results[-1]['summary'])} ({results[-1]['wall_s']:.0f} s)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": args.device, "bf16_peak_tflops": peak, "results": results},
                                         indent=1))
    print("\n" + table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
