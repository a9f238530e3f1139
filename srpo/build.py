"""Assembly: a validated :class:`~srpo.config.Config` → the objects a run is made of.

The one place that turns configuration into things — tasks, the retriever, the workflow, the
role settings, the policies, the reward, the method — used alike by ``srpo train`` (the
:class:`~srpo.trainer.Trainer`), ``srpo eval``, ``srpo study`` and ``srpo demo``.  Nothing here
trains; every function is cheap except :func:`policies` (it loads models).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from srpo.config import Config, DataSource
from srpo.policies.sampling import SamplingParams
from srpo.tasks.base import Task
from srpo.tasks.kinds import TaskKind, task_kind
from srpo.workflows.runtime import RoleSpec


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
    """A retrieval-server client, BM25 over ``task.corpus``, or None."""
    from srpo.data import build_retriever

    return build_retriever(cfg)


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
                              template=o.template if o.template is not None else spec.template, sampling=sampling)
    return specs


def policies(cfg: Config, roles: list[str]):
    """The :class:`~srpo.policies.layouts.PolicySet` of the layout, on ``run.device`` (loads models)."""
    from srpo.policies.layouts import LoraSettings, build_policies

    lora = LoraSettings(r=cfg.model.lora.r, alpha=cfg.model.lora.alpha, dropout=cfg.model.lora.dropout,
                        target_modules=tuple(cfg.model.lora.target_modules))
    built = build_policies(cfg.model.layout, cfg.model.name, roles, role_groups=cfg.model.role_groups or None,
                           lora=lora, dtype=cfg.model.dtype, seed=cfg.run.seed)
    if cfg.model.init_from:  # a warm start (srpo sft), same layout
        built.load_pretrained_weights(Path(cfg.model.init_from))
    for module in built.modules():
        module.to(cfg.run.device)
    return built


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

    from srpo.checkpoint import CONFIG_FILE

    return json.loads((Path(checkpoint) / CONFIG_FILE).read_text())
