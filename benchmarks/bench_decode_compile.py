"""Would a fusing compiler take the decode step's small operations away? srpo's lean decode step
against the same layer loop under ``torch.compile`` (inductor).

SmolLM2-135M-Instruct under bf16 autocast, 16 rows (2 prompts × 8 samples, as benchmark 1's step
samples them), temperature 1, end-of-sequence ignored so that every row decodes ``--steps`` token
steps after the first 9 (by then the call has packed its weights).  Three sides, alternately, each
from the same seed: ``srpo`` (:meth:`FastDecoder.step` as shipped), ``loop`` (the same step's
packed, float32-attention path written as one function of tensors — what the compiler is given)
and ``compiled`` (that function under ``torch.compile(dynamic=True)``; the packed matmuls stay
oneDNN calls, wrapped as an opaque custom op, since inductor cannot lower a matmul on weights packed
outside it).  Printed per side and round: the median milliseconds of a token step; the seconds the warm
steps of a side's first call took (the compiled side compiles there), and for the two new sides the first token step
at which a row's drawn token differs from srpo's (none: the same tokens).

    python benchmarks/bench_decode_compile.py --rounds 3
    python benchmarks/bench_decode_compile.py --rounds 3 --cpp-wrapper   # inductor's C++ wrapper

Not a path srpo takes: the figure is what `benchmarks/README.md` (section 1) rests its statement on.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

ROWS_PER_PROMPT, WARM_STEPS = 8, 9
QUESTIONS = ["What is 23 + 48?", "Compute 71 + 19."]


@torch.library.custom_op("srpo_bench::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
    """oneDNN's matmul on a weight packed by ``_reorder_linear_weight`` (as :class:`PackedLinears`)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


@packed_linear.register_fake
def _(x, weight, out_features):
    return x.new_empty((x.shape[0], out_features))


def layer_loop(x, cos, signed_sin, mask, keys, values, weights, norms, heads: int, kv_heads: int, head_dim: int,
               eps: float, intermediate: int):
    """The decoder layers of one token step, as :meth:`FastDecoder.step` computes them with packed
    bf16 matmuls and float32 attention.  x: (B, H) float32; mask: (B, 1, 1, col + 1) bool; keys and
    values: per layer (B, Hkv, capacity, D) float32, written at column col; weights: per layer the
    packed qkv, o, gate-up and down weights; norms: per layer the two RMS norm weights.  Returns
    (B, H)."""
    B, H = x.shape
    col = mask.shape[-1] - 1
    Hq, Hkv, D = heads, kv_heads, head_dim
    for i in range(len(keys)):
        kb, vb = keys[i], values[i]
        w_qkv, w_o, w_gate_up, w_down = weights[4 * i:4 * i + 4]
        h = F.rms_norm(x, (H,), norms[2 * i], eps)
        qkv = packed_linear(h.to(torch.bfloat16), w_qkv, (Hq + 2 * Hkv) * D).view(B, Hq + 2 * Hkv, D)
        qk = qkv[:, :Hq + Hkv]
        qk = qk * cos + qk.roll(D // 2, -1) * signed_sin
        kb.narrow(2, col, 1).copy_(qk[:, Hq:, None])
        vb.narrow(2, col, 1).copy_(qkv[:, Hq + Hkv:, None])
        q = qk[:, :Hq].reshape(B, Hkv, Hq // Hkv, D)
        out = F.scaled_dot_product_attention(q.float(), kb[:, :, :col + 1], vb[:, :, :col + 1], attn_mask=mask,
                                             scale=D ** -0.5)
        x = x + packed_linear(out.reshape(B, Hq * D).to(torch.bfloat16), w_o, H)
        h = F.rms_norm(x, (H,), norms[2 * i + 1], eps)
        gate, up = packed_linear(h.to(torch.bfloat16), w_gate_up, 2 * intermediate).split(intermediate, dim=-1)
        x = x + packed_linear(F.silu(gate) * up, w_down, H)
    return x


def step_with(loop, mark_dynamic: bool):
    """A replacement for :meth:`FastDecoder.step` that runs ``loop`` over the packed weights (the
    shipped step for the token steps before packing)."""
    from srpo.policies.fast_decode import FastDecoder

    shipped = FastDecoder.step
    gathered: list = [None, [], []]  # a call's packed projections (held: compared by identity), its weights, norms

    def step(self, state, tokens, positions, valid, adapters=None):
        if state.linears is None:
            return shipped(self, state, tokens, positions, valid, adapters)
        model, D, col = self.model.model, self.head_dim, state.length
        packed = state.linears.packed
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            x = F.embedding(tokens, model.embed_tokens.weight)
            cos, sin = model.rotary_emb(x[:, None], positions[:, None])
            signed_sin = torch.cat((-sin[..., :D // 2], sin[..., D // 2:]), dim=-1)
            mask = valid[:, None, None, :col + 1]
            if mark_dynamic:  # the cache's length grows by one a step: one graph for all lengths
                torch._dynamo.mark_dynamic(mask, 3)
            if gathered[0] is not state.linears:  # gathered once a call, not every token step
                gathered[:] = [state.linears,
                               [packed[tuple(id(m) for m in group)][0] for group in self._projections()][:-1],
                               [w for layer in model.layers for w in (layer.input_layernorm.weight,
                                                                      layer.post_attention_layernorm.weight)]]
            weights, norms = gathered[1], gathered[2]
            x = loop(x, cos, signed_sin, mask, state.keys, state.values, weights, norms, self.num_heads,
                     self.num_kv_heads, D, self.eps, model.layers[0].mlp.gate_proj.out_features)
            state.length = col + 1
            return state.linears(self._rms(x, model.norm.weight), self.model.lm_head)

    return step


def run_call(model, tokenizer, prompts, steps: int) -> tuple[list[float], list[list[int]], float]:
    """One sampling call: the warm steps, then ``steps`` timed token steps; returns each timed step's
    seconds, each row's tokens, and the seconds the warm steps took (the compiled side compiles there)."""
    from srpo.policies.decoding import DecodeBatch
    from srpo.types import SamplingParams

    generator = torch.Generator().manual_seed(0)
    batch = DecodeBatch(model, tokenizer)
    handles = batch.add(prompts, [SamplingParams(max_new_tokens=WARM_STEPS + steps + 1)] * len(prompts))
    batch.eos = torch.tensor([-1])  # no row ends early
    start = time.perf_counter()
    for _ in range(WARM_STEPS):
        batch.step(generator)
    warm = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        batch.step(generator)
        times.append(time.perf_counter() - start)
    return times, [batch.tokens[h] for h in handles], warm


def first_difference(a: list[list[int]], b: list[list[int]]) -> int | None:
    """The first token step at which some row's token differs (None: all the same)."""
    steps = [next((t for t, (x, y) in enumerate(zip(ra, rb)) if x != y), None) for ra, rb in zip(a, b)]
    steps = [s for s in steps if s is not None]
    return min(steps) if steps else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="timed token steps per call")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpp-wrapper", action="store_true", help="inductor's C++ wrapper instead of its Python one")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config

    from srpo.policies.fast_decode import FastDecoder
    from srpo.policies.models import load_model

    inductor_config.cpp_wrapper = args.cpp_wrapper
    model, tokenizer = load_model("smollm2-135m")
    model.eval()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True) for q in QUESTIONS]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts for _ in range(ROWS_PER_PROMPT)]
    shipped = FastDecoder.step
    sides = {"srpo": shipped, "loop": step_with(layer_loop, False),
             "compiled": step_with(torch.compile(layer_loop, dynamic=True), True)}
    medians: dict[str, list[float]] = {side: [] for side in sides}
    reference, first_call = None, {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for r in range(args.rounds):
            for side, step in sides.items():
                FastDecoder.step = step
                try:
                    times, tokens, warm = run_call(model, tokenizer, prompts, args.steps)
                finally:
                    FastDecoder.step = shipped
                first_call.setdefault(side, warm)
                medians[side].append(1e3 * statistics.median(times[1:]))
                if side == "srpo":
                    reference = tokens
                differs = "" if side == "srpo" else f", first token differing from srpo's at step {first_difference(reference, tokens)}"
                print(f"round {r + 1} {side}: {medians[side][-1]:.2f} ms a token step{differs}", flush=True)
    print(f"\ntorch threads {args.threads}; cpp_wrapper {args.cpp_wrapper}; {args.steps} timed steps a call\n")
    print("| side | ms a token step, median of each round | warm steps of its first call, s |\n|---|---:|---:|")
    for side, values in medians.items():
        print(f"| {side} | {', '.join(f'{v:.2f}' for v in values)} | {first_call[side]:.1f} |")


if __name__ == "__main__":
    main()
