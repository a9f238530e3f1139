"""FSDP2 sharding of a full model (``train.parallel: fsdp``): parameters, gradients and optimizer
state split across ranks.

Each decoder layer is one FSDP unit; the rest (embeddings, final norm, the tied head) belongs to
the root unit, a :class:`LogProbModule` whose ``forward`` is srpo's log-prob pass.  That matters:
the pass reads the head's weight directly (the fused projection + log-softmax never builds the
full logits), and FSDP hands a unit its full parameters only inside that unit's forward.

- Training forwards run through the root, so FSDP all-gathers each unit just in time and
  reduce-scatters its gradients in the backward.  The gradients are *summed* across ranks, not
  averaged (``set_gradient_divide_factor(1)``): srpo divides every loss by the global unit
  count, so the sum is the gradient of the whole batch, as in the data-parallel path.
- Sampling runs on gathered parameters (:func:`gathered`): every unit is unsharded for the
  rollout — the fast decoder reads weights by attribute — and resharded after it.
- Checkpoints: the sharded model and optimizer state go through ``torch.distributed.checkpoint``
  (DCP), which reshards on load, so a checkpoint written by N processes resumes on M; the full
  weights are also gathered to rank 0 and written in HF format for evaluation and inference.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from srpo.policies.logprobs import completion_logprobs


class LogProbModule(nn.Module):
    """The root FSDP unit: ``forward`` is :func:`completion_logprobs` of the wrapped model."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, prompt_length, action_mask=None, temperature=1.0,
                chunk_tokens: int = 1024, return_entropy: bool = False, checkpoint_layers: bool = False):
        return completion_logprobs(self.model, input_ids, attention_mask, prompt_length, action_mask=action_mask,
                                   temperature=temperature, chunk_tokens=chunk_tokens, return_entropy=return_entropy,
                                   checkpoint_layers=checkpoint_layers)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the largest ``nn.ModuleList`` in the model (``model.layers`` for
    Llama, Qwen2, Gemma-3 ...)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"{type(model).__name__}: no list of decoder layers to shard")
    return list(max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters())))


def ensure_process_group() -> None:
    """FSDP needs a process group; a single process (no torchrun) gets a one-rank gloo group."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("WORLD_SIZE > 1 but no process group: launch with torchrun")
    store = dist.HashStore()
    backend = "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


def shard(model: nn.Module) -> LogProbModule:
    """Shard ``model`` in place (per decoder layer, then the root) and return its root unit."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    ensure_process_group()
    root = LogProbModule(model)
    for layer in decoder_layers(model):
        fully_shard(layer)
    # The root is resharded after its forward too (FSDP's default keeps a root unsharded until its
    # backward): after a no-grad pass there is no backward, and a root left unsharded is re-created
    # with new parameter objects by its next unshard — objects the optimizer does not hold.
    fully_shard(root, reshard_after_forward=True)
    for unit in root.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)  # sum over ranks: the loss is normalised globally
            unit.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return root


def units(root: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in root.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(roots: list[nn.Module]):
    """Full parameters in every unit of ``roots`` for the duration (sampling reads them directly).

    Sampling also runs layer forwards (the prompt's prefill), whose FSDP hooks would reshard a
    layer after its forward; that is switched off for the duration."""
    layers = [u for root in roots for u in units(root) if u is not root]
    for u in layers:
        u.set_reshard_after_forward(False)
    all_units = [u for root in roots for u in units(root)]
    for u in all_units:
        u.unshard()
    try:
        yield
    finally:
        for u in all_units:
            u.reshard()
        for u in layers:
            u.set_reshard_after_forward(True)


def full_state_dict(root: LogProbModule) -> dict[str, torch.Tensor]:
    """The wrapped model's full state dict on rank 0 (CPU), ``{}`` elsewhere; a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k.removeprefix("model."): v for k, v in sd.items()}


def set_full_state_dict(root: LogProbModule, state: dict[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state dict of the wrapped model into the shards; every rank passes it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(root, {f"model.{k}": v for k, v in state.items()},
                         options=StateDictOptions(full_state_dict=True, strict=False))


def global_norm_value(norm: torch.Tensor) -> torch.Tensor:
    """``clip_grad_norm_`` over DTensor gradients returns a DTensor; the plain total norm."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
