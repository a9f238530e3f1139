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

Nothing is cached across sampling calls: an optimizer updates weights in place without a trace a
cache could check (fused AdamW does not even bump tensor version counters), so a copy kept from
one call to the next could silently go stale.  *Within* one call the weights cannot change, so on
CPU :meth:`FastDecoder.pack_weights` may pack every projection once into oneDNN's blocked layout
(:class:`PackedLinears`; sampling does it once a call has run 8 token steps): a small-batch matmul
then skips the weight reorder oneDNN otherwise does on every call — at batch 16 on SmolLM2-135M the layer matmuls of one token step took 25 → 16 ms
and the vocabulary head 5.9 → 3.2 ms, against ~0.08 s to pack once per call.  Under bf16 autocast
the packed bf16 matmul gives the same bits as autocast's ``F.linear``; in float32 oneDNN's
summation order differs from MKL's in the last bits.

The step itself issues few small operations (one ``F.rms_norm`` call per norm, the rotary
embedding of all query and key heads in one pass, one autocast context a step): at batch 16 the
operations around the matmuls take about as long as the matmuls.  Against the previous version,
one operation per line, the step ran 1.01–1.06× faster (paired step by step, 4 rounds of 64
steps, 2026-12-02) with the same logits bit for bit — a small gain: each small operation here
costs its dispatch, and most of them remain.

Decoders are registered per ``config.model_type`` in :data:`FAST_DECODERS`
(``@register_fast_decoder("llama")``, one decorator per model type); a decoder class takes the model in its constructor,
says in ``supports(model)`` whether it can run that particular model, and implements ``start``,
``pack_weights`` and ``step`` as :class:`FastDecoder` does.  Another architecture with the Llama
layout (Mistral, ...) registers :class:`FastDecoder` itself or a subclass; docs/extending.md
shows how.  Models without a decoder — other architectures, sliding-window attention,
activations other than SiLU, PEFT adapters other than vanilla LoRA on the layers' projections —
get ``None`` from :func:`fast_decoder_for`, and sampling takes the HF step.

A LoRA team samples all its roles in one batch, each row with its role's adapter (PEFT's
``adapter_names``).  For vanilla LoRA (:func:`lora_supported`) the step runs on the base model and
adds each row's LoRA delta as PEFT's mixed-batch forward computes it (:class:`LoraRows`; once the
call's weights are packed, from LoRA weights cast once, every row's delta of a projection group
in two matmuls: :class:`TeamLora`): on the test models the same tokens and log-probs as PEFT's
HF step bit for bit under bf16 autocast (as the plain step's, its draws part from HF's after a
while on SmolLM2, whose logits the two steps compute differently in the last bits).  A 4-role LoRA team (rank 16, 16 rows) drew a token step in 53–55 ms against PEFT's
HF step's 149–158 (``benchmarks/bench_sampling.py --lora 4``, row 15 of benchmarks/README.md) —
about a plain model's step.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from srpo.policies.attention import ATTENTION_NAME
from srpo.registry import Registry

#: ``config.model_type`` → decoder class (constructor ``cls(model)``, ``cls.supports(model)``):
#: ``@register_fast_decoder(model_type)``, once per model type the class decodes.
FAST_DECODERS: Registry[type] = Registry("fast decoder")
register_fast_decoder = FAST_DECODERS.register


def llama_layout_supported(model) -> bool:
    """Whether ``model`` has the Llama layout :class:`FastDecoder` computes: SiLU MLP, full
    attention everywhere, ``model.layers`` / ``rotary_emb`` / ``lm_head`` present."""
    cfg = getattr(model, "config", None)
    if cfg is None:
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


def _can_pack(device: torch.device) -> bool:
    mkldnn = torch.ops.mkldnn
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise"))


def _base(module):
    """The plain linear of a projection: a PEFT LoRA layer wraps one (its ``base_layer``)."""
    return getattr(module, "base_layer", module)


def _stacked(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``torch.cat(tensors).to(dtype)`` — the same values — cast straight into the stacked
    buffer: one pass over the float32 weights instead of a float32 copy cast in a second pass
    (and no copy at all for a lone tensor already in ``dtype``)."""
    if len(tensors) == 1:
        return tensors[0].to(dtype)
    out = tensors[0].new_empty((sum(t.shape[0] for t in tensors), *tensors[0].shape[1:]), dtype=dtype)
    row = 0
    for t in tensors:
        out[row:row + t.shape[0]].copy_(t)
        row += t.shape[0]
    return out


@dataclass
class PackedLora:
    """One adapter's LoRA on a group of projections that read one input, in the matmul dtype:
    its A matrices stacked (one matmul for the group), and per projection its output columns, B
    and scaling.  Where the adapter adapts every projection of the group with one scaling, its B
    matrices also stand block-diagonally in one (Σ out, Σ r) matrix (``b``): one matmul for the
    group's deltas.  Either stack gives each output the same dot product over the same terms as
    the matmuls one by one (the other terms are exact zeros), and on this CPU's kernels the same
    bits (tests compare the samples and log-probs with PEFT's)."""

    a: torch.Tensor  # (Σ r, in)
    parts: list[tuple[int, int, int, torch.Tensor, float]]  # (first output column, width, r, B (width, r), scaling)
    b: torch.Tensor | None = None  # (Σ out, Σ r) block-diagonal, or None
    scaling: float | None = None  # with ``b``: the one scaling


def _packed_lora(modules, dtype: torch.dtype) -> dict[str, PackedLora]:
    """adapter name → its :class:`PackedLora` over ``modules`` (those of them it adapts)."""
    names = {name for m in modules for name in getattr(m, "lora_A", {})}
    packed = {}
    for name in sorted(names):
        a, parts, col = [], [], 0
        for m in modules:
            width = _base(m).weight.shape[0]
            if name in getattr(m, "lora_A", {}):
                A, B = m.lora_A[name].weight.detach(), m.lora_B[name].weight.detach()
                a.append(A)
                parts.append((col, width, A.shape[0], B.to(dtype), m.scaling[name]))
            col += width
        lora = PackedLora(a=_stacked(a, dtype), parts=parts)
        if len(parts) == len(modules) and len({p[4] for p in parts}) == 1:
            lora.b = torch.zeros((col, sum(p[2] for p in parts)), dtype=dtype, device=lora.a.device)
            first = 0
            for start, width, r, b, _ in parts:
                lora.b[start:start + width, first:first + r] = b
                first += r
            lora.scaling = parts[0][4]
        packed[name] = lora
    return packed


@dataclass
class TeamLora:
    """Every adapter's LoRA on one group of projections, for all rows of a step at once: the
    adapters' stacked A matrices (adapter i's at rows i·R ...), then each row keeps only its own
    adapter's R columns (the others set to exact zeros), then the adapters' block-diagonal B
    matrices side by side (adapter i's at columns i·R ...).  Each row's delta is the same sum of
    the same terms as its adapter's alone, plus exact zeros (the same bits here: tested against
    PEFT) — two matmuls a group instead of two for each adapter."""

    names: tuple[str, ...]
    a: torch.Tensor  # (n·R, in)
    b: torch.Tensor  # (Σ out, n·R)
    block: int  # R
    scaling: float


def _team_lora(per_adapter: dict[str, PackedLora]) -> TeamLora | None:
    """The group's :class:`TeamLora`, where every adapter adapts every projection of it with one
    rank and one scaling, and the adapters' B side by side are no larger than the group's own
    weights (else None: each adapter's deltas are added in turn — with many adapters the stacked
    matmuls would cost more than the projections)."""
    loras = list(per_adapter.values())
    if not loras or any(lora.b is None for lora in loras):
        return None
    if len({lora.b.shape[1] for lora in loras}) != 1 or len({lora.scaling for lora in loras}) != 1:
        return None
    rank, in_features = loras[0].b.shape[1], loras[0].a.shape[1]
    if len(loras) * rank > in_features:  # (Σ out, n·R) larger than the (Σ out, in) projections
        return None
    names = tuple(sorted(per_adapter))
    return TeamLora(names=names, a=torch.cat([per_adapter[n].a for n in names]),
                    b=torch.cat([per_adapter[n].b for n in names], dim=1), block=rank, scaling=loras[0].scaling)


class PackedLinears:
    """Every projection of the model packed once into oneDNN's layout, for one sampling call.

    Projections that read the same input are packed as one matrix — a layer's query, key and
    value projections, and its gate and up projections — so a token step makes 4 matmuls a layer
    instead of 7 and casts each input once: the layer matmuls of a SmolLM2-135M token step took
    16.1–19.7 → 13.7–16.9 ms (1.15×; ``benchmarks/bench_decode_packing.py``, 2026-12-02).  Each
    output column is still the same dot product over the same inputs: the samples and log-probs
    are bit-identical to the separate matmuls' (tested; checked on SmolLM2-135M too).

    ``dtype`` is the matmul dtype: the autocast dtype under CPU autocast, else the weights' own.
    Inputs are cast to it, as autocast casts them for ``F.linear``.
    """

    def __init__(self, groups, dtype: torch.dtype, batch_hint: int):
        self.dtype = dtype
        self.packed = {}
        self.lora: dict[tuple[int, ...], dict[str, PackedLora]] = {}  # a group of PEFT LoRA layers
        self.team_lora: dict[tuple[int, ...], TeamLora | None] = {}
        for modules in groups:
            linears = [_base(m) for m in modules]
            w = _stacked([m.weight.detach() for m in linears], dtype)
            b = None
            if any(m.bias is not None for m in linears):
                b = _stacked([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.weight.shape[0])
                              for m in linears], dtype)
            sizes = [m.weight.shape[0] for m in linears]
            self.packed[tuple(id(m) for m in modules)] = (torch.ops.mkldnn._reorder_linear_weight(w, batch_hint), b, sizes)
            if any(hasattr(m, "lora_A") for m in modules):
                key = tuple(id(m) for m in modules)
                self.lora[key] = _packed_lora(modules, dtype)
                self.team_lora[key] = _team_lora(self.lora[key])

    def __call__(self, x: torch.Tensor, *modules, joint: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``x`` through ``modules`` (a group packed together): one output, or one per module —
        or, with ``joint``, the group's outputs side by side in one (..., Σ out) tensor."""
        w, b, sizes = self.packed[tuple(id(m) for m in modules)]
        out = torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), w, b, "none", [], "")
        return out if len(modules) == 1 or joint else out.split(sizes, dim=-1)


def _plain_linears(x: torch.Tensor, *modules, joint: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The unpacked counterpart of :class:`PackedLinears`: ``F.linear`` on the live weights."""
    outs = tuple(F.linear(x, _base(m).weight, _base(m).bias) for m in modules)
    if joint:
        return torch.cat(outs, dim=-1)
    return outs[0] if len(outs) == 1 else outs


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_supported(model) -> bool:
    """Whether the LoRA of a PEFT-wrapped ``model`` is what :class:`LoraRows` adds: vanilla LoRA
    (no DoRA or other variant, no LoRA bias) on the layers' projections only, nothing merged or
    disabled, the embeddings and the head untouched, no ``modules_to_save``."""
    configs = getattr(model, "peft_config", None) or {}
    if not configs or not hasattr(model, "get_base_model"):
        return False
    for c in configs.values():
        if str(getattr(c, "peft_type", "")).rsplit(".", 1)[-1] != "LORA" or getattr(c, "modules_to_save", None):
            return False
    wrapped = 0
    for name, m in model.get_base_model().named_modules():
        if not hasattr(m, "lora_A"):
            continue
        wrapped += 1
        if name.rsplit(".", 1)[-1] not in PROJECTIONS or ".layers." not in f".{name}":
            return False
        if (getattr(m, "merged", False) or getattr(m, "disable_adapters", False) or getattr(m, "lora_variant", None)
                or any(getattr(m, "use_dora", {}).values()) or any(getattr(m, "lora_bias", {}).values())
                or getattr(m, "fan_in_fan_out", False)
                or not all(isinstance(a, torch.nn.Linear) for a in m.lora_A.values())):
            return False
    return wrapped > 0


def _dropout_acts(module) -> bool:
    """Whether any of a LoRA layer's dropouts would act now (training mode, p > 0)."""
    return any(d.training and getattr(d, "p", 0) > 0 for d in getattr(module, "lora_dropout", {}).values())


class LoraRows:
    """Which rows of a decode batch carry which PEFT LoRA adapter (a LoRA team samples all its
    roles in one batch), and the step's projections with those rows' LoRA deltas added.

    Each delta is computed as PEFT's mixed-batch forward (``lora.Linear._mixed_batch_forward``)
    computes it: the adapter's rows of the projection's input, cast to the LoRA weights' dtype,
    through dropout, A and B under the ambient autocast, times the scaling, cast to the base
    output's dtype and added to those rows — the same operations in the same dtypes, so the step
    samples what PEFT's forward samples (tested).  Rows of ``"__base__"`` (PEFT's name for no
    adapter) get none.
    """

    def __init__(self, adapters: list[str], device: torch.device):
        rows: dict[str, list[int]] = {}
        for b, name in enumerate(adapters):
            rows.setdefault(name, []).append(b)
        self.adapters = tuple(adapters)
        self.device = device
        self.rows = {name: torch.tensor(r, device=device) for name, r in rows.items() if name != "__base__"}
        self._masks: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def linear(self, base):
        """``base`` (:class:`PackedLinears` or :func:`_plain_linears`) plus these rows' deltas:
        through PEFT's own modules on the live weights, or — once the call's weights are packed —
        from the LoRA weights :class:`PackedLinears` cast once to the matmul dtype (what autocast
        casts them to on every call), each adapter's rows gathered once for a group of
        projections and the deltas added in place."""
        packed = base if isinstance(base, PackedLinears) else None

        def project(x: torch.Tensor, *modules, joint: bool = False):
            out = base(x, *modules, joint=True)  # (B, Σ out): the group's outputs side by side
            widths = [_base(m).weight.shape[0] for m in modules]
            key = tuple(id(m) for m in modules)
            if packed is None or any(_dropout_acts(m) for m in modules):
                self._add_through_modules(out, x, modules, widths)
            elif packed.team_lora.get(key) is not None:
                self._add_team(out, x, packed.team_lora[key], packed.dtype)
            elif key in packed.lora:  # (the head has none)
                self._add_packed(out, x, packed.lora[key], packed.dtype)
            return out if joint or len(modules) == 1 else out.split(widths, dim=-1)

        return project

    def _add_through_modules(self, out, x, modules, widths) -> None:
        """PEFT's ``_mixed_batch_forward`` delta by delta, through its modules."""
        col = 0
        for m, width in zip(modules, widths):
            for name, idx in self.rows.items():
                if name in getattr(m, "lora_A", ()):
                    sub = x[idx].to(m.lora_A[name].weight.dtype)
                    delta = m.lora_B[name](m.lora_A[name](m.lora_dropout[name](sub))) * m.scaling[name]
                    out[idx, col:col + width] += delta.to(out.dtype)
            col += width

    def _team_mask(self, team: TeamLora) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, n·R) bool: the columns of each row's own adapter; and the rows with an adapter of
        the team (None: all of them)."""
        key = (team.names, team.block)
        if key not in self._masks:
            position = {name: i for i, name in enumerate(team.names)}
            which = torch.tensor([position.get(a, -1) for a in self.adapters], device=self.device)
            columns = torch.arange(len(team.names) * team.block, device=self.device) // team.block
            adapted = which >= 0
            self._masks[key] = (which[:, None] == columns[None, :],
                                None if bool(adapted.all()) else adapted.nonzero().squeeze(1))
        return self._masks[key]

    def _add_team(self, out, x, team: TeamLora, dtype) -> None:
        """Every row's delta of a group at once (:class:`TeamLora`), added to the rows that have an
        adapter (PEFT adds nothing to the others)."""
        mask, adapted = self._team_mask(team)
        z = torch.where(mask, F.linear(x.to(dtype), team.a), 0)  # (B, n·R): each row's own adapter's
        delta = (F.linear(z, team.b) * team.scaling).to(out.dtype)
        if adapted is None:
            out.add_(delta)
        else:
            out.index_add_(0, adapted, delta[adapted])

    def _add_packed(self, out, x, group: dict[str, PackedLora], dtype) -> None:
        """The same deltas from the call's :class:`PackedLora`.  The input goes straight to the
        matmul dtype: PEFT casts it to the LoRA weights' dtype and autocast then to the matmul
        dtype, and a bf16 → float32 → bf16 round trip is exact.  ``index_add_`` adds each delta
        to its rows in the output's dtype, as PEFT's ``result[rows] += delta`` does."""
        for name, idx in self.rows.items():
            lora = group.get(name)
            if lora is None:
                continue
            z = F.linear(x[idx].to(dtype), lora.a)  # (rows, Σ r): every projection's A at once
            if lora.b is not None:  # every projection's B at once
                out.index_add_(0, idx, (F.linear(z, lora.b) * lora.scaling).to(out.dtype))
                continue
            first = 0
            for col, width, r, b, scaling in lora.parts:
                delta = F.linear(z[:, first:first + r], b) * scaling
                out[:, col:col + width].index_add_(0, idx, delta.to(out.dtype))
                first += r


@dataclass
class DecodeState:
    """Static KV buffers, one (B, Hkv, capacity, D) pair per layer, filled up to ``length`` columns.

    ``linears``: the call's packed projections, or None for plain ``F.linear`` on the live weights.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int
    linears: PackedLinears | None = None

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished rows: later steps compute only for the rows still sampling."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]


@register_fast_decoder("llama")
@register_fast_decoder("qwen2")
class FastDecoder:
    """The one-token decode step of one Llama-family model."""

    @classmethod
    def supports(cls, model) -> bool:
        return llama_layout_supported(model)

    def __init__(self, model):
        cfg = model.config
        self.model = model
        self.lora = False  # set by fast_decoder_for for a PEFT LoRA model (this is its base model)
        self._lora_rows: LoraRows | None = None
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
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            # the same operations in the same order (checked bit for bit), dispatched once
            return F.rms_norm(x, x.shape[-1:], weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x32.to(x.dtype)

    def _projections(self):
        """The projections in the groups that are packed together (those that read one input)."""
        model = self.model.model
        for layer in model.layers:
            att, mlp = layer.self_attn, layer.mlp
            yield from ((att.q_proj, att.k_proj, att.v_proj), (att.o_proj,), (mlp.gate_proj, mlp.up_proj),
                        (mlp.down_proj,))
        yield (self.model.lm_head,)

    def _pack(self, batch: int) -> PackedLinears | None:
        """Pack the projections for this call when oneDNN can and the matmul dtype allows it."""
        weight = self.model.lm_head.weight
        if not _can_pack(weight.device):
            return None
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else weight.dtype
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
        if dtype not in (torch.float32, torch.bfloat16):
            return None
        return PackedLinears(self._projections(), dtype, batch)

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

    def pack_weights(self, state: DecodeState) -> None:
        """Pack the projections for the rest of this call's steps (no-op where oneDNN cannot).

        In bf16 the packed matmuls give the same bits as the plain ones, so a call may switch
        part-way through.
        """
        if state.linears is None:
            state.linears = self._pack(state.keys[0].shape[0] if state.keys else 1)

    def _with_lora(self, linear, adapters: list[str] | None, device: torch.device):
        """``linear`` with each row's LoRA delta (the row groups kept while the rows stay the same)."""
        if adapters is None:
            raise ValueError("a PEFT LoRA model's decode step needs each row's adapter name")
        if self._lora_rows is None or self._lora_rows.adapters != tuple(adapters):
            self._lora_rows = LoraRows(adapters, device)
        return self._lora_rows.linear(linear)

    @torch.no_grad()
    def step(self, state: DecodeState, tokens: torch.Tensor, positions: torch.Tensor,
             valid: torch.Tensor, adapters: list[str] | None = None) -> torch.Tensor:
        """Feed one token per row, return the next-token logits.

        tokens: (B,) fed at cache column ``state.length``; positions: (B,) their rotary positions;
        valid: (B, state.length + 1) bool, the columns each row attends to (its left padding is
        False); adapters: each row's PEFT adapter (a LoRA model's decoder only).  Returns (B, V)
        logits (in the autocast dtype under autocast).

        At batch 16 the matmuls of a SmolLM2-135M step take ~15 ms and the ~1,500 small operations
        around them (norms, rotary embeddings, cache writes, casts) as long again, each costing a
        dispatch: the step is written to issue few of them.  Every operation computes what the HF
        forward computes, in the same order and dtype, so the logits stay bit-identical.
        """
        model = self.model.model
        B = tokens.shape[0]
        col = state.length
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(tokens, model.embed_tokens.weight)  # (B, H) in the parameters' dtype
        cos, sin = model.rotary_emb(x[:, None], positions[:, None])  # (B, 1, D) each
        # rotate_half(t) * sin == roll(t, D/2) * (sin with its first half negated): bit for bit
        # (negation is exact), in 3 operations instead of 6.
        signed_sin = torch.cat((-sin[..., :D // 2], sin[..., D // 2:]), dim=-1)
        mask = valid[:, None, None, :col + 1]  # (B, 1, 1, col + 1)
        linear = state.linears or _plain_linears
        if self.lora:
            linear = self._with_lora(linear, adapters, tokens.device)
        # Packed matmuls cast their inputs themselves, so with srpo's float32 attention nothing in
        # the step needs autocast: one context for the whole step.  The plain matmuls and the LoRA
        # deltas need the ambient autocast; then only attention leaves it, layer by layer.
        device = x.device.type
        step_off = self.float32_attention and state.linears is not None and not self.lora
        layer_off = self.float32_attention and not step_off
        with torch.autocast(device, enabled=False) if step_off else nullcontext():
            for layer, kb, vb in zip(model.layers, state.keys, state.values):
                att, mlp = layer.self_attn, layer.mlp
                h = self._rms(x, layer.input_layernorm.weight)
                qkv = linear(h, att.q_proj, att.k_proj, att.v_proj, joint=True).view(B, Hq + 2 * Hkv, D)
                # The query and key heads get their rotary embedding in one pass.
                qk = qkv[:, :Hq + Hkv]
                qk = qk * cos + qk.roll(D // 2, -1) * signed_sin  # (B, Hq + Hkv, D)
                kb[:, :, col] = qk[:, Hq:]
                vb[:, :, col] = qkv[:, Hq + Hkv:]
                # The G = Hq/Hkv query heads of each key/value head go in as G query positions (HF's
                # pack_gqa for one-token steps): no key/value repeat, and ~5× faster on CPU than
                # SDPA's enable_gqa path at these sizes.
                q = qk[:, :Hq].reshape(B, Hkv, Hq // Hkv, D)
                with torch.autocast(device, enabled=False) if layer_off else nullcontext():
                    out = F.scaled_dot_product_attention(
                        q.float() if self.float32_attention else q,
                        kb[:, :, :col + 1], vb[:, :, :col + 1], attn_mask=mask, scale=D ** -0.5)  # (B, Hkv, G, D)
                x = x + linear(out.reshape(B, Hq * D), att.o_proj)
                h = self._rms(x, layer.post_attention_layernorm.weight)
                gate, up = linear(h, mlp.gate_proj, mlp.up_proj)
                x = x + linear(F.silu(gate) * up, mlp.down_proj)
            state.length = col + 1
            h = self._rms(x, model.norm.weight)
            return linear(h, self.model.lm_head)


def fast_decoder_for(model, *, adapters: bool = False) -> FastDecoder | None:
    """The registered decode step for ``model``'s architecture, or None (no decoder for it, or a
    configuration the decoder does not support): sampling then takes the HF step.

    A PEFT-wrapped model gets one only with ``adapters`` (its rows carry adapter names: a LoRA
    team's mixed-adapter batch) and only where :func:`lora_supported` holds: a :class:`FastDecoder`
    of its base model that adds each row's LoRA delta."""
    peft = hasattr(model, "peft_config")
    if peft and not (adapters and lora_supported(model)):
        return None
    base = model.get_base_model() if peft else model
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type is None or model_type not in FAST_DECODERS.names():
        return None
    cls = FAST_DECODERS[model_type]
    if not cls.supports(base) or (peft and not issubclass(cls, FastDecoder)):
        return None
    decoder = cls(base)
    decoder.lora = peft
    return decoder
