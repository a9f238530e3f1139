"""Attention in float32 on CPU, even under bf16 autocast.

On CPUs, PyTorch's SDPA kernels are slower in bfloat16 than in float32 at RL sizes (measured
here, one thread: a (16, 9, 64, 104) training forward + backward 51 ms in bf16 vs 28 ms in
float32; a one-token decode step over 100 cached positions 330 µs vs 205 µs), while the matmuls
around attention are much faster in bf16 (AMX).  So srpo registers ``srpo_sdpa`` with
transformers' ``AttentionInterface``: HF's own SDPA function, run with autocast off on float32
query/key/value when the tensors live on a CPU.  On other devices it is HF's SDPA unchanged.
Attention in float32 is also the more accurate choice for the log-prob ratios.
"""

from __future__ import annotations

import torch

ATTENTION_NAME = "srpo_sdpa"


def cpu_float32_sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    with torch.autocast("cpu", enabled=False):
        return sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)


def register() -> None:
    """Register the function and, for its masks, HF's SDPA mask builder (a custom name without a
    mask function would silently get no mask at all)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, cpu_float32_sdpa)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def use_cpu_float32_attention(model) -> bool:
    """Switch a model that uses HF's SDPA to :func:`cpu_float32_sdpa`; False if it uses another kind."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False  # another kind of attention, or a transformers without the interface
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    return True
