"""A lean one-token decode step for Llama-family models (Llama, SmolLM, Qwen2), used by sampling.

Why: a token step through the transformers modules pays for generality at every layer — mask
construction, cache-object bookkeeping, a growing ``torch.cat`` per layer for the KV cache — on
top of the matmuls.  This step computes the same thing as the HF forward for one new token per
row, with a static KV cache (preallocated once per sampling call, written in place) from which
finished rows are dropped.  It is an *inference* path only: the prefill and every training
forward still go through the HF model, and tests check it against HF (the same logits in float32,
the same samples from the same generator, in float32 and under bf16 autocast).

Numerics follow HF under the ambient autocast: the residual stream and the RMS norms stay in the
parameters' dtype, matmuls run in the autocast dtype, rotary embeddings come from the model's own
``rotary_emb`` module (so any rope scaling it implements is honoured), grouped-query attention is
packed as HF packs it for one-token steps, and attention runs in float32 when the model uses
srpo's CPU attention (:mod:`srpo.policies.attention`), as the HF forward then does.

The step reads the live parameters on every call; nothing is packed or cached across calls.  An
optimizer updates weights in place without a trace a cache could check (fused AdamW does not even
bump tensor version counters), so a packed copy could silently go stale.  Under autocast each
weight is cast once per autocast region by autocast's own weight-cast cache, as in the HF forward.

Models outside the family — other architectures, PEFT-wrapped models (mixed-adapter batches),
sliding-window attention, activations other than SiLU — get ``None`` from
:func:`fast_decoder_for`, and sampling takes the HF step.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from srpo.policies.attention import ATTENTION_NAME

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def _supported(model) -> bool:
    cfg = getattr(model, "config", None)
    if cfg is None or hasattr(model, "peft_config") or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        return False
    if getattr(cfg, "use_sliding_window", False):
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        return False
    inner = getattr(model, "model", None)
    return (getattr(inner, "layers", None) is not None and hasattr(inner, "rotary_emb")
            and hasattr(model, "lm_head"))


@dataclass
class DecodeState:
    """Static KV buffers, one (B, Hkv, capacity, D) pair per layer, filled up to ``length`` columns."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished rows: later steps compute only for the rows still sampling."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]


class FastDecoder:
    """The one-token decode step of one Llama-family model."""

    def __init__(self, model):
        cfg = model.config
        self.model = model
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        # Follow the model's attention: srpo's float32 SDPA (which it applies on CPU only), or HF's
        # SDPA under the ambient autocast.
        device = next(model.parameters()).device
        self.float32_attention = getattr(cfg, "_attn_implementation", None) == ATTENTION_NAME and device.type == "cpu"

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """LlamaRMSNorm: normalise in float32, scale by the weight in the input's dtype."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x32.to(x.dtype)

    def start(self, hf_cache, expand: torch.Tensor, capacity: int) -> DecodeState:
        """Copy a prefill's HF cache into static buffers of ``capacity`` columns.

        hf_cache: the DynamicCache of the prefill over U distinct prompts, (U, Hkv, P, D) per layer.
        expand: (B,) which distinct prompt each row continues.
        """
        keys, values = [], []
        for layer in hf_cache.layers:
            k, v = layer.keys, layer.values
            _, Hkv, P, D = k.shape
            # float32 attention reads float32 buffers (values arrive in bf16 under autocast: exact).
            kb = k.new_empty((expand.numel(), Hkv, capacity, D), dtype=torch.float32 if self.float32_attention else k.dtype)
            vb = v.new_empty((expand.numel(), Hkv, capacity, D), dtype=torch.float32 if self.float32_attention else v.dtype)
            kb[:, :, :P] = k[expand]
            vb[:, :, :P] = v[expand]
            keys.append(kb)
            values.append(vb)
        return DecodeState(keys=keys, values=values, length=P)

    @torch.no_grad()
    def step(self, state: DecodeState, tokens: torch.Tensor, positions: torch.Tensor,
             valid: torch.Tensor) -> torch.Tensor:
        """Feed one token per row, return the next-token logits.

        tokens: (B,) fed at cache column ``state.length``; positions: (B,) their rotary positions;
        valid: (B, state.length + 1) bool, the columns each row attends to (its left padding is
        False).  Returns (B, V) logits (in the autocast dtype under autocast).
        """
        model = self.model.model
        B = tokens.shape[0]
        col = state.length
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        half = D // 2
        x = F.embedding(tokens, model.embed_tokens.weight)  # (B, H) in the parameters' dtype
        cos, sin = model.rotary_emb(x[:, None], positions[:, None])  # (B, 1, D) each
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, 1, D): broadcast over heads
        mask = valid[:, None, None, :col + 1]  # (B, 1, 1, col + 1)
        for layer, kb, vb in zip(model.layers, state.keys, state.values):
            att, mlp = layer.self_attn, layer.mlp
            h = self._rms(x, layer.input_layernorm.weight)
            q = F.linear(h, att.q_proj.weight, att.q_proj.bias).view(B, Hq, 1, D)
            k = F.linear(h, att.k_proj.weight, att.k_proj.bias).view(B, Hkv, 1, D)
            v = F.linear(h, att.v_proj.weight, att.v_proj.bias).view(B, Hkv, 1, D)
            q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
            k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
            kb[:, :, col:col + 1] = k
            vb[:, :, col:col + 1] = v
            # The G = Hq/Hkv query heads of each key/value head go in as G query positions (HF's
            # pack_gqa for one-token steps): no key/value repeat, and ~5× faster on CPU than
            # SDPA's enable_gqa path at these sizes.
            with torch.autocast(x.device.type, enabled=False) if self.float32_attention else nullcontext():
                out = F.scaled_dot_product_attention(
                    (q.float() if self.float32_attention else q).view(B, Hkv, Hq // Hkv, D),
                    kb[:, :, :col + 1], vb[:, :, :col + 1], attn_mask=mask, scale=D ** -0.5)  # (B, Hkv, G, D)
            x = x + F.linear(out.reshape(B, Hq * D), att.o_proj.weight, att.o_proj.bias)
            h = self._rms(x, layer.post_attention_layernorm.weight)
            gate = F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)
            up = F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
            x = x + F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        state.length = col + 1
        h = self._rms(x, model.norm.weight)
        return F.linear(h, self.model.lm_head.weight, self.model.lm_head.bias)


def fast_decoder_for(model) -> FastDecoder | None:
    """The lean decode step for ``model``, or None when the model is outside the supported family."""
    return FastDecoder(model) if _supported(model) else None
