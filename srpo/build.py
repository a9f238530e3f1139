"""Assembly: a validated :class:`~srpo.config.Config` → the objects a run is made of.

The one place that turns configuration into things — tasks, the retriever, the workflow, the
role settings, the policies, the reward, the method — used alike by ``srpo train`` (the
:class:`~srpo.train.Trainer`), ``srpo eval``, ``srpo study`` and ``srpo demo``.  Nothing here
trains; every function is cheap except :func:`policies` (it loads models).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from srpo.config import Config, ConfigError, DataSource, apply_overrides, parse_config, read_yaml
from srpo.tasks.base import Task
from srpo.tasks.kinds import TaskKind, task_kind
from srpo.runs.secrets import redacted
from srpo.types import RoleSpec, SamplingParams


def kind(cfg: Config) -> TaskKind:
    return task_kind(cfg.task.kind)


def reward(cfg: Config) -> Callable[[Task, str], float]:
    """The training reward ``fn(task, final_answer) -> float`` (``task.reward`` of the task kind)."""
    return kind(cfg).reward(cfg.task.reward)


def method(cfg: Config):
    """The :class:`~srpo.methods.Method`, its loss replaced by ``method.loss`` when that is set."""
    from srpo.methods import METHODS

    m = METHODS[cfg.method.name]
    return replace(m, loss=cfg.method.loss) if cfg.method.loss else m


def train_tasks(cfg: Config) -> list[Task]:
    from srpo.data import load_tasks

    return load_tasks(cfg.task.train, cfg.task.kind, held_out=False)


def eval_sets(cfg: Config, sources: list[DataSource] | None = None, n: int | None = None) -> dict[str, list[Task]]:
    """Held-out datasets by display name: ``sources`` (default ``task.eval``), each cut to ``n``
    problems (default ``eval.n``; 0: all)."""
    from srpo.data import load_tasks, source_name

    n = cfg.eval.n if n is None else n
    out = {}
    for src in cfg.task.eval if sources is None else sources:
        out[source_name(src)] = load_tasks(src, cfg.task.kind, held_out=True)[: n or None]
    return out


def data_fingerprint(cfg: Config, train: list[Task], eval_sets: dict[str, list[Task]]) -> dict[str, dict]:
    """The fingerprint of the training data and of each loaded held-out set, by config field."""
    from srpo.data import fingerprint

    out = {"task.train": fingerprint(train, cfg.task.train)}
    for i, (src, tasks) in enumerate(zip(cfg.task.eval, eval_sets.values())):
        out[f"task.eval[{i}]"] = fingerprint(tasks, src)
    return out


def eval_workflows(cfg: Config, sources: list[DataSource] | None, workflow_: Any) -> dict[str, Any]:
    """The workflow each held-out set (``sources``, default ``task.eval``) runs in, by display name:
    ``workflow_`` itself, or — for a set with its own ``corpus`` — the same workflow searching that
    corpus (one retriever per distinct corpus)."""
    from srpo.data import eval_retriever, source_name

    out, built = {}, {}
    for src in cfg.task.eval if sources is None else sources:
        if not src.corpus:
            out[source_name(src)] = workflow_
            continue
        # A synthetic set's own KB depends on the whole source (n, seed); a file corpus on its path.
        key = src.model_dump_json() if src.corpus == src.source else src.corpus
        if key not in built:
            built[key] = workflow(cfg, eval_retriever(src))
        out[source_name(src)] = built[key]
    return out


def retriever(cfg: Config):
    """A client of ``retriever.url``, or BM25 over the configured corpus (``synthetic_kb`` joins the
    KBs of every synthetic source); None when the run retrieves nothing."""
    from srpo.data import generate
    from srpo.tasks.base import DatasetError
    from srpo.tasks.kinds import synthetic_source
    from srpo.tasks.search import BM25Retriever, load_corpus

    if cfg.retriever.url:
        from srpo.tasks.retrieval_service import HTTPRetriever

        return HTTPRetriever(cfg.retriever.url, timeout_s=cfg.retriever.timeout_s, retries=cfg.retriever.retries)
    if not cfg.task.corpus:
        return None
    if synthetic_source(cfg.task.corpus) is not None:  # the passages a synthetic source's answers live in
        passages = []
        for held_out, src in [(False, cfg.task.train), *((True, e) for e in cfg.task.eval)]:
            if src.source == cfg.task.corpus:
                passages += generate(src, held_out=held_out)[1]
        if not passages:
            raise DatasetError(f"task.corpus is {cfg.task.corpus} but no data source is {cfg.task.corpus}")
        return BM25Retriever(passages)
    return BM25Retriever(load_corpus(cfg.task.corpus))


def workflow(cfg: Config, retriever_: Any = None):
    """The configured workflow with its options (and the retriever, for one that needs it)."""
    from srpo.workflows.builtins import build_workflow, needs_retriever

    extra = {"retriever": retriever_} if needs_retriever(cfg.workflow.name) else {}
    return build_workflow(cfg.workflow.name, kind=kind(cfg).name, max_new_tokens=cfg.workflow.max_new_tokens,
                          temperature=cfg.workflow.temperature, **extra, **cfg.workflow.options)


def role_specs(cfg: Config, workflow_) -> dict[str, RoleSpec]:
    """The workflow's default role settings with the config's defaults and per-role overrides."""
    specs = workflow_.default_role_specs()
    for role, spec in specs.items():
        specs[role] = replace(spec, system=cfg.workflow.system if cfg.workflow.system is not None else spec.system,
                              template=cfg.workflow.template if cfg.workflow.template is not None else spec.template)
    for role, o in cfg.workflow.roles.items():
        spec = specs[role]
        sampling = spec.sampling
        sampling = SamplingParams(
            temperature=o.temperature if o.temperature is not None else sampling.temperature,
            top_p=o.top_p if o.top_p is not None else sampling.top_p,
            max_new_tokens=o.max_new_tokens if o.max_new_tokens is not None else sampling.max_new_tokens,
            stop=tuple(o.stop) if o.stop is not None else sampling.stop,
        )
        specs[role] = replace(spec, system=o.system if o.system is not None else spec.system,
                              template=o.template if o.template is not None else spec.template, sampling=sampling,
                              tool_parser=o.tool_parser, reasoning_parser=o.reasoning_parser)
    return specs


def policies(cfg: Config, roles: list[str]):
    """The :class:`~srpo.policies.layouts.PolicySet` of the layout, on ``run.device`` (loads models)."""
    from srpo.gateway.tools import resolve_chat_template
    from srpo.policies.layouts import LoraSettings, build_policies

    lora = LoraSettings(r=cfg.model.lora.r, alpha=cfg.model.lora.alpha, dropout=cfg.model.lora.dropout,
                        target_modules=tuple(cfg.model.lora.target_modules))
    built = build_policies(cfg.model.layout, cfg.model.name, roles, role_groups=cfg.model.role_groups or None,
                           lora=lora, dtype=cfg.model.dtype, seed=cfg.run.seed,
                           revision=cfg.model.revision, logprob_pass=logprob_pass(cfg),
                           chat_template=resolve_chat_template(cfg.model.chat_template) if cfg.model.chat_template else None)
    if cfg.model.init_from:  # a warm start (srpo sft), same layout
        built.load_pretrained_weights(Path(cfg.model.init_from))
    for module in built.modules():
        module.to(load_device(cfg))
    return built


def load_device(cfg: Config):
    """Where the policies (and a KL reference copied from them) are built: the CPU under FSDP —
    ``fully_shard`` then moves each unit's shard to the GPU as it shards it, so no GPU ever holds
    the whole model (an 8B model in float32 is ~33 GB more than one shard) — else ``run.device``."""
    import torch

    from srpo.parallel import backend_capabilities

    return torch.device("cpu") if backend_capabilities(cfg.train.parallel).shards_parameters else device(cfg)


def logprob_pass(cfg: Config):
    """How a run's log-prob passes run when the models are called directly (a sharding backend
    sets the length groups its own way): ``train.chunk_tokens``, ``train.length_groups``."""
    from srpo.policies.logprobs import LogprobPass

    groups = {"max_length_groups": cfg.train.length_groups} if cfg.train.length_groups else {}
    return LogprobPass(chunk_tokens=cfg.train.chunk_tokens, **groups)


def device(cfg: Config):
    """This process's device for ``run.device`` (``cuda`` is ``cuda:LOCAL_RANK`` under torchrun;
    :func:`srpo.parallel.devices.rank_device`)."""
    from srpo.parallel.devices import rank_device

    return rank_device(cfg.run.device)


@dataclass
class Team:
    """A workflow ready to run: the workflow, its role settings, its policies."""

    workflow: Any
    role_specs: dict[str, RoleSpec]
    policies: Any
    retriever: Any = None


def team(cfg: Config, existing_policies=None) -> Team:
    """Retriever, workflow, role settings and policies (``existing_policies`` reused if given)."""
    r = retriever(cfg)
    w = workflow(cfg, r)
    return Team(w, role_specs(cfg, w), existing_policies or policies(cfg, w.roles()), r)


def checkpoint_config(checkpoint: Path) -> dict:
    """The config a training checkpoint was written with (as a dict, to be changed and validated)."""
    import json

    from srpo.runs.checkpoint import CONFIG_FILE

    return json.loads((Path(checkpoint) / CONFIG_FILE).read_text())


# ---------------------------------------------------------------------------------- the config's checks
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


def _resolve_in(path: str, name: str, registry) -> None:
    from srpo.registry import RegistryError

    try:
        registry.resolve(name)
    except RegistryError as err:
        raise ConfigError(f"{path}: {err}") from None


def _check_registered(cfg: Config):
    """Names that extensions can add to, against their registries; returns the task kind."""
    from srpo.gateway.parsers import REASONING_PARSERS, TOOL_PARSERS
    from srpo.methods import METHODS
    from srpo.objective import LOSSES
    from srpo.parallel import BACKENDS
    from srpo.registry import RegistryError
    from srpo.rollout import ENGINES
    from srpo.runs.trackers import TRACKERS
    from srpo.tasks.kinds import TASK_KINDS
    from srpo.workflows.builtins import WORKFLOWS

    _resolve_in("workflow.name", cfg.workflow.name, WORKFLOWS)
    _resolve_in("rollout.engine", cfg.rollout.engine, ENGINES)
    _resolve_in("train.parallel", cfg.train.parallel, BACKENDS)
    for tracker in cfg.log.backends:
        _resolve_in("log.backends", tracker, TRACKERS)
    _resolve_in("task.kind", cfg.task.kind, TASK_KINDS)
    for role, o in cfg.workflow.roles.items():
        if o.tool_parser is not None:
            _resolve_in(f"workflow.roles.{role}.tool_parser", o.tool_parser, TOOL_PARSERS)
        if o.reasoning_parser is not None:
            _resolve_in(f"workflow.roles.{role}.reasoning_parser", o.reasoning_parser, REASONING_PARSERS)
    _resolve_in("method.name", cfg.method.name, METHODS)
    if cfg.method.loss:
        _resolve_in("method.loss", cfg.method.loss, LOSSES)
    kind_ = task_kind(cfg.task.kind)
    try:
        kind_.reward(cfg.task.reward)
    except RegistryError as err:
        raise ConfigError(f"task.reward: {err}") from None
    return kind_


def _check_installed(cfg: Config) -> None:
    """Optional packages the config needs: the engine's, the trackers'."""
    import importlib.util

    from srpo.rollout.engine import engine_capabilities
    from srpo.runs.trackers import missing_package

    caps = engine_capabilities(cfg.rollout.engine)
    if caps.requires and importlib.util.find_spec(caps.requires[0]) is None:
        note = f"; {caps.install_note}" if caps.install_note else ""
        raise ConfigError(f"rollout.engine: {cfg.rollout.engine} needs {caps.requires[0]}, which is not installed "
                          f"(pip install '{caps.requires[1]}'{note})")
    if cfg.workflow.name == "openai_agent" and any(importlib.util.find_spec(m) is None for m in ("starlette", "uvicorn")):
        raise ConfigError("workflow.name: openai_agent serves the team over HTTP; pip install 'srpo[gateway]'")
    for tracker in cfg.log.backends:
        need = missing_package(tracker)
        if need:
            raise ConfigError(f"log.backends: {tracker} is not installed; pip install '{need}'")
    if len(set(cfg.log.backends)) != len(cfg.log.backends):
        raise ConfigError(f"log.backends: a tracker is named twice: {cfg.log.backends}")


def _check_capabilities(cfg: Config) -> None:
    """Combinations the chosen engine and backend cannot run, asked of their capabilities."""
    from srpo.parallel import backend_capabilities
    from srpo.rollout import engine_capabilities

    engine_, backend_ = engine_capabilities(cfg.rollout.engine), backend_capabilities(cfg.train.parallel)
    r = cfg.rollout
    device_type = cfg.run.device.split(":")[0]
    for field, name, caps in (("rollout.engine", r.engine, engine_), ("train.parallel", cfg.train.parallel, backend_)):
        if device_type not in caps.devices:
            raise ConfigError(f"{field}: {name} runs on {', '.join(caps.devices)}, not on run.device: {cfg.run.device}")
    if cfg.model.layout == "lora" and not engine_.supports_lora:
        raise ConfigError(f"rollout.engine: {r.engine} does not serve LoRA adapters (model.layout: lora); use the "
                          f"shared or separate layout, or another engine")
    if engine_.top_p_in_logprobs and any(o.top_p is not None and o.top_p < 1 for o in cfg.workflow.roles.values()):
        raise ConfigError(
            f"workflow.roles.<role>.top_p: below 1 with rollout.engine: {r.engine} the engine's behaviour log-probs "
            f"include its top-p renormalisation and the trainer's do not — the logged mismatch and train.tis_cap "
            f"would be biased; sample with top_p 1 on this engine, or use rollout.engine: builtin")
    if r.sleep_during_update and device_type not in engine_.sleeps_on:
        where = ", ".join(engine_.sleeps_on) or "no device"
        raise ConfigError(f"rollout.sleep_during_update: the {r.engine} engine releases its memory during updates on "
                          f"{where} (run.device: {cfg.run.device}); vLLM's sleep mode needs a CUDA device — the CPU "
                          f"build does not offer it")
    if cfg.train.fsdp_share_prompts and not backend_.shards_parameters:
        raise ConfigError(f"train.fsdp_share_prompts: a sharded backend's setting (train.parallel: fsdp); "
                          f"{cfg.train.parallel} always shares prompts in its log-prob passes")
    if r.quorum < 1 and engine_.holds_own_weights:
        raise ConfigError(f"rollout.quorum below 1 with rollout.engine: {r.engine} is not offered: the stragglers would "
                          f"sample on the engine while the trainer pushes new weights into it and evaluates with it — "
                          f"use rollout.engine: builtin, or rollout.quorum: 1")
    if r.quorum < 1 and backend_.shards_parameters:
        raise ConfigError(f"rollout.quorum below 1 with train.parallel: {cfg.train.parallel}: the stragglers' sampler "
                          f"would need a full unsharded copy of the weights — use rollout.quorum: 1")
    if r.max_staleness and backend_.shards_parameters and not engine_.holds_own_weights:
        raise ConfigError(f"rollout.max_staleness: 1 with train.parallel: {cfg.train.parallel} needs an engine that "
                          f"holds its own copy of the weights (rollout.engine: vllm) — the {r.engine} sampler would "
                          f"need a full unsharded copy on every rank, which is what sharding avoids")


def _check_workflow(cfg: Config, kind_name: str) -> None:
    """The workflow's options, roles, role groups and retrieval."""
    from srpo.workflows.builtins import OptionError, build_workflow, needs_retriever

    try:  # the workflow checks its own options against its declared option fields
        built = build_workflow(cfg.workflow.name, kind=kind_name, **dict(cfg.workflow.options))
    except OptionError as err:  # names the option: workflow.options.<option>: ...
        raise ConfigError(f"workflow.options.{err}") from None
    except (TypeError, ValueError) as err:  # a check across options (e.g. max_chosen > num_workers)
        raise ConfigError(f"workflow.options: {err}") from None
    if "entry" in cfg.workflow.options and getattr(built, "entry", None):
        # The program as loaded (a relative file path made absolute): what the checkpoint records.
        cfg.workflow.options["entry"] = built.entry
    if needs_retriever(cfg.workflow.name) and not cfg.task.corpus and not cfg.retriever.url:
        raise ConfigError(f"task.corpus: the {cfg.workflow.name} workflow needs a corpus (a jsonl path or synthetic_kb) "
                          f"or a retrieval server (retriever.url)")
    check_eval_corpora(cfg, cfg.task.eval)
    roles = set(built.roles())
    for role in cfg.workflow.roles:
        if role not in roles:
            raise ConfigError(f"workflow.roles.{role}: no such role in {cfg.workflow.name}; roles: {', '.join(sorted(roles))}")
    for pid, members in cfg.model.role_groups.items():
        for role in members:
            if role not in roles:
                raise ConfigError(f"model.role_groups.{pid}: no role {role!r} in {cfg.workflow.name}; "
                                  f"roles: {', '.join(sorted(roles))}")
    if cfg.model.role_groups:
        missing = roles - {r for rs in cfg.model.role_groups.values() for r in rs}
        if missing:
            raise ConfigError(f"model.role_groups: roles {sorted(missing)} belong to no group")


def _check_source(path: str, src: DataSource, kind_name: str) -> None:
    from srpo.tasks.kinds import synthetic_source

    generator = synthetic_source(src.source)
    if generator is not None:
        if generator.name != kind_name:
            raise ConfigError(f"{path}.source: {src.source} is a {generator.name} source but task.kind is {kind_name!r}")
        if src.split is not None and src.split not in ("train", "test", "all"):
            raise ConfigError(f"{path}.split: {src.split!r} is not a part of a synthetic source; valid: train, test, all")
        if src.n == 0 and (src.source != "synthetic_arithmetic" or src.level == 3):
            raise ConfigError(f"{path}.n: 0 (every problem) is for arithmetic levels 0, 1, 2, 4, 5; give n")
    elif not src.source.startswith("hub:"):
        p = Path(src.source)
        if not p.is_file():
            raise ConfigError(f"{path}.source: no such file {src.source!r} (or use synthetic_arithmetic, "
                              f"synthetic_kb, hub:<id>)")
        if p.suffix not in (".jsonl", ".json", ".parquet"):
            raise ConfigError(f"{path}.source: {src.source!r} must be .jsonl or .parquet")


def check(cfg: Config, *, training: bool = True, packages: bool = True) -> Config:
    """The checks of a parsed config that need the registries, the installed packages or the file
    system; raise :class:`~srpo.config.ConfigError` naming the field.  ``training=False`` (``srpo
    eval``) skips the training data source; ``packages=False`` (``srpo config show``: a config
    inspected on a machine that will not run it) skips the optional packages' check —
    :func:`skipped_package_check` says what it would have found."""
    kind_ = _check_registered(cfg)
    _check_capabilities(cfg)
    if packages:
        _check_installed(cfg)
    _check_workflow(cfg, kind_.name)
    sources = [("task.train", cfg.task.train)] if training else []
    sources += [(f"task.eval[{i}]", src) for i, src in enumerate(cfg.task.eval)]
    for path, src in sources:
        _check_source(path, src, kind_.name)
    if cfg.model.init_from and not Path(cfg.model.init_from).is_dir():
        raise ConfigError(f"model.init_from: no such folder {cfg.model.init_from!r} (the model/ folder srpo sft writes)")
    return cfg


def config_from_dict(data: dict, *, training: bool = True, packages: bool = True) -> Config:
    """A :class:`~srpo.config.Config` from a plain dict, parsed by the schema and checked against the
    registries (:func:`check`).  ``training=False`` (``srpo eval``) skips the training data source."""
    return check(parse_config(data), training=training, packages=packages)


def load_config(path: str | Path | None, overrides: list[str] | None = None, *, packages: bool = True) -> Config:
    """A YAML config (``include:`` resolved), ``key=value`` overrides applied, parsed and checked."""
    data = read_yaml(path) if path is not None else {}
    return config_from_dict(apply_overrides(data, overrides or []), packages=packages)


def skipped_package_check(cfg: Config) -> str | None:
    """What the optional packages' check would refuse here (an engine or tracker not installed), or None."""
    try:
        _check_installed(cfg)
    except ConfigError as err:
        return str(err)
    return None


# ---------------------------------------------------------------------------------- training parts
def backend(cfg: Config):
    """The parallel backend of ``train.parallel`` (:data:`srpo.parallel.BACKENDS`): DDP ranks under
    torchrun (else one process), FSDP2, or a registered one."""
    from srpo.parallel import BACKENDS
    from srpo.parallel.devices import use_device

    use_device(device(cfg))  # cuda:N current before any mesh, engine or tensor lands on cuda:0
    return BACKENDS[cfg.train.parallel].from_config(cfg)


def engine(cfg: Config, policies_):
    """The rollout engine of ``rollout.engine`` (:data:`srpo.rollout.ENGINES`), on ``policies_``' weights."""
    from srpo.rollout import ENGINES

    return ENGINES[cfg.rollout.engine].from_config(cfg, policies_)


def optimizer(cfg: Config, params):
    """``train.optimizer`` over ``params`` (one optimizer per policy)."""
    import torch

    t = cfg.train
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.lr, weight_decay=t.weight_decay)
    # The fused kernel is ~5x faster than the per-tensor loop on CPU (one pass over all tensors).
    fused = all(p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in params) or None
    return torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, fused=fused)


def scheduler(cfg: Config, optimizer_):
    """Linear warm-up over ``train.warmup_steps`` steps, then a constant learning rate."""
    import torch

    warm = max(cfg.train.warmup_steps, 0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer_, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)


def activation_checkpointing(cfg: Config) -> bool:
    """``train.activation_checkpointing`` with ``auto`` resolved: on for a CPU run (measured free
    there, benchmarks/bench_memory.py), off on CUDA (not measured)."""
    setting = cfg.train.activation_checkpointing
    return cfg.run.device == "cpu" if setting == "auto" else bool(setting)


def loss_settings(cfg: Config):
    """The loss hyperparameters of a run's config (``method.*``, ``train.tis_cap``)."""
    from srpo.objective import LossSettings

    m = cfg.method
    return LossSettings(clip_eps=m.clip_eps, clip_eps_high=m.clip_eps_high, set_reduction=m.set_reduction,
                        member_reduction=m.member_reduction, kl_coef=m.kl_coef, tis_cap=cfg.train.tis_cap or None)


def update_settings(cfg: Config):
    """What the update reads of a run's config (:class:`srpo.methods.UpdateSettings`), once."""
    from srpo.methods import UpdateSettings

    t = cfg.train
    return UpdateSettings(epochs=t.epochs, minibatches=t.minibatches, microbatches=t.microbatches,
                          old_logprobs=t.old_logprobs, skip_zero_advantage=t.skip_zero_advantage,
                          max_grad_norm=t.max_grad_norm,
                          checkpoint_layers=activation_checkpointing(cfg),
                          adapter_dropout=cfg.model.layout == "lora" and cfg.model.lora.dropout > 0,
                          loss=loss_settings(cfg))


def autocast_factory(cfg: Config):
    """A factory of the run's autocast context (each use enters a fresh one): bfloat16 for the
    model's matmuls when ``model.autocast_bf16`` (weights stay as loaded)."""
    import functools

    import torch

    device_type = "cuda" if cfg.run.device.startswith("cuda") else "cpu"
    return functools.partial(torch.autocast, device_type, dtype=torch.bfloat16, enabled=cfg.model.autocast_bf16)


def autocast(cfg: Config):
    """One autocast context of :func:`autocast_factory`."""
    return autocast_factory(cfg)()


def runtime(cfg: Config, team_: Team, engine_, generator, reward_fn=None):
    """The workflow runtime of a training run: episodes of ``team_`` sampled through ``engine_``."""
    from srpo.workflows.runtime import Runtime as _Runtime

    return _Runtime(engine_, team_.role_specs, reward_fn or reward(cfg), generator=generator,
                    max_batch=cfg.train.rollout_batch, max_prompt_tokens=cfg.workflow.max_prompt_tokens,
                    reward_timeout_s=cfg.task.reward_timeout_s, drop_failed_episodes=cfg.run.failed_episodes == "drop",
                    policies=team_.policies)


def metrics_logger(cfg: Config, rank: int, run_dir: Path | None = None):
    """``metrics.jsonl``, samples and the configured trackers in ``run_dir`` (default:
    ``run.output_dir``; rank 0 writes)."""
    from srpo.runs.metrics_log import MetricsLogger

    return MetricsLogger(
        Path(run_dir if run_dir is not None else cfg.run.output_dir), cfg.log.backends, enabled=rank == 0,
        tracker_options={"project": cfg.log.project, "run_name": cfg.log.run_name, "config": redacted(cfg.to_dict()),
                         "mlflow_tracking_uri": cfg.log.mlflow_tracking_uri, "wandb_mode": cfg.log.wandb_mode,
                         "timeout_s": cfg.log.tracker_timeout_s})
