"""Which parameters stand behind which role (SRPO.md, "policy").

Three layouts share one interface, :class:`PolicySet`:

``shared``    one model for every role; roles differ only by prompt.  One policy id: ``shared``.
``lora``      one frozen base model with one PEFT LoRA adapter per policy (a role, or a group of
              roles).  Sampling for several policies runs in *one* batched call with a per-row
              ``adapter_names`` (PEFT allows mixed adapters in eval mode); training forwards run
              per adapter.
``separate``  one full model per policy.

Every policy has the list of parameters its optimizer updates and a version number that goes up
with each optimizer step; members record the version they were sampled with.

Models stay in eval mode (no dropout), so the log-probs recomputed for the update equal the
behaviour log-probs while the weights have not moved; gradients flow in eval mode.  The one
exception is LoRA dropout (``model.lora.dropout`` > 0): the trainer switches the models to training
mode for the update's gradient forward only, where the dropout acts.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from srpo.policies.logprobs import LogprobPass, completion_logprobs
from srpo.policies.models import load_model
from srpo.policies.decoding import DecodeBatch, TeamDecode
from srpo.policies.sampling import sample
from srpo.types import GenerationRequest, Sample

LAYOUTS = ("shared", "lora", "separate")


@dataclass(frozen=True)
class LoraSettings:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "gate_proj")


class PolicySet:
    """Roles → policies → parameters; batched sampling and teacher-forced log-probs."""

    layout: str

    def __init__(self, tokenizer, role_to_policy: dict[str, str], *, logprob_pass: LogprobPass = LogprobPass()):
        self.tokenizer = tokenizer
        self.role_to_policy = dict(role_to_policy)
        self.versions = {pid: 0 for pid in self.policy_ids}
        #: policy id → a module wrapping that policy's model whose ``forward`` is the log-prob pass,
        #: set by a parallel backend (FSDP's root unit, through which its collectives run); empty:
        #: the models are called directly.
        self.logprob_modules: dict[str, torch.nn.Module] = {}
        #: How this set's log-prob passes run (chunking, length groups; a sharding backend's
        #: wrapper keeps the chunking and sets the rest its own way).
        self.logprob_pass = logprob_pass
        #: The same for the KL reference's passes (FSDP: the sharded reference's roots).
        self.reference_modules: dict = {}
        #: Called before every sampling call, when set (FSDP: sampling only on gathered weights).
        self.sampling_check = None

    @property
    def policy_ids(self) -> list[str]:
        return sorted(set(self.role_to_policy.values()))

    def policy_of(self, role: str) -> str:
        try:
            return self.role_to_policy[role]
        except KeyError:
            raise KeyError(f"role {role!r} has no policy; roles: {', '.join(sorted(self.role_to_policy))}") from None

    def version(self, policy_id: str) -> int:
        return self.versions[policy_id]

    def bump_version(self, policy_id: str) -> None:
        self.versions[policy_id] += 1

    # -- to be provided by each layout ------------------------------------------------------------
    def parameters(self, policy_id: str) -> list[torch.nn.Parameter]:
        raise NotImplementedError

    def model_for(self, policy_id: str):
        """The module whose forward computes ``policy_id`` (adapter activated where needed)."""
        raise NotImplementedError

    def generate(self, requests: list[GenerationRequest], generator: torch.Generator | None = None) -> list[Sample]:
        raise NotImplementedError

    def decode_team(self) -> TeamDecode | None:
        """Running decode batches for the team's roles, which requests join as they arrive
        (``srpo serve``'s continuous batching); None where the policies sample otherwise."""
        return None

    def save_pretrained(self, folder: str | Path, state_dicts: dict | None = None) -> None:
        """Every policy's weights in HF format under ``folder``; ``state_dicts`` (policy id → full
        state dict) replaces the models' own tensors — a sharded backend's gathered weights."""
        raise NotImplementedError

    def modules(self) -> list[torch.nn.Module]:
        raise NotImplementedError

    # -- hooks a parallel backend sets (srpo.parallel) ------------------------------------------
    def _save_model(self, model, pid: str, folder: Path, state_dicts) -> None:
        if state_dicts is not None:  # e.g. FSDP: the full weights were gathered for this save
            model.save_pretrained(folder, state_dict=state_dicts[pid])
        else:
            model.save_pretrained(folder)

    def _load_model(self, model, folder: Path) -> None:
        if self.logprob_modules:
            raise RuntimeError("load weights before a parallel backend wraps the policies (srpo.build does)")
        _load_full_model(model, Path(folder))

    def _check_sampling(self) -> None:
        if self.sampling_check is not None:
            self.sampling_check()

    def per_policy(self, requests, sample) -> list[Sample]:
        """Samples for ``requests`` in order, drawn by ``sample(policy_id, its_requests)`` one policy at a time."""
        by_policy: dict[str, list[int]] = defaultdict(list)
        for i, r in enumerate(requests):
            by_policy[self.policy_of(r.role)].append(i)
        out: list[Sample | None] = [None] * len(requests)
        for pid in sorted(by_policy):
            rows = by_policy[pid]
            for i, got in zip(rows, sample(pid, [requests[i] for i in rows])):
                out[i] = got
        return out  # type: ignore[return-value]

    # -- shared behaviour -----------------------------------------------------------------------
    def logprobs(self, policy_id: str, input_ids, attention_mask, prompt_length, *, action_mask=None,
                 temperature=1.0, return_entropy: bool = False, checkpoint_layers: bool = False):
        """(m, T) teacher-forced log-probs of completion tokens under ``policy_id`` (with grad),
        run as the set's :attr:`logprob_pass` says (``checkpoint_layers``: for this pass)."""
        how = replace(self.logprob_pass, checkpoint_layers=checkpoint_layers)
        if self.logprob_modules:  # through the backend's wrapper (FSDP gathers, reduces gradients)
            return self.logprob_modules[policy_id](input_ids, attention_mask, prompt_length, action_mask=action_mask,
                                                   temperature=temperature, return_entropy=return_entropy, how=how)
        return completion_logprobs(self.model_for(policy_id), input_ids, attention_mask, prompt_length,
                                   action_mask=action_mask, temperature=temperature, return_entropy=return_entropy,
                                   how=how)

    def reference_logprobs(self, policy_id: str, input_ids, attention_mask, prompt_length, *, action_mask=None,
                           temperature=1.0) -> torch.Tensor:
        """(m, T) log-probs under the frozen reference (the initial weights), no gradient."""
        with torch.no_grad():
            if self.reference_modules:  # through the backend's wrapper (FSDP gathers the reference's shards)
                return self.reference_modules[policy_id](input_ids, attention_mask, prompt_length,
                                                         action_mask=action_mask, temperature=temperature,
                                                         how=self.logprob_pass)
            return completion_logprobs(self.reference_model(policy_id), input_ids, attention_mask, prompt_length,
                                       action_mask=action_mask, temperature=temperature, how=self.logprob_pass)

    def freeze_reference(self) -> None:
        """Keep a frozen copy of the current weights as the KL reference (call before training)."""
        self._reference = {}
        for pid in self.policy_ids:
            ref = copy.deepcopy(self.model_for(pid)).eval()
            for p in ref.parameters():
                p.requires_grad_(False)
            self._reference[pid] = ref

    def has_reference(self) -> bool:
        """Whether :meth:`freeze_reference` made a separate reference model."""
        return hasattr(self, "_reference")

    def reference_model(self, policy_id: str):
        if not hasattr(self, "_reference"):
            raise RuntimeError("no KL reference: call freeze_reference() before training")
        return self._reference[policy_id]

    def load_pretrained_weights(self, folder: str | Path) -> None:
        """Load weights written by :meth:`save_pretrained` (exact: float tensors round-trip)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Trainable tensors of each policy, for exact checkpoints."""
        return {pid: {f"{i}": p.detach().clone() for i, p in enumerate(self.parameters(pid))} for pid in self.policy_ids}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        for pid in self.policy_ids:
            params = self.parameters(pid)
            if pid not in state or len(state[pid]) != len(params):
                raise ValueError(f"checkpoint does not match policy {pid!r} of this layout")
            with torch.no_grad():
                for i, p in enumerate(params):
                    p.copy_(state[pid][f"{i}"])


def _load_full_model(model, folder: Path) -> None:
    """Load a (possibly sharded) safetensors checkpoint into ``model`` in place; only tied
    weights (not stored separately) may be missing."""
    import json

    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    state = {}
    for f in files:
        state.update(load_file(str(folder / f)))
    result = model.load_state_dict(state, strict=False)
    tied = {n for n, p in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    if getattr(model.config, "tie_word_embeddings", False):
        tied.add("lm_head.weight")
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint {folder} does not match the model: missing {sorted(missing)[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]}")


def _sample_grouped(model, tokenizer, requests, generator, adapter_of=None) -> list[Sample]:
    return sample(
        model, tokenizer, [r.prompt_ids for r in requests], [r.params for r in requests], generator=generator,
        adapter_names=[adapter_of(r.role) for r in requests] if adapter_of else None,
    )


class SharedPolicies(PolicySet):
    layout = "shared"

    def __init__(self, model, tokenizer, roles: list[str], *, logprob_pass: LogprobPass = LogprobPass()):
        super().__init__(tokenizer, {r: "shared" for r in roles}, logprob_pass=logprob_pass)
        self.model = model.eval()

    def parameters(self, policy_id):
        return [p for p in self.model.parameters() if p.requires_grad]

    def model_for(self, policy_id):
        return self.model

    def modules(self):
        return [self.model]

    def generate(self, requests, generator=None):
        self._check_sampling()
        return _sample_grouped(self.model, self.tokenizer, requests, generator)

    def decode_team(self):
        self._check_sampling()
        return TeamDecode({"shared": DecodeBatch(self.model, self.tokenizer)}, lambda role: "shared")

    def save_pretrained(self, folder, state_dicts=None):
        self._save_model(self.model, "shared", Path(folder) / "shared", state_dicts)
        self.tokenizer.save_pretrained(Path(folder) / "shared")

    def load_pretrained_weights(self, folder):
        self._load_model(self.model, Path(folder) / "shared")


class LoraPolicies(PolicySet):
    layout = "lora"

    def __init__(self, base_model, tokenizer, role_to_policy: dict[str, str], settings: LoraSettings = LoraSettings(),
                 *, logprob_pass: LogprobPass = LogprobPass()):
        from peft import LoraConfig, get_peft_model

        super().__init__(tokenizer, role_to_policy, logprob_pass=logprob_pass)
        present = {n.rsplit(".", 1)[-1] for n, _ in base_model.named_modules()}
        targets = [t for t in settings.target_modules if t in present]
        if not targets:
            raise ValueError(f"none of the LoRA target modules {settings.target_modules} exist in this model")
        config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                            target_modules=targets, task_type="CAUSAL_LM")
        first, *rest = self.policy_ids
        self.model = get_peft_model(base_model, config, adapter_name=first)
        for pid in rest:
            self.model.add_adapter(pid, config)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.enable_adapter_grads()

    def enable_adapter_grads(self):
        # PEFT's set_adapter freezes the inactive adapters; every policy keeps its own optimizer,
        # so all adapters stay trainable and only the active one takes part in a forward.
        for name, p in self.model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.requires_grad_(True)

    def parameters(self, policy_id):
        # Looked up each time, not kept: FSDP replaces the module's parameters by sharded ones.
        return [p for n, p in self.model.named_parameters() if self.is_adapter_tensor(n, policy_id)]

    def model_for(self, policy_id):
        self.model.set_adapter(policy_id)
        self.enable_adapter_grads()
        return self.model

    def modules(self):
        return [self.model]

    def generate(self, requests, generator=None):
        self._check_sampling()
        self.model.eval()  # mixed-adapter batches are only allowed in eval mode
        return _sample_grouped(self.model, self.tokenizer, requests, generator, adapter_of=self.policy_of)

    def decode_team(self):
        self._check_sampling()
        self.model.eval()  # mixed-adapter batches are only allowed in eval mode
        return TeamDecode({"lora": DecodeBatch(self.model, self.tokenizer, mixed_adapters=True)}, lambda role: "lora",
                          adapter_of=self.policy_of)

    def save_pretrained(self, folder, state_dicts=None):
        """One sub-folder per adapter under ``folder/adapters``; ``state_dicts`` (policy id → its
        adapter's full tensors, gathered by a sharded backend) replaces the model's own."""
        merged = {n: t for sd in state_dicts.values() for n, t in sd.items()} if state_dicts is not None else None
        self.model.save_pretrained(Path(folder) / "adapters", **({"state_dict": merged} if merged is not None else {}))
        self.tokenizer.save_pretrained(Path(folder) / "adapters")

    @staticmethod
    def is_adapter_tensor(name: str, policy_id: str) -> bool:
        """Whether the PEFT state-dict entry ``name`` belongs to ``policy_id``'s adapter."""
        return f".lora_A.{policy_id}." in name or f".lora_B.{policy_id}." in name

    def adapter_state(self, policy_id: str) -> dict[str, torch.Tensor]:
        """``policy_id``'s adapter tensors, full, on CPU, by PEFT state-dict name.  Under FSDP each
        is gathered from the shards (``full_tensor()``, a collective every rank runs alike)."""
        out = {}
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if self.is_adapter_tensor(name, policy_id):
                    full = p.full_tensor() if hasattr(p, "full_tensor") else p
                    out[name] = full.detach().to("cpu").clone()
        return out

    def save_adapter(self, policy_id: str, folder) -> None:
        """``policy_id``'s adapter alone in ``folder`` (PEFT's format; every rank calls it under FSDP)."""
        # save_embedding_layers=False: PEFT's "auto" looks the base model's config up on the hub at
        # every save (steps × policies × ranks requests) to decide whether embeddings changed;
        # srpo's adapters never train the embeddings.
        self.model.save_pretrained(folder, selected_adapters=[policy_id], state_dict=self.adapter_state(policy_id),
                                   save_embedding_layers=False)

    def load_pretrained_weights(self, folder):
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        for pid in self.policy_ids:
            sub = Path(folder) / "adapters" / pid
            file = sub / "adapter_model.safetensors"
            if not file.is_file():
                file = Path(folder) / "adapters" / "adapter_model.safetensors"  # PEFT's "default" adapter
            result = set_peft_model_state_dict(self.model, load_file(str(file)), adapter_name=pid)
            if getattr(result, "unexpected_keys", None):
                raise ValueError(f"adapter {pid}: unexpected keys in {file}: {result.unexpected_keys[:3]}")
        self.enable_adapter_grads()

    def reference_logprobs(self, policy_id, input_ids, attention_mask, prompt_length, *, action_mask=None,
                           temperature=1.0):
        """The reference of a LoRA policy is the frozen base: the same model with adapters off."""
        if self.reference_modules:  # FSDP: through the shared root, adapters off
            return super().reference_logprobs(policy_id, input_ids, attention_mask, prompt_length,
                                              action_mask=action_mask, temperature=temperature)
        try:
            with torch.no_grad(), self.model.disable_adapter():
                return completion_logprobs(self.model, input_ids, attention_mask, prompt_length,
                                           action_mask=action_mask, temperature=temperature, how=self.logprob_pass)
        finally:  # PEFT re-enables only the active adapter's gradients; every adapter trains
            self.enable_adapter_grads()

    def freeze_reference(self):
        pass  # the base model is frozen already


class SeparatePolicies(PolicySet):
    layout = "separate"

    def __init__(self, models: dict[str, torch.nn.Module], tokenizer, role_to_policy: dict[str, str], *,
                 logprob_pass: LogprobPass = LogprobPass()):
        super().__init__(tokenizer, role_to_policy, logprob_pass=logprob_pass)
        missing = set(self.policy_ids) - set(models)
        if missing:
            raise ValueError(f"no model for policies {sorted(missing)}")
        self.models = {pid: models[pid].eval() for pid in self.policy_ids}

    def parameters(self, policy_id):
        return [p for p in self.models[policy_id].parameters() if p.requires_grad]

    def model_for(self, policy_id):
        return self.models[policy_id]

    def modules(self):
        return list(self.models.values())

    def generate(self, requests, generator=None):
        self._check_sampling()
        return self.per_policy(requests, lambda pid, reqs: _sample_grouped(self.models[pid], self.tokenizer, reqs,
                                                                            generator))

    def decode_team(self):
        self._check_sampling()
        return TeamDecode({pid: DecodeBatch(m, self.tokenizer) for pid, m in self.models.items()}, self.policy_of)

    def save_pretrained(self, folder, state_dicts=None):
        for pid, model in self.models.items():
            self._save_model(model, pid, Path(folder) / pid, state_dicts)
            self.tokenizer.save_pretrained(Path(folder) / pid)

    def load_pretrained_weights(self, folder):
        for pid, model in self.models.items():
            self._load_model(model, Path(folder) / pid)


def build_policies(
    layout: str,
    model: str,
    roles: list[str],
    *,
    role_groups: dict[str, list[str]] | None = None,
    lora: LoraSettings = LoraSettings(),
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
    revision: str = "",
    logprob_pass: LogprobPass = LogprobPass(),
    chat_template: str | None = None,
) -> PolicySet:
    """Build the policies behind ``roles`` (``revision``: a hub model's, see :func:`load_model`;
    ``logprob_pass``: how its log-prob passes run, :class:`~srpo.policies.logprobs.LogprobPass`;
    ``chat_template``: the tokenizer's template text instead of the model's own).

    ``role_groups`` (``lora`` and ``separate``) maps a policy id to the roles it serves; by
    default each role has its own policy.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    role_to_policy = {r: r for r in roles}
    if role_groups:
        role_to_policy = {r: pid for pid, rs in role_groups.items() for r in rs}
        missing = set(roles) - set(role_to_policy)
        if missing:
            raise ValueError(f"roles {sorted(missing)} belong to no group of role_groups")
    def load():
        loaded, tokenizer = load_model(model, dtype=dtype, seed=seed, revision=revision)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        return loaded, tokenizer

    if layout == "shared":
        base, tok = load()
        return SharedPolicies(base, tok, roles, logprob_pass=logprob_pass)
    if layout == "lora":
        base, tok = load()
        return LoraPolicies(base, tok, role_to_policy, lora, logprob_pass=logprob_pass)
    models, tok = {}, None
    for pid in sorted(set(role_to_policy.values())):
        models[pid], tok = load()
    return SeparatePolicies(models, tok, role_to_policy, logprob_pass=logprob_pass)
