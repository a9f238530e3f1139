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
- **LoRA** (``model.layout: lora``): the one PEFT model — frozen base, one adapter per policy — is
  sharded once; every policy's log-prob pass runs through the same root with its adapter active
  (:class:`AdapterPass`), so each pass's backward reduce-scatters that adapter's gradients only
  (FSDP2 reduces the parameters that received a gradient; every rank runs the policies in one
  order, with idle passes, so each reduce-scatter carries the same parameters on every rank).
  Only the adapters are trainable, so only they and their optimizer state are sharded state in
  a checkpoint (``ignore_frozen_params``); the frozen base comes from ``model.name`` again.
- **KL reference** (``method.kl_coef`` > 0): the frozen reference of a full-model layout is
  sharded like the policy (its own roots: one shard of the weights per rank, gathered layer by
  layer in its forward); a LoRA policy's reference is the same root with the adapters switched
  off.  Its forwards are collectives too, so ranks run them alike (idle passes included).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from srpo.parallel.base import DataParallel, register_backend
from srpo.parallel.devices import device_type, process_group_backend
from srpo.policies.activation_checkpointing import decoder_layers
from srpo.policies.logprobs import LogprobPass, completion_logprobs


class LogProbModule(nn.Module):
    """The root FSDP unit: ``forward`` is :func:`completion_logprobs` of the wrapped model.

    Each backbone call all-gathers every layer, and ranks must issue the same collectives in the
    same order, so every pass makes the same number of backbone calls whatever its rows
    (``fixed_calls``): ``length_groups`` groups of similar length (prompt + completion; completion
    alone after a shared prompt pass) — each rank groups its own rows, and a group it cannot fill
    runs one token — after one prompt pass when ``share_prompts``.  Nothing about the other ranks'
    rows is needed to agree."""

    def __init__(self, model: nn.Module, length_groups: int = 1, share_prompts: bool = False):
        super().__init__()
        self.model = model
        self.length_groups, self.share_prompts = length_groups, share_prompts

    def forward(self, input_ids, attention_mask, prompt_length, action_mask=None, temperature=1.0,
                return_entropy: bool = False, how: LogprobPass = LogprobPass()):
        """The policy set's pass (``how``: its chunking and checkpointing), with this root's
        length groups, prompt sharing and a fixed number of backbone calls."""
        how = replace(how, share_prompts=self.share_prompts, max_length_groups=self.length_groups, fixed_calls=True)
        return completion_logprobs(self.model, input_ids, attention_mask, prompt_length, action_mask=action_mask,
                                   temperature=temperature, return_entropy=return_entropy, how=how)


def ensure_process_group(run_device: str = "cpu") -> None:
    """FSDP needs a process group; a single process (no torchrun) gets a one-rank group on the
    backend of ``run.device`` (gloo for a CPU run, also on a machine with GPUs)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("WORLD_SIZE > 1 but no process group: launch with torchrun")
    dist.init_process_group(process_group_backend(run_device), store=dist.HashStore(), rank=0, world_size=1)
    from srpo.parallel.teardown import mark_process_group_used

    mark_process_group_used()
    # Torn down before the interpreter's own teardown: a gloo group destroyed at exit with its
    # threads still running can abort the process ("terminate called without an active exception")
    # after everything succeeded.
    import atexit

    atexit.register(lambda: dist.destroy_process_group() if dist.is_initialized() else None)


def mixed_precision(root: bool):
    """FSDP's bf16 policy: parameters gathered in bfloat16, gradients reduced in float32 (the float32
    shards stay the master weights).  The root does not cast its forward's inputs: they include the
    per-row sampling temperature, which bfloat16 would round (0.7 → 0.6992) — the trainer's
    log-probs would then be of another distribution than the sampler's, biasing every ratio and
    TIS weight.  Its integer inputs are never cast, and the layers cast their own inputs."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=not root)


def shard(model: nn.Module, run_device: str = "cpu", bf16_compute: bool = False, length_groups: int = 1,
          share_prompts: bool = False) -> LogProbModule:
    """Shard ``model`` in place (per decoder layer, then the root) and return its root unit.

    The mesh is built for ``run.device``'s device type — ``fully_shard`` without one takes the CUDA
    mesh whenever CUDA is available, whatever the run asked for.  ``bf16_compute``:
    :func:`mixed_precision` (the backend asks for it on CUDA with ``model.autocast_bf16``); without
    it FSDP communicates in float32."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    ensure_process_group(run_device)
    mesh = init_device_mesh(device_type(run_device), (dist.get_world_size(),))
    root = LogProbModule(model, length_groups, share_prompts)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, **({"mp_policy": mixed_precision(root=False)} if bf16_compute else {}))
    # The root is resharded after its forward too (FSDP's default keeps a root unsharded until its
    # backward): after a no-grad pass there is no backward, and a root left unsharded is re-created
    # with new parameter objects by its next unshard — objects the optimizer does not hold.
    fully_shard(root, mesh=mesh, reshard_after_forward=True,
                **({"mp_policy": mixed_precision(root=True)} if bf16_compute else {}))
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


def full_state_dict(root: LogProbModule, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The wrapped model's full state dict on rank 0 (CPU), ``{}`` elsewhere; a collective.
    ``trainable_only``: the parameters that train (a LoRA model's adapters), the frozen ones left out."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                             ignore_frozen_params=trainable_only))
    return {k.removeprefix("model."): v for k, v in sd.items()}


def set_full_state_dict(root: LogProbModule, state: dict[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state dict of the wrapped model into the shards; every rank passes it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(root, {f"model.{k}": v for k, v in state.items()},
                         options=StateDictOptions(full_state_dict=True, strict=False))


class AdapterPass:
    """The log-prob pass of one LoRA policy: its adapter made active, then the shared root's forward."""

    def __init__(self, root: LogProbModule, policies, policy_id: str):
        self.root, self.policies, self.policy_id = root, policies, policy_id

    def __call__(self, *args, **kwargs):
        self.policies.model_for(self.policy_id)  # set_adapter: this policy's LoRA weights take part
        return self.root(*args, **kwargs)


class AdaptersOffPass:
    """A LoRA policy's reference pass: the shared root's forward with every adapter switched off
    (the frozen base)."""

    def __init__(self, root: LogProbModule, policies):
        self.root, self.policies = root, policies

    def __call__(self, *args, **kwargs):
        try:
            with self.policies.model.disable_adapter():
                return self.root(*args, **kwargs)
        finally:  # PEFT re-enables only the active adapter's gradients; every adapter trains
            self.policies.enable_adapter_grads()


@register_backend("fsdp", shards_parameters=True)
class FullyShardedDataParallel(DataParallel):
    """The FSDP2 backend (``train.parallel: fsdp``): every policy's model sharded across ranks."""

    #: Length groups per pass when train.length_groups is unset: on the demo's work under 2 gloo
    #: ranks (benchmarks/bench_fsdp_padding.py) 2 groups ran 0.71× the token slots of one padded
    #: call and updated 1.20× faster; 4 groups ran 0.47× the slots but their extra all-gathers
    #: made the update no faster (0.98×).
    DEFAULT_LENGTH_GROUPS = 2

    def __init__(self, run_device: str = "cpu", bf16_compute: bool = False, length_groups: int | None = None,
                 share_prompts: bool = False, silence_report_s: float = 30.0):
        ensure_process_group(run_device)  # one process without torchrun still shards (over one rank)
        super().__init__(silence_report_s=silence_report_s)
        self.run_device, self.bf16_compute = run_device, bf16_compute
        self.length_groups = length_groups or self.DEFAULT_LENGTH_GROUPS
        self.share_prompts = share_prompts
        self.roots: dict[str, LogProbModule] = {}  # the sharded roots: a policy's each, or one for lora
        self.passes: dict = {}  # policy id → its log-prob pass (a root, or an AdapterPass)
        self.reference_passes: dict = {}  # policy id → its KL reference's pass (method.kl_coef > 0)
        self.reference_roots: dict[str, LogProbModule] = {}
        self._gathered_depth = 0

    @classmethod
    def from_config(cls, cfg) -> "FullyShardedDataParallel":
        return cls(cfg.run.device, bf16_compute=cfg.model.autocast_bf16, length_groups=cfg.train.length_groups,
                   share_prompts=cfg.train.fsdp_share_prompts,
                   silence_report_s=cls.silence_report_for(cfg.run.collective_timeout_s))

    def wrap(self, policies) -> None:
        """Shard every policy's model — or, for ``lora``, the one PEFT model — and its KL reference
        when it has one (before the optimizers: they hold the sharded parameters); route the
        log-prob passes through the roots."""
        shard_ = functools.partial(shard, run_device=self.run_device,
                                   bf16_compute=self.bf16_compute and device_type(self.run_device) == "cuda",
                                   length_groups=self.length_groups, share_prompts=self.share_prompts)
        if policies.layout == "lora":
            root = shard_(policies.model)
            self.roots = {"adapters": root}
            self.passes = {pid: AdapterPass(root, policies, pid) for pid in policies.policy_ids}
            self.reference_passes = {pid: AdaptersOffPass(root, policies) for pid in policies.policy_ids}
        else:
            self.roots = {pid: shard_(policies.model_for(pid)) for pid in policies.policy_ids}
            self.passes = dict(self.roots)
            if policies.has_reference():  # method.kl_coef > 0: sharded like the policy, never trained
                self.reference_roots = {pid: shard_(policies.reference_model(pid)) for pid in policies.policy_ids}
                self.reference_passes = dict(self.reference_roots)
        policies.logprob_modules = dict(self.passes)
        policies.reference_modules = dict(self.reference_passes)
        policies.sampling_check = self._require_gathered
        with torch.no_grad():  # FSDP sets itself up on the root's first forward, which must come first
            for pid in policies.policy_ids:
                self._idle_forward(policies, pid)
            for pid in self.reference_roots:
                self._idle_forward(policies, pid, reference=True)

    def _require_gathered(self) -> None:
        if not self._gathered_depth:
            raise RuntimeError("FSDP-sharded policies sample only inside backend.gathered(policies) (entered by "
                               "every rank alike, e.g. once per rollout)")

    @contextlib.contextmanager
    def gathered(self, policies):
        """Full parameters for sampling (a collective: every rank enters it the same number of
        times — once per rollout); a no-op when already inside."""
        if self._gathered_depth:
            yield
            return
        self._gathered_depth += 1
        try:
            with gathered(list(self.roots.values())):
                yield
        finally:
            self._gathered_depth -= 1

    def reduce_gradients(self, params) -> None:
        """Nothing: FSDP's backward already reduce-scattered (summed) every gradient."""

    def _idle_forward(self, policies, policy_id: str, reference: bool = False) -> torch.Tensor:
        """A one-token pass through ``policy_id``'s root unit: 0 with a graph through every unit.

        The one completion token is *selected* (action mask 1): with nothing selected the head is
        never used and the result is a constant, so the backward would skip the model — no
        reduce-scatter on this rank while the others issue theirs, pairing one policy's gradients
        with another's (seen as wrong weights with the ``separate`` layout on gloo)."""
        run = (self.reference_passes if reference else self.passes)[policy_id]
        device = next(iter(next(iter(self.roots.values())).parameters())).device
        ids = torch.full((1, 2), int(policies.tokenizer.pad_token_id or 0), dtype=torch.long, device=device)
        out = run(ids, torch.ones_like(ids), 1, action_mask=torch.ones(1, 1, device=device))
        return out.sum() * 0.0

    def idle_pass(self, policies, policy_ids, *, grad: bool, reference: bool = False) -> torch.Tensor:
        """FSDP's all-gathers and reduce-scatters are collectives every rank must join: a rank with
        nothing of its own to forward runs each of ``policy_ids``' passes (``reference``: their KL
        references') on one token, in the same order as every other rank, and adds the zero to its loss."""
        with torch.set_grad_enabled(grad and not reference):
            return sum(self._idle_forward(policies, pid, reference) for pid in policy_ids)

    def full_state_dicts(self, policies) -> dict[str, dict[str, torch.Tensor]]:
        """Every policy's full weights on rank 0 (``{}`` elsewhere) — for ``lora`` its adapter's
        tensors only (the base is frozen); a collective."""
        if policies.layout == "lora":
            policies.enable_adapter_grads()  # "trainable" below is read from requires_grad
            adapters = full_state_dict(self.roots["adapters"], trainable_only=True)
            return {pid: {n: t for n, t in adapters.items() if policies.is_adapter_tensor(n, pid)}
                    for pid in policies.policy_ids}
        return {pid: full_state_dict(root) for pid, root in self.roots.items()}

    def _dcp_state(self, optimizers) -> dict:
        """What DCP writes: per root its (sharded) model state and its optimizers' state — for
        ``lora`` the adapters and every policy's optimizer, the frozen base left out."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        if "adapters" in self.roots:
            model, optim = get_state_dict(self.roots["adapters"], [optimizers[pid] for pid in sorted(optimizers)],
                                          options=StateDictOptions(ignore_frozen_params=True))
            # ignore_frozen_params keeps a tied head's second name (lm_head.weight: the frozen
            # embedding, which named_parameters lists once): adapters only, by name.
            return {"adapters": {"model": {k: v for k, v in model.items() if ".lora_" in k}, "optim": optim}}
        return {pid: dict(zip(("model", "optim"), get_state_dict(root, optimizers[pid])))
                for pid, root in self.roots.items()}

    def save_sharded(self, folder: Path, policies, optimizers) -> None:
        """Every rank writes its shards of model and optimizer into ``folder/dcp`` (DCP)."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._dcp_state(optimizers), checkpoint_id=str(Path(folder) / "dcp"))

    def load_sharded(self, folder: Path, policies, optimizers) -> None:
        """Model and optimizer shards from ``folder/dcp``, resharded to this run's number of ranks."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        state = self._dcp_state(optimizers)
        dcp.load(state, checkpoint_id=str(Path(folder) / "dcp"))
        if "adapters" in self.roots:
            set_state_dict(self.roots["adapters"], [optimizers[pid] for pid in sorted(optimizers)],
                           model_state_dict=state["adapters"]["model"], optim_state_dict=state["adapters"]["optim"],
                           options=StateDictOptions(ignore_frozen_params=True, strict=False))
            return
        for pid, root in self.roots.items():
            set_state_dict(root, optimizers[pid], model_state_dict=state[pid]["model"],
                           optim_state_dict=state[pid]["optim"])
