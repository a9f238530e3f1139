"""The ``srpo`` command.  No training logic lives here.

    srpo train     train a workflow from a YAML config (``--resume``, ``--overwrite``; under torchrun too)
    srpo sft       supervised warm start of every role (transcripts from a file or a scripted player)
    srpo eval      avg@k / pass@k of a model, a checkpoint or a warm start in a workflow
    srpo serve     the OpenAI-compatible endpoint on a trained team (each role its policy)
    srpo demo      SRPO on the embedded SmolLM2-135M: evaluate, train, evaluate, report
    srpo study     methods × workflows × seeds grids with paired, corrected comparisons (resumable)
    srpo report    plots and a summary page for a run folder
    srpo models    list, prepare or verify the embedded models
    srpo retriever serve BM25 retrieval over HTTP (the Search-R1 retrieval API)
    srpo config    show every config field with its type, default and documentation
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path


#: errno values of a failed write that are the machine's state, not a bug: exit 2, one line.
WRITE_ERRNOS = {28, 27, 122, 30}  # ENOSPC, EFBIG, EDQUOT, EROFS


def _train(args) -> int:
    from srpo.runs import preemption
    from srpo.build import load_config
    from srpo.train import Trainer, TrainingStopped

    if args.resume and args.overwrite:
        raise UsageError("--resume continues the folder's run and --overwrite deletes it: choose one")
    if args.config:
        refuse_study_file(args.config, "srpo train")
    cfg = load_config(args.config, args.set)
    preemption.install(cfg.run.preempt_grace_s)
    _maybe_init_distributed(cfg.run.device, cfg.run.collective_timeout_s)
    trainer = Trainer(cfg, overwrite=args.overwrite, allow_data_change=args.allow_data_change)
    code = 0
    if trainer.backend.rank == 0:
        trainer.announce_memory_preflight()
    try:
        if args.resume and not trainer.resume():
            print(f"no checkpoint in {cfg.run.output_dir}; starting from step 0", file=sys.stderr)
        try:
            trainer.fit()
        except TrainingStopped as err:  # stopped on purpose, on every rank together
            print(f"training stopped: {err}", file=sys.stderr)
            code = 3
        except RuntimeError as err:  # a collective that timed out: name the rank that stopped answering
            raise trainer.backend.explain_timeout(err, cfg.run.collective_timeout_s) from None
    finally:
        trainer.close()
    # Only after a normal end: the barrier in close() would wait forever for a rank that failed.
    trainer.backend.close()
    if trainer.backend.rank == 0:
        print(trainer.failure_summary(), file=sys.stderr if trainer.totals["failed"] else sys.stdout)
        print(trainer.memory_summary())
        if code == 0:
            print(f"done: {trainer.step} steps; metrics in {Path(cfg.run.output_dir) / 'metrics.jsonl'}"
                  + _programs_left_running())
    return code


def _maybe_init_distributed(run_device: str = "cpu", timeout_s: float = 600.0) -> None:
    """Under torchrun/accelerate launch (WORLD_SIZE > 1) start the process group via accelerate,
    on the backend of ``run.device`` (a CPU run stays on gloo on a machine with GPUs) and, for a
    CUDA run, with this rank's GPU current (``cuda:LOCAL_RANK``)."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch
        from accelerate import Accelerator

        from srpo.parallel.devices import rank_device

        import datetime

        from accelerate.utils import InitProcessGroupKwargs

        device = rank_device(run_device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # Every collective waits at most run.collective_timeout_s (gloo and NCCL honour it).
        Accelerator(cpu=device.type == "cpu",
                    kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=timeout_s))])
        from srpo.parallel.teardown import mark_process_group_used

        mark_process_group_used()


def _parse_data(specs: list[str]):
    """Data sources of ``--data``: FILE, hub:ID, or a synthetic source with its fields as
    ``key=value`` pairs after colons (synthetic_arithmetic:level=2:n=100:seed=7) — the values parsed
    and checked like any config override, against :class:`~srpo.config.DataSource`'s fields."""
    from srpo.config import ConfigError, DataSource, parse_overrides, parse_section
    from srpo.tasks.kinds import synthetic_source

    sources = []
    for spec in [s for item in specs for s in item.split(",") if s]:
        name, *params = spec.split(":") if synthetic_source(spec.split(":")[0]) else (spec,)
        fields = {"source": name, **({} if synthetic_source(name) else {"n": 0})}
        try:
            fields.update(parse_overrides(params))
            sources.append(parse_section(DataSource, fields, "--data"))
        except ConfigError as err:
            raise UsageError(f"--data {spec}: {str(err).removeprefix('--data.')}") from None
    return sources


def _checkpoint_for_eval(model: str) -> Path | None:
    """The training checkpoint ``--model`` names — a checkpoint folder, a run's ``checkpoints``
    folder or a run folder (its newest complete checkpoint) — or None for a model name or a plain
    HF model folder (which has a config.json too, but no manifest or trainer state)."""
    from srpo.runs.checkpoint import CheckpointError, candidates, is_checkpoint, verify

    def usable(folder: Path) -> str | None:
        """What keeps ``folder``'s weights from being evaluated (None: fine): a checkpoint without
        its manifest is refused like a damaged one."""
        return verify(folder, digests=False)

    path = Path(model)
    if not path.is_dir():
        return None
    if is_checkpoint(path):
        problem = usable(path)
        if problem:
            raise CheckpointError(f"{path}: {problem}")
        return path
    run_dir = path if (path / "checkpoints").is_dir() else path.parent if path.name == "checkpoints" else None
    if run_dir is None:
        return None  # a plain model folder
    problems = []
    for folder in candidates(run_dir):
        problem = usable(folder)
        if problem is None:
            return folder
        problems.append(f"{folder.name}: {problem}")
    raise CheckpointError(f"{run_dir / 'checkpoints'}: no complete checkpoint to evaluate"
                          + (":\n  " + "\n  ".join(problems) if problems else ""))


def _sft_output_for_eval(model: str) -> Path | None:
    """The ``srpo sft`` output folder ``--model`` names — the folder itself or its ``model/`` — or
    None.  Its ``model/`` holds weights per layout (``shared/``, adapters, one folder per role), not
    one HF model: it is evaluated as its base model with ``model.init_from``, as RL starts from it."""
    path = Path(model)
    for folder in (path, path.parent) if path.name == "model" else (path,):
        if (folder / "sft.json").is_file() and (folder / "config.json").is_file() and (folder / "model").is_dir():
            return folder
    return None


def _load_checkpoint(team, checkpoint: Path, model: str, attempts: int = 5) -> Path:
    """Load a training checkpoint's weights into ``team``.  Evaluating a run that is still training:
    the run may prune this checkpoint while it loads — then the newest one is loaded instead, and
    that is said.  Returns the checkpoint loaded."""
    from srpo.runs.checkpoint import CheckpointError

    for _ in range(attempts):
        try:
            team.policies.load_pretrained_weights(checkpoint / "model")
            return checkpoint
        except Exception:
            if (checkpoint / "model").is_dir():  # still there: a real failure, not a pruning
                raise
            newer = _checkpoint_for_eval(model)
            if newer is None or newer == checkpoint:
                raise
            print(f"checkpoint {checkpoint.name} was pruned by the still-running training while it loaded; "
                  f"loading the newest, {newer.name}", file=sys.stderr)
            checkpoint = newer
    raise CheckpointError(f"{model}: its checkpoints were pruned {attempts} times while loading; "
                          f"evaluate a copy, or when the run has ended")


def _model_config(args) -> tuple[dict, Path | None, dict | None]:
    """The config ``--model`` (and ``--workflow``/``--options``) describe, as a dict to complete,
    the training checkpoint whose weights to load (None: a model name, path or warm start), and a
    copy of the config read from the folder (None: nothing was read) — what
    :func:`_refuse_folder_code` checks the finished config against."""
    import copy

    from srpo import build

    checkpoint = _checkpoint_for_eval(args.model)
    warm_start = _sft_output_for_eval(args.model) if checkpoint is None else None
    if checkpoint is not None:  # a training checkpoint: rebuild its layout and load its weights
        data = build.checkpoint_config(checkpoint)
    elif warm_start is not None:  # srpo sft's output: its base model, layout and workflow, its weights
        data = json.loads((warm_start / "config.json").read_text())
        data["model"]["init_from"] = str(warm_start / "model")
        print(f"the warm start in {warm_start}", file=sys.stderr)
    else:
        data = {"model": {"name": args.model, "layout": "shared"}}
    saved = copy.deepcopy(data) if checkpoint is not None or warm_start is not None else None
    # The workflow: --workflow, else the one the checkpoint or warm start was trained in, else single.
    workflow_ = data.setdefault("workflow", {})
    workflow_["name"] = args.workflow or workflow_.get("name") or "single"
    if args.workflow or args.options:
        try:
            workflow_["options"] = json.loads(args.options) if args.options else {}
        except json.JSONDecodeError as err:
            raise UsageError(f"--options {args.options!r}: not JSON ({err.msg})") from None
    return data, checkpoint, saved


# Sections of a saved config that serving and evaluating weights never use: code they name is
# dropped (the defaults apply), not refused.
_UNUSED_WHEN_SERVING = ("method", "train", "log", "checkpoint", "sft")


def drop_folder_retriever(saved: dict | None, data: dict, user_url: str) -> str | None:
    """A retriever URL that came from a folder's config (``saved``) is dropped from ``data`` unless the
    user gave their own (``user_url``): srpo sends ``SRPO_RETRIEVER_API_KEY`` only where the user
    sent it, never to a URL someone else's folder names.  Returns the note to print, or None."""
    from srpo.runs.secrets import redact

    folder_url = ((saved or {}).get("retriever") or {}).get("url")
    if not folder_url or user_url:
        return None
    data.setdefault("retriever", {})["url"] = ""
    return (f"the folder's retriever.url ({redact(folder_url)}) is not used: a URL from a run folder never receives "
            f"your credentials — give your own with --retriever-url (or --set retriever.url=...) or search a --corpus")


def _refuse_folder_code(args, saved: dict | None, data: dict, flags: dict, *, serving: bool) -> None:
    """Code named in the folder's config (``saved``) runs only with ``--trust-run-code``
    (:mod:`srpo.runs.trust`).  Called before anything resolves a name in ``data``.  Without the
    flag: sections ``serve``/``eval`` do not use lose their import paths; ``srpo serve`` of a
    program's run (``openai_agent``) serves its roles without the program; anything else still
    named — after the user's own ``flags`` (dotted key → value) and ``--set`` — is refused."""
    import copy

    from srpo.config import apply_overrides
    from srpo.runs.trust import code_named, refuse_files_outside, refuse_saved_code

    if saved is None or args.trust_run_code:
        return
    for key in code_named(saved):
        section, _, rest = key.partition(".")
        node = data.get(section) if section in _UNUSED_WHEN_SERVING else None
        if isinstance(node, dict):
            node.pop(rest.split("[")[0].split(".")[0], None)
    workflow_ = data["workflow"]
    if serving and args.workflow is None and workflow_.get("name") == "openai_agent":
        roles = (workflow_.get("options") or {}).get("roles")
        data["workflow"] = {**{k: v for k, v in workflow_.items() if k != "options"},
                            "name": "roles", "options": {"roles": roles}}
        print(f"serving the roles of {args.model} without its agent program (the weights need none; "
              "--trust-run-code would load it)", file=sys.stderr)
    final = copy.deepcopy(data)
    for dotted, value in flags.items():
        if value:
            section, _, key = dotted.partition(".")
            final.setdefault(section, {})[key] = value
    apply_overrides(final, args.set)
    refuse_saved_code(saved, final, str(args.model))
    refuse_files_outside(saved, final, _folder_of(args.model), str(args.model))


def _folder_of(model: str) -> Path:
    """The run (or srpo sft output) folder ``--model`` names: the folder holding ``checkpoints/``
    when it names a checkpoint inside one, else itself."""
    path = Path(model).resolve()
    for candidate in (path, *path.parents):
        if candidate.name == "checkpoints":
            return candidate.parent
    return path


def _eval(args) -> int:
    import torch

    from srpo import build
    from srpo.build import config_from_dict
    from srpo.config import apply_overrides
    from srpo.data import guess_kind
    from srpo.evaluation import evaluate, markdown_table, write_results
    from srpo.workflows.builtins import WORKFLOWS

    sources = _parse_data(args.data)
    data, checkpoint, saved = _model_config(args)
    _refuse_folder_code(args, saved, data, {"task.kind": args.kind}, serving=False)
    note = drop_folder_retriever(saved, data, args.retriever_url)
    if note:
        print(note, file=sys.stderr)
    workflow_ = data["workflow"]
    kind = args.kind
    if kind is None and workflow_["name"] in WORKFLOWS:
        kind = WORKFLOWS[workflow_["name"]].kind if WORKFLOWS.capabilities(workflow_["name"]).needs_retriever else None
    if kind is None:  # from the data: graded by the wrong kind, a dataset scores silently wrong
        kinds = {k for k in (guess_kind(s) for s in sources) if k}
        if len(kinds) > 1:
            raise UsageError(f"--data mixes task kinds ({', '.join(sorted(kinds))}); evaluate them separately, "
                             f"each with its --kind")
        kind = kinds.pop() if kinds else "math"  # hub datasets cannot be looked at before loading: the default kind
    data.setdefault("task", {})
    data["task"]["kind"] = kind
    data["task"]["eval"] = [s.model_dump() for s in sources]
    if args.corpus:
        data["task"]["corpus"] = args.corpus
    if args.retriever_url:
        data.setdefault("retriever", {})["url"] = args.retriever_url
        data["task"]["corpus"] = ""
    if args.max_new_tokens:
        data["workflow"]["max_new_tokens"] = args.max_new_tokens
    apply_overrides(data, args.set)
    cfg = config_from_dict(data, training=False)
    if args.threads:
        torch.set_num_threads(args.threads)
    # The data first: a bad dataset fails before a model loads.
    datasets = build.eval_sets(cfg, n=args.n)
    team = build.team(cfg)
    if checkpoint is not None:
        checkpoint = _load_checkpoint(team, checkpoint, args.model)
        print(f"evaluating checkpoint {checkpoint}", file=sys.stderr)
    episodes = None
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        episodes = Path(args.out) / "episodes.jsonl"
    results = evaluate(team.policies, team.workflow, team.role_specs, datasets, k=args.k,
                       temperature=args.temperature, seed=args.seed, progress=True,
                       workflows=build.eval_workflows(cfg, None, team.workflow), episodes_path=episodes)
    print(markdown_table(results, f"{args.model} — {cfg.workflow.name}"))
    if args.out:
        js, md = write_results(results, Path(args.out), "eval", f"{args.model} — {cfg.workflow.name}")
        print(f"written: {js}, {md}, {episodes} (every episode)")
    return 0


def _serve(args) -> int:
    import torch

    from srpo import build
    from srpo.build import config_from_dict
    from srpo.config import apply_overrides
    from srpo.gateway.backends import ServeBackend
    from srpo.gateway.server import serve_forever
    from srpo.rollout.vllm import engine_dtype

    data, checkpoint, saved = _model_config(args)
    _refuse_folder_code(args, saved, data, {"rollout.engine": args.engine}, serving=True)
    if args.engine:
        data.setdefault("rollout", {})["engine"] = args.engine
    if args.max_new_tokens:
        data["workflow"]["max_new_tokens"] = args.max_new_tokens
    data.setdefault("task", {}).setdefault("kind", "math")
    apply_overrides(data, args.set)
    if data.setdefault("rollout", {}).get("enforce_eager") is None:
        # a server lives long: compile vLLM's model as its own server does (~30 s once on a CPU)
        data["rollout"]["enforce_eager"] = False
    cfg = config_from_dict(data, training=False)
    if args.threads:
        torch.set_num_threads(args.threads)
    team = build.team(cfg)
    if checkpoint is not None:
        checkpoint = _load_checkpoint(team, checkpoint, args.model)
    engine = build.engine(cfg, team.policies)
    loaded = (f"checkpoint {checkpoint.name} ({checkpoint})" if checkpoint is not None else
              f"weights {cfg.model.init_from}" if cfg.model.init_from else f"model {cfg.model.name}")
    backend = ServeBackend(engine, team.policies, team.role_specs, autocast=build.autocast(cfg), seed=args.seed,
                           max_prompt_tokens=cfg.workflow.max_prompt_tokens, max_tokens=args.max_tokens or None,
                           max_queue=args.max_queue)

    def ready(host, port):
        limit = (f"max_tokens up to {args.max_tokens}" if args.max_tokens else
                 f"max_tokens up to the model's context ({backend.context} tokens with the prompt)" if backend.context
                 else "max_tokens as asked")
        print(f"serving {', '.join(backend.roles)} ({args.model}: {loaded}; engine {cfg.rollout.engine}) at "
              f"http://{host}:{port}/v1 — {limit}; Ctrl-C stops", flush=True)
        if cfg.rollout.engine == "vllm" and engine_dtype(cfg) == "float32":
            print("vLLM's engine runs in float32 (the model's dtype, as training needs); "
                  "--set rollout.dtype=bfloat16 serves in bf16, as `vllm serve` does", flush=True)

    try:  # a port in use is a ServeError: one error line (main)
        serve_forever(backend, args.host, args.port, ready=ready,
                      api_key=args.api_key if args.api_key is not None else os.environ.get("SRPO_API_KEY", ""))
    finally:
        engine.close()
    return 0


def _sft(args) -> int:
    from srpo.runs import preemption
    from srpo.build import load_config
    from srpo.apps.sft import check_sft_config, run_sft

    cfg = load_config(args.config, args.set)
    check_sft_config(cfg)  # before any model loads
    preemption.install(cfg.run.preempt_grace_s)
    from srpo.train import TrainingStopped

    try:
        model = run_sft(cfg, overwrite=args.overwrite, resume=args.resume)
    except TrainingStopped as err:  # NaN/Inf steps in a row: stopped with a checkpoint, as srpo train does
        print(f"fine-tuning stopped: {err}", file=sys.stderr)
        return 3
    print(f"done: fine-tuned weights in {model}; evaluate them with srpo eval --model {model.parent} --data ...; "
          f"start RL from them with --set model.init_from={model} (same model.layout: {cfg.model.layout})")
    return 0


def _demo(args) -> int:
    from srpo.apps.demo import run_demo

    run_demo(args.output_dir, args.steps)
    return 0


def _programs_left_running() -> str:
    """The closing line's note of thread-isolated programs that never returned (they do not keep
    the process alive: daemon threads), or ''."""
    import sys as _sys

    module = _sys.modules.get("srpo.workflows.openai_agent")
    left = module.programs_never_returned() if module is not None else 0
    return f"; {left} agent program call(s) never returned (left behind in daemon threads)" if left else ""


class _VersionAction(argparse.Action):
    """``--version``: the line is made only when asked (it runs git)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def version_line() -> str:
    """``srpo <version>``, with the commit when srpo runs from a git checkout (``+dirty`` with
    uncommitted changes)."""
    import subprocess

    import srpo

    root = Path(srpo.__file__).resolve().parents[1]
    line = f"srpo {srpo.__version__}"
    if not (root / ".git").exists():
        return line
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return line
    return f"{line} (commit {head}{'+dirty' if dirty else ''})"


def _report(args) -> int:
    from srpo.runs.metrics_log import read_metrics
    from srpo.apps.report import write_summary

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir}: no such folder")
    if not read_metrics(run_dir):
        raise UsageError(f"{run_dir}: no metrics.jsonl rows — not a run folder, or a run that has not "
                         f"finished a step yet")
    try:
        path = write_summary(run_dir)
    except ValueError as err:  # a metrics log srpo did not write: one line, no traceback
        raise UsageError(str(err)) from None
    print(f"report: {path}")
    return 0


def _models(args) -> int:
    from srpo.policies import models as registry

    if args.action == "list":
        for name in registry.registered_names():
            where = registry.cache_root() / name
            state = "converted" if (where / registry.COMPLETE_MARKER).is_file() else (
                "built on the fly" if name in registry.TINY_MODELS else "not converted yet")
            print(f"{name:15s} {state}")
        return 0
    if not args.name or args.name not in registry.GGUF_MODELS:
        raise UsageError(f"srpo models {args.action} needs one of: {', '.join(registry.GGUF_MODELS)}")
    if args.action == "prepare":
        path = registry.converted_checkpoint(args.name, force=args.force)
        print(f"{args.name}: {path}")
    else:
        registry.verify_cache(args.name)
        print(f"{args.name}: cache verified")
    return 0


class UsageError(ValueError):
    """A command-line argument is wrong; the message names it."""


def _number(kind, minimum, what):
    """An argparse type: ``kind`` (int or float), finite and ≥ ``minimum``."""
    def parse(text: str):
        import math

        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if (kind is float and not math.isfinite(value)) or value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    parse.__name__ = what
    return parse


def _retriever(args) -> int:
    from srpo.data import corpus_passages
    from srpo.tasks.retrieval_service import API_KEY_ENV, serve
    from srpo.tasks.search import BM25Retriever

    started = time.perf_counter()
    passages = corpus_passages(args.corpus)
    index = BM25Retriever(passages)
    print(f"BM25 over {len(passages)} passages of {args.corpus} ({time.perf_counter() - started:.1f} s); "
          f"serving POST http://{args.host}:{args.port}/retrieve (Ctrl-C stops)", file=sys.stderr, flush=True)
    serve(index, host=args.host, port=args.port, default_topk=args.topk, docs=args.docs,
          api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV, ""))
    return 0


def _config(args) -> int:
    """``srpo config show``: every field, its type and default (and its value in ``--config``)."""
    from srpo.build import load_config
    from srpo.config import describe_fields

    if args.markdown:
        print(config_markdown(), end="")
        return 0
    values = None
    if args.config:
        from srpo.build import skipped_package_check

        refuse_study_file(args.config, "srpo config show")
        cfg = load_config(args.config, args.set, packages=False)  # inspected here, run elsewhere
        values = cfg.model_dump()
        skipped = skipped_package_check(cfg)
        if skipped:
            print(f"# skipped here, checked when it runs: {skipped}", file=sys.stderr)
    for key, type_name, default, doc in describe_fields():
        line = f"{key}: {type_name} = {json.dumps(default, default=str)}"
        if values is not None and "[]" not in key and "<name>" not in key:
            value = values
            for part in key.split("."):
                value = value[part]
            if value != default:
                line += f"   (this config: {json.dumps(value, default=str)})"
        print(line)
        if doc:
            print(f"    {doc}")
    return 0


def refuse_study_file(path: str, command: str) -> None:
    """A study file (``axes`` and ``seeds`` beside a ``base``) given where a run config is expected:
    a usage error that names the command that takes it, not the schema's 'unknown key'."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) if Path(path).is_file() else None
    except (OSError, yaml.YAMLError):
        return  # the config loader says what is wrong with it
    if isinstance(data, dict) and "axes" in data and "seeds" in data and "base" in data:
        raise UsageError(f"{path} is a study file, not a run config: run it with srpo study --config {path} "
                         f"({command} takes a run config such as its base, {data['base']})")


def config_markdown() -> str:
    """The configuration reference page of the docs (``docs/configuration.md``), from the schema:
    one section per top-level key, each field with its type, default and documentation."""
    from srpo.config import describe_fields

    out = ["# Configuration\n\n",
           "Every field of a run's config, generated from the schema (`srpo/config.py`) by "
           "`srpo config show --markdown` — `make docs` regenerates this page and a test checks it is current. "
           "`srpo config show --config my.yaml` prints the same with your config's values. A wrong key, type or "
           "value fails before any model loads, naming the field.\n"]
    section = None
    for key, type_name, default, doc in describe_fields():
        top = key.split(".")[0]
        if top != section:
            section = top
            out.append(f"\n## `{top}`\n\n")
        out.append(f"- **`{key}`**: {type_name} = `{json.dumps(default, default=str)}`" + (f" — {doc}" if doc else "")
                   + "\n")
    return "".join(out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="srpo", description="Setwise Relative Policy Optimization for multi-agent LLMs")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action=_VersionAction, nargs=0,
                        help="print srpo's version (and the commit of a git checkout) and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_commands(sub)
    _add_tool_commands(sub)
    from srpo.apps.study.command import add_study_parser

    add_study_parser(sub)
    return parser


def _add_overrides(p: argparse.ArgumentParser, help: str) -> None:
    """``--set KEY=VALUE ...`` (repeatable; values are YAML), as every config-reading command takes it."""
    p.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE", help=help)


def _add_run_commands(sub) -> None:
    p = sub.add_parser("train", help="train a workflow from a YAML config")
    p.add_argument("--config", required=True, help="YAML config (see configs/)")
    _add_overrides(p, "override config fields: --set train.lr=1e-5 run.steps=50 (values are YAML)")
    p.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    p.add_argument("--allow-data-change", action="store_true",
                   help="with --resume: continue although the data changed since the checkpoint (refused otherwise)")
    p.add_argument("--overwrite", action="store_true",
                   help="delete a previous run's metrics, samples, checkpoints and TensorBoard logs in run.output_dir")
    p.set_defaults(func=_train)

    p = sub.add_parser("sft", help="supervised warm start of every role from transcripts (a file or a script)")
    p.add_argument("--config", required=True, help="the run config (model, layout, workflow, prompts) and its sft: section")
    _add_overrides(p, "override config fields, e.g. sft.script=srpo.tasks.scripts:search_team sft.episodes=300")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a previous fine-tuning's output in sft.output_dir (only what srpo sft wrote there)")
    p.add_argument("--resume", action="store_true",
                   help="continue a stopped fine-tuning in sft.output_dir from its newest checkpoint")
    p.set_defaults(func=_sft)

    p = sub.add_parser("eval", help="avg@k / pass@k of a model or checkpoint in a workflow")
    p.add_argument("--model", required=True,
                   help="registered name, HF path/id, a run's checkpoint folder, or srpo sft's output folder")
    p.add_argument("--workflow", default=None,
                   help="default: the workflow the checkpoint or warm start was trained in, else single")
    p.add_argument("--options", default="",
                   help='workflow options as JSON, e.g. \'{"num_workers": 3}\' (default with --workflow: none)')
    p.add_argument("--data", action="append", required=True,
                   help="FILE[,FILE...], hub:ID, synthetic_arithmetic:level=2:n=100:seed=7, synthetic_kb:n=50")
    p.add_argument("--kind", default=None,
                   help="the task kind that grades (math, qa, or a registered/import-path one; default: the "
                        "search workflows' qa, else from the data's rows)")
    _add_overrides(p, "override fields of the evaluation config (e.g. workflow.roles.aggregator.max_new_tokens=32)")
    p.add_argument("--corpus", default="", help="search workflows: corpus jsonl or synthetic_kb")
    p.add_argument("--retriever-url", default="", help="search workflows: a retrieval server instead of --corpus")
    p.add_argument("-k", type=_number(int, 1, "an integer ≥ 1"), default=16, help="samples per problem")
    p.add_argument("--n", type=_number(int, 0, "an integer ≥ 0"), default=0, help="problems per dataset (0: all)")
    p.add_argument("--temperature", type=_number(float, 0, "a finite number ≥ 0"), default=1.0)
    p.add_argument("--max-new-tokens", type=_number(int, 0, "an integer ≥ 0"), default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=_number(int, 0, "an integer ≥ 0"), default=0)
    p.add_argument("--out", default="", help="folder for eval.json and eval.md")
    p.add_argument("--trust-run-code", action="store_true",
                   help="run the agent program and import paths the run folder's config names (never by default)")
    p.set_defaults(func=_eval)

    p = sub.add_parser("serve", help="the OpenAI- and Anthropic-compatible endpoint on a trained team "
                                     "(model = a role's name)")
    p.add_argument("--model", required=True,
                   help="a run folder, a checkpoint, srpo sft's output folder, or a model name/path (then --workflow)")
    p.add_argument("--workflow", default=None, help="default: the workflow the checkpoint was trained in, else single")
    p.add_argument("--options", default="", help="workflow options as JSON (with --workflow)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=_number(int, 0, "a port number"), default=8000, help="0: any free port")
    p.add_argument("--engine", default=None,
                   help="what samples: a registered rollout engine (builtin, vllm) or an import path "
                        "(default: the run's rollout.engine)")
    p.add_argument("--max-new-tokens", type=_number(int, 0, "an integer ≥ 0"), default=0,
                   help="each role's token budget for a request that gives no max_tokens (default: the run's)")
    p.add_argument("--max-tokens", type=_number(int, 0, "an integer ≥ 0"), default=0,
                   help="the most tokens a request's max_tokens may get (default: what the model's context leaves "
                        "after the prompt); a request asking for more is capped, and the server says so once")
    p.add_argument("--max-queue", type=_number(int, 1, "an integer ≥ 1"), default=256,
                   help="the most generations waiting; beyond, requests get 429 with Retry-After")
    p.add_argument("--api-key", default=None,
                   help="every request must send Authorization: Bearer KEY, as OpenAI clients do with api_key= "
                        "(or x-api-key: KEY, as Anthropic's do; default: $SRPO_API_KEY; none)")
    _add_overrides(p, "override fields of the serving config (e.g. workflow.roles.judge.temperature=0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=_number(int, 0, "an integer ≥ 0"), default=0)
    p.add_argument("--trust-run-code", action="store_true",
                   help="run the agent program and import paths the run folder's config names (never by default)")
    p.set_defaults(func=_serve)

    p = sub.add_parser("demo", help="SRPO on the embedded SmolLM2-135M: eval, train, eval, report")
    p.add_argument("--output-dir", default=None, help="run folder (default runs/demo); a previous demo run in it is replaced")
    p.add_argument("--steps", type=int, default=None)
    p.set_defaults(func=_demo)


def _add_tool_commands(sub) -> None:
    p = sub.add_parser("config", help="every config field with its type, default and documentation")
    p.add_argument("action", choices=["show"])
    p.add_argument("--config", default=None, help="also show this config's values where they differ from the defaults")
    p.add_argument("--markdown", action="store_true", help="print the docs' configuration page (docs/configuration.md)")
    _add_overrides(p, "overrides, as for train")
    p.set_defaults(func=_config)

    p = sub.add_parser("report", help="plots and a summary page for a run folder")
    p.add_argument("run_dir")
    p.set_defaults(func=_report)

    p = sub.add_parser("models", help="list, prepare (convert once) or verify the embedded models")
    p.add_argument("action", choices=["list", "prepare", "verify"])
    p.add_argument("name", nargs="?")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=_models)

    p = sub.add_parser("retriever", help="serve BM25 retrieval over HTTP (the Search-R1 retrieval API)")
    p.add_argument("action", choices=["serve"])
    p.add_argument("--corpus", required=True, help="passages jsonl (id, title, text) or synthetic_kb:n=40:seed=0")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=_number(int, 1, "a port number"), default=8000)
    p.add_argument("--topk", type=_number(int, 1, "an integer ≥ 1"), default=3, help="passages per query when a request names none")
    p.add_argument("--api-key", default=None,
                   help="every request must send Authorization: Bearer KEY (default: $SRPO_RETRIEVER_API_KEY; none)")
    p.add_argument("--docs", action="store_true", help="also serve /docs and /openapi.json")
    p.set_defaults(func=_retriever)


def main(argv: list[str] | None = None) -> int:
    """Run one command.  Every failure ends in one ``error:`` line and a non-zero exit: 2 for
    bad input (config, data, checkpoint, model, run folder, arguments), 1 for anything
    unexpected, 130 for Ctrl-C; ``-v`` adds the traceback."""
    args = build_parser().parse_args(argv)
    from srpo.runs.terminal import survive_lost_terminal

    survive_lost_terminal()  # before logging captures stderr: a terminal that goes away ends no run
    # INFO records reach the run folder's srpo.log (srpo.runs.run_log); the terminal shows warnings.
    before = list(logging.getLogger().handlers)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        if handler not in before:  # the terminal's (logging configured by someone else is left alone)
            handler.setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    for noisy in ("bm25s", "transformers", "peft"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    from srpo.runs import preemption
    from srpo.runs.checkpoint import CheckpointError
    from srpo.runs.fileio import WriteError
    from srpo.config import ConfigError
    from srpo.parallel.base import CollectiveTimeout
    from srpo.runs.serving import ServeError
    from srpo.runs.preemption import Preempted
    from srpo.policies import ModelLoadError
    from srpo.runs.run_dir import RunDirError
    from srpo.tasks import DatasetError
    from srpo.runs.trust import UntrustedCode

    try:
        return args.func(args)
    except (ConfigError, CheckpointError, ModelLoadError, DatasetError, RunDirError, UsageError, ServeError,
            WriteError, UntrustedCode) as err:
        if args.verbose:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except CollectiveTimeout as err:  # a rank did not answer: named, never waited for
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Preempted as err:  # SIGTERM/SIGUSR1: saved at a safe point (srpo.runs.preemption)
        print(f"stopped: {err}", file=sys.stderr)
        return preemption.EXIT_CODE
    except Exception as err:  # noqa: BLE001 - the last line of defence: one message, not a traceback
        if args.verbose:
            traceback.print_exc()
        if isinstance(err, OSError) and err.errno in WRITE_ERRNOS:  # a write srpo did not wrap: still one line
            from srpo.runs.fileio import write_error

            print(f"error: {write_error(err, err.filename or 'a file')}", file=sys.stderr)
            return 2
        where = ""
        if isinstance(err, OSError) and err.filename:
            where = f" ({err.filename})"
        print(f"error: {err.__class__.__name__}: {str(err).splitlines()[0] if str(err) else ''}{where} "
              f"— unexpected; run with -v for the traceback", file=sys.stderr)
        return 1


def entry() -> None:
    """The ``srpo`` command (console script, ``python -m srpo``): :func:`main`, then exit — a process
    that formed a process group ends without finalising the interpreter
    (:mod:`srpo.parallel.teardown`: gloo's threads can otherwise abort a finished run)."""
    import contextlib
    import signal

    try:
        code = main()
    except KeyboardInterrupt:  # before main's own handler: while importing, parsing, building the parser
        print("interrupted", file=sys.stderr)
        code = 130
    with contextlib.suppress(ValueError):  # a Ctrl-C while exiting (atexit, thread joins) ends at once, silently
        signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    from srpo.parallel.teardown import end_process, process_group_used

    if process_group_used():
        end_process(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
