"""Activation checkpointing of the decoder layers in the update's log-prob pass.

Each decoder layer's forward runs under ``torch.utils.checkpoint`` (non-reentrant): only its
inputs are kept, and its activations are recomputed, one layer at a time, in the backward.

The clash it solves: the update runs each distinct prompt once and continues every completion
from that prompt's KV cache.  A layer *appends* its keys and values to the cache object during
its forward; a recomputation would append them a second time and attend over a doubled prefix.
Here the layer's cached prefix is handed to the checkpointed function as plain tensors, and each
run — the forward and the recomputation — builds its own one-layer cache from them, so both see
exactly the same prefix; the real cache then receives the appended keys and values once.
HF's own ``gradient_checkpointing_enable`` instead turns the cache off in training, and only acts
in train mode (srpo keeps models in eval mode: no dropout).

LoRA: the update runs one policy's pass with its adapter active, then the next policy's, and the
backward of all of them comes later — so a layer recomputed in the backward would run under
whichever adapter is active *then*.  Each checkpointed forward therefore records which adapter its
LoRA layers had active (and whether adapters were disabled) and the recomputation runs under that.
"""

from __future__ import annotations

import contextlib
import inspect
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

CACHE_NAMES = ("cache", "past_key_values", "past_key_value")

_MMAP_THRESHOLD_SET = False

# torch's checkpoint records the shape, dtype and device of every tensor a forward saves, to
# compare with its recomputation's: Python work on each of the thousands of tensors an update
# saves.  What it would catch here (a recomputation that sees another prefix or another adapter)
# the tests catch instead, comparing log-probs and gradients with and without checkpointing
# (tests/policies, tests/train).  Without it, and with the one-layer caches built without reading
# the config (below), benchmark 1's update ran 0.22 s faster (median of 8 alternated pairs in one
# process, 2.75 → 2.47 s; benchmarks/README.md).
CHECK = {"determinism_check": "none"}


def return_freed_blocks_to_the_os(threshold: int = 8 << 20) -> bool:
    """glibc: serve allocations ≥ ``threshold`` bytes by mmap, so freed ones go back to the OS.

    By default glibc raises its mmap threshold each time a large block is freed and then keeps
    later large blocks in its heap: with checkpointing, the recomputed activations are freed
    layer by layer, yet the process's RSS stays ~1.7 GB above what is live on a 135M model
    (benchmarks/README.md, row 5).  Fixing the threshold (what ``MALLOC_MMAP_THRESHOLD_`` does)
    returns them.  Why 8 MiB: at 1 MiB every mid-sized tensor is a fresh mmap and its pages are
    faulted in again each time — the demo's step took 1.77× as long with checkpointing as
    without; at 8 MiB 0.98× (2026-12-02, benchmarks/bench_memory.py; peak 3.67 GB against 3.28 GB
    at 1 MiB and 6.00 GB without checkpointing; later runs of the same benchmark, threshold at
    8 MiB, measured 1.18–1.29×).  A no-op elsewhere (not glibc) and when the environment already
    sets it.  Returns whether the setting took effect."""
    global _MMAP_THRESHOLD_SET
    import ctypes
    import os

    if _MMAP_THRESHOLD_SET or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return _MMAP_THRESHOLD_SET
    try:
        libc = ctypes.CDLL("libc.so.6")
        _MMAP_THRESHOLD_SET = bool(libc.mallopt(-3, int(threshold)))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        _MMAP_THRESHOLD_SET = False
    return _MMAP_THRESHOLD_SET


def _cache_arg(layer) -> str | None:
    params = inspect.signature(layer.forward).parameters
    return next((n for n in CACHE_NAMES if n in params), None)


def _layer_index(layer, fallback: int) -> int:
    attn = getattr(layer, "self_attn", None)
    return getattr(attn, "layer_idx", fallback)


def _one_layer_cache(model, index: int, keys, values, lazy: bool):
    """A cache whose layer ``index`` holds ``keys``/``values`` (or nothing yet).

    ``lazy``: the real cache's layer ``index`` is a plain full-attention ``DynamicLayer``, which a
    cache built without the config creates on first use.  Built with the config, a cache reads
    every layer's type from it (transformers' config attributes are slow to read) — twice a layer,
    the forward and its recomputation, for every backbone call of an update."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache() if lazy else DynamicCache(config=model.config)
    except TypeError:  # older transformers
        cache = DynamicCache()
    if keys is not None:
        cache.update(keys, values, index)
    return cache


def _is_plain_dynamic_layer(slot) -> bool:
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # older transformers: no layer classes
        return False
    return type(slot) is DynamicLayer


def _adapter_state(tuners: list[nn.Module]) -> list[tuple]:
    """Which adapter each PEFT tuner layer has active now, and whether adapters are disabled."""
    return [(m, m._active_adapter, getattr(m, "_disable_adapters", None)) for m in tuners]


@contextlib.contextmanager
def _adapters_as(state: list[tuple]):
    """Run with the tuner layers' adapter state as recorded in ``state``; put back what was there."""
    now = _adapter_state([m for m, _, _ in state])
    for m, active, disabled in state:
        m._active_adapter = active
        if disabled is not None:
            m._disable_adapters = disabled
    try:
        yield
    finally:
        for m, active, disabled in now:
            m._active_adapter = active
            if disabled is not None:
                m._disable_adapters = disabled


def _checkpointed_forward(model, index: int, cache_name: str | None, tuners: list[nn.Module], original,
                          hidden_states, *args, **kwargs):
    if not torch.is_grad_enabled():  # nothing is kept for a backward anyway
        return original(hidden_states, *args, **kwargs)
    state = _adapter_state(tuners)  # the recomputation runs under this forward's adapter
    context = {"context_fn": lambda: (contextlib.nullcontext(), _adapters_as(state))} if tuners else {}
    cache = kwargs.get(cache_name) if cache_name else None
    if cache is None:
        return checkpoint(original, hidden_states, *args, use_reentrant=False, **CHECK, **context, **kwargs)
    slot = cache.layers[index]
    lazy = _is_plain_dynamic_layer(slot)
    prefix_k = slot.keys if getattr(slot, "is_initialized", slot.keys is not None) else None
    prefix_v = slot.values if prefix_k is not None else None
    rest = {k: v for k, v in kwargs.items() if k != cache_name}

    def run(h, k0, v0):
        own = _one_layer_cache(model, index, k0, v0, lazy)
        out = original(h, *args, **{cache_name: own}, **rest)
        return out, own.layers[index].keys, own.layers[index].values

    out, keys, values = checkpoint(run, hidden_states, prefix_k, prefix_v, use_reentrant=False, **CHECK, **context)
    # The real cache gets this layer's appended keys and values once (later layers read nothing
    # from it, but the cache's length bookkeeping stays true).
    if prefix_k is None:
        cache.update(keys, values, index)
    else:
        slot.keys, slot.values = keys, values
    return out


@contextlib.contextmanager
def activation_checkpointing(model, enabled: bool = True):
    """Checkpoint every decoder layer of ``model`` for the duration (a no-op when not ``enabled``)."""
    if not enabled:
        yield
        return

    layers = decoder_layers(model)
    saved = []
    for i, layer in enumerate(layers):
        original = layer.forward
        cache_name = _cache_arg(layer)
        saved.append((layer, "forward" in layer.__dict__, layer.__dict__.get("forward")))
        tuners = [m for m in layer.modules() if hasattr(m, "_active_adapter")]  # PEFT's LoRA layers
        layer.forward = partial(_checkpointed_forward, model, _layer_index(layer, i), cache_name, tuners, original)
    try:
        yield
    finally:
        for layer, had, value in saved:
            if had:
                layer.forward = value
            else:
                del layer.forward


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the largest ``nn.ModuleList`` in the model (``model.layers`` for
    Llama, Qwen2, Gemma-3 ...)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"{type(model).__name__}: no list of decoder layers to shard")
    return list(max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters())))
