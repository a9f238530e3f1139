"""``srpo sft``: multi-role supervised fine-tuning from transcripts — a warm start before RL.

A small model often cannot produce a workflow's formats (``<search>…</search>``, ``SEARCH`` /
``ANSWER``, ``WORKERS: 1, 2``) often enough for group-relative RL to find a signal.  ``srpo sft``
teaches each role its part from transcripts of whole episodes, with the run config's own model
layout, roles, prompts and templates, so the prompts it trains on are the prompts RL samples from.

Transcripts are jsonl, one episode per line::

    {"task": "kb-s0-3", "turns": [
        {"role": "verifier", "input": "Question: ...\\n\\nInformation gathered:\\n(none yet)", "output": "SEARCH"},
        {"role": "searcher_1", "prompt": "<the whole rendered prompt>", "output": "<search>...</search>"},
        ...]}

A turn gives either ``input`` — the content the workflow passes to the role (``ctx.ask(role,
input)``; the role's system prompt and template from the config are applied, and an optional
``prefix`` is appended as the start of the answer) — or ``prompt``, the prompt exactly as the model
saw it.  ``output`` is what the role should answer.  (Scripted transcripts also carry ``prompt_ids``, the exact ids.)  Each role's policy (per ``model.layout``) is
trained on its turns by cross-entropy on the output tokens (the end-of-sequence token is appended
unless the output ends with one of the role's stop strings, so the model also learns to stop).

Transcripts can also be *scripted*: ``sft.script: package.module:function`` names
``fn(role, prompt, task) -> str``; srpo runs the configured workflow on ``sft.episodes`` training
tasks with that function answering for every role (the workflow's real logic and tools — the
retriever's real results — shape every prompt), keeps the episodes whose reward reaches
``sft.min_reward``, writes them to ``<output_dir>/transcripts.jsonl`` and trains on them.
:mod:`srpo.tasks.scripts` holds scripts for the built-in search workflows.

The fine-tuned weights go to ``<sft.output_dir>/model`` (with the config in ``config.json``); an
RL run starts from them with ``model.init_from: <sft.output_dir>/model`` and the same layout.
The training itself is :class:`srpo.train.supervised.SupervisedTrainer`: RL training's backend,
optimizer builder, metrics log (``metrics.jsonl``, the trackers) and checkpoints
(``checkpoint.every``; ``srpo sft --resume`` continues a stopped fine-tuning).
"""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path
from typing import Any, Callable

from srpo import build
from srpo.config import Config
from srpo.runs.fileio import write_text_atomic
from srpo.runs.run_dir import SFT_ARTEFACTS
from srpo.runs.secrets import redacted
from srpo.tasks.base import DatasetError, Task
from srpo.train.supervised import Example

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- transcripts

def read_transcripts(path: str | Path) -> list[dict[str, Any]]:
    """Episodes of a transcripts jsonl, each checked (the file and line named on any problem;
    reading — UTF-8, JSON, empty files — as every dataset is read, :func:`srpo.tasks.base.read_jsonl`)."""
    from srpo.tasks.base import read_jsonl

    episodes = []
    for n, episode in read_jsonl(path):
        turns = episode.get("turns")
        if not isinstance(turns, list) or not turns:
            raise DatasetError(f"{path}, line {n}: an episode needs a non-empty list 'turns'")
        for i, t in enumerate(turns):
            where = f"{path}, line {n}, turn {i}"
            if not isinstance(t, dict) or not isinstance(t.get("role"), str):
                raise DatasetError(f"{where}: a turn needs a 'role'")
            if not isinstance(t.get("output"), str) or not t["output"]:
                raise DatasetError(f"{where}: a turn needs a non-empty 'output'")
            if not isinstance(t.get("input"), str) and not isinstance(t.get("prompt"), str) and "prompt_ids" not in t:
                raise DatasetError(f"{where}: a turn needs an 'input' (the content given to the role) or a 'prompt'")
            ids = t.get("prompt_ids")
            if ids is not None and (not isinstance(ids, list) or not ids
                                    or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
                raise DatasetError(f"{where}: 'prompt_ids' must be a non-empty list of token ids (integers ≥ 0)")
        episode["_where"] = f"{path}, line {n}"  # named by later checks (ids beyond the vocabulary)
        episodes.append(episode)
    return episodes


def scripted_transcripts(cfg: Config, script: Callable[[str, str, Task], str], episodes: int,
                         min_reward: float, tokenizer, progress: bool = True) -> tuple[list[dict], dict[str, float]]:
    """Run the configured workflow with ``script`` answering for every role, on ``episodes``
    training tasks (seeded order); keep episodes whose reward ≥ ``min_reward``.

    Returns ``(episodes, stats)``: each episode as ``{"task", "reward", "turns": [{role, prompt,
    output}]}`` — the prompt decoded from the exact ids the workflow built."""
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.workflows.runtime import Runtime
    from srpo.rollout.builtin import BuiltinEngine

    tasks = build.train_tasks(cfg)
    order = list(range(len(tasks)))
    random.Random(cfg.run.seed).shuffle(order)
    team_workflow = build.workflow(cfg, build.retriever(cfg))
    specs = build.role_specs(cfg, team_workflow)
    reward = build.reward(cfg)
    current: list[Task] = []

    def answer(role: str, prompt: str) -> str:
        return script(role, prompt, current[0])

    policies = ScriptedPolicies(answer, team_workflow.roles(), tokenizer=tokenizer)
    runtime = Runtime(BuiltinEngine(policies), specs, reward)
    kept, rewards = [], []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=episodes, desc="scripted episodes", unit="episode", dynamic_ncols=True)
    for i in range(episodes):
        task = tasks[order[i % len(order)]]
        current[:] = [task]
        (ep,) = runtime.run(team_workflow, [(f"sft-{i}", task)])
        rewards.append(ep.reward)
        if ep.reward >= min_reward:
            # The exact prompt ids too: decoding and re-tokenizing a prompt need not give them back.
            turns = [{"role": m.role, "prompt": tokenizer.decode(m.prompt_ids, skip_special_tokens=False),
                      "prompt_ids": list(m.prompt_ids), "output": m.text}
                     for e in ep.events for m in e.members if m.text]
            kept.append({"task": task.task_id, "reward": ep.reward, "turns": turns})
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    stats = {"episodes": episodes, "kept": len(kept), "mean_reward": sum(rewards) / max(len(rewards), 1)}
    return kept, stats


def examples_from(episodes: list[dict], specs, tokenizer, *, max_tokens: int = 0, long_turns: str = "skip",
                  counts: dict[str, int] | None = None) -> list[Example]:
    """Tokenized (prompt, completion) pairs; prompts from ``input`` are built as the runtime builds them.

    A turn longer than ``max_tokens`` (prompt + answer; 0: no limit) is skipped or, with
    ``long_turns="truncate"``, cut to fit — its answer's end first, then its prompt's start —
    counted in ``counts`` (``long_turns_skipped`` / ``long_turns_truncated``): a runaway turn
    costs itself, never the machine's memory."""
    from srpo.workflows.runtime import render_prompt_ids

    counts = counts if counts is not None else {}
    vocab = len(tokenizer)
    out = []
    for e_i, episode in enumerate(episodes):
        where = episode.get("_where", f"transcript episode {e_i + 1}")
        for n_turn, t in enumerate(episode["turns"]):
            role = t["role"]
            if role not in specs:
                raise DatasetError(f"{where}: role {role!r} is not a role of this workflow "
                                   f"({', '.join(sorted(specs))})")
            spec = specs[role]
            if isinstance(t.get("prompt_ids"), list):  # scripted transcripts: the ids the workflow built
                prompt_ids = [int(i) for i in t["prompt_ids"]]
                bad = [i for i in prompt_ids if not 0 <= i < vocab]
                if bad:
                    raise DatasetError(f"{where}, turn {n_turn}: prompt_ids holds {bad[0]}, outside this model's "
                                       f"vocabulary of {vocab} (written for another tokenizer?)")
            elif isinstance(t.get("prompt"), str):
                prompt_ids = tokenizer(t["prompt"], add_special_tokens=False)["input_ids"]
            else:
                prompt_ids = render_prompt_ids(tokenizer, spec, t["input"], t.get("prefix", ""))
            if max_tokens and len(t["output"]) > 64 * max_tokens:  # far too long: not even tokenized whole
                output = t["output"][: 64 * max_tokens]
            else:
                output = t["output"]
            ids = tokenizer(output, add_special_tokens=False)["input_ids"]
            if tokenizer.eos_token_id is not None and not any(t["output"].endswith(s) for s in spec.sampling.stop):
                ids = ids + [tokenizer.eos_token_id]  # learn to stop where the output stops
            if max_tokens and len(prompt_ids) + len(ids) > max_tokens:
                if long_turns == "skip" or len(prompt_ids) >= max_tokens:
                    counts["long_turns_skipped"] = counts.get("long_turns_skipped", 0) + 1
                    if counts["long_turns_skipped"] == 1:
                        log.warning("%s, turn %d: %d tokens, more than the %d trained on; skipped (counted; "
                                    "sft.long_turns: truncate keeps its start)", where, n_turn,
                                    len(prompt_ids) + len(ids), max_tokens)
                    continue
                ids = ids[: max_tokens - len(prompt_ids)]
                counts["long_turns_truncated"] = counts.get("long_turns_truncated", 0) + 1
            out.append(Example(role, prompt_ids, ids))
    return out


def context_length(policies, fallback: int = 4096) -> int:
    """The longest sequence the team's models take (their ``max_position_embeddings``)."""
    lengths = [getattr(getattr(m, "config", None), "max_position_embeddings", None) for m in policies.modules()]
    lengths = [n for n in lengths if isinstance(n, int) and n > 0]
    return min(lengths) if lengths else fallback


def check_sft_config(cfg: Config) -> None:
    """What ``srpo sft`` needs beyond a valid run config; raises :class:`ConfigError` naming the field."""
    from srpo.config import ConfigError
    from srpo.registry import RegistryError, import_object

    s = cfg.sft
    if bool(s.data) == bool(s.script):
        raise ConfigError("sft: give either sft.data (a transcripts jsonl) or sft.script (package.module:function)")
    if s.data and not Path(s.data).is_file():
        raise ConfigError(f"sft.data: no such file {s.data!r}")
    if s.script:
        try:
            fn = import_object(s.script)
        except RegistryError as err:
            raise ConfigError(f"sft.script: {err}") from None
        if not callable(fn):
            raise ConfigError(f"sft.script: {s.script!r} is not a function (role, prompt, task) -> str")
    for name in ("episodes", "epochs", "batch_size"):
        if getattr(s, name) < 1:
            raise ConfigError(f"sft.{name}: must be ≥ 1, got {getattr(s, name)}")
    if not (math.isfinite(s.lr) and s.lr > 0):
        raise ConfigError(f"sft.lr: must be > 0, got {s.lr}")


SFT_FILES = SFT_ARTEFACTS  # what srpo sft writes (srpo.runs.run_dir knows them, for --overwrite)


def sft_artefacts(cfg: Config) -> tuple[str, ...]:
    """What ``srpo sft`` writes in ``sft.output_dir``: its files, and a training run's logs,
    checkpoints and trackers' folders."""
    from srpo.train.state import run_artefacts

    return (*SFT_FILES, *run_artefacts(cfg))


def run_sft(cfg: Config, progress: bool = True, overwrite: bool = False, resume: bool = False) -> Path:
    """The whole stage: transcripts (file or script) → examples → fine-tuned policies saved to
    ``<sft.output_dir>/model``.  Returns that folder.

    The output folder is claimed as a training run's is (:mod:`srpo.runs.run_dir`): locked while this
    runs, refused when it holds another fine-tuning's output unless ``overwrite`` (which deletes
    exactly what srpo sft wrote there) or ``resume`` (which continues from its newest checkpoint),
    never written through a link srpo did not make."""
    from srpo.runs import run_dir as run_folder

    check_sft_config(cfg)
    out = Path(cfg.sft.output_dir)
    with run_folder.RunLock(out):
        if not resume:
            deleted = run_folder.claim(out, sft_artefacts(cfg), overwrite=overwrite,
                                       resume_hint=" (or continue it with --resume)")
            if deleted:
                log.warning("--overwrite: deleted the previous fine-tuning's %s in %s", ", ".join(deleted), out)
        return _run_sft(cfg, out, progress, resume)


def _run_sft(cfg: Config, out: Path, progress: bool, resume: bool) -> Path:
    from srpo.registry import import_object
    from srpo.train.supervised import SupervisedTrainer

    s = cfg.sft
    team = build.team(cfg)
    tokenizer = team.policies.tokenizer
    if s.data:
        episodes = read_transcripts(s.data)
        stats: dict[str, float] = {"episodes": len(episodes), "kept": len(episodes)}
    elif resume and (out / "transcripts.jsonl").is_file():  # the scripted transcripts the run trained on
        episodes = read_transcripts(out / "transcripts.jsonl")
        stats = {"episodes": len(episodes), "kept": len(episodes)}
    else:
        script = import_object(s.script)
        episodes, stats = scripted_transcripts(cfg, script, s.episodes, s.min_reward, tokenizer, progress)
        if not episodes:
            raise DatasetError(f"{s.script}: none of {s.episodes} scripted episodes reached reward {s.min_reward} "
                               f"(mean reward {stats['mean_reward']:.3f}); check the script")
        write_text_atomic(out / "transcripts.jsonl", "".join(json.dumps(e) + "\n" for e in episodes))
    counts: dict[str, int] = {}
    examples = examples_from(episodes, team.role_specs, tokenizer,
                             max_tokens=s.max_turn_tokens or context_length(team.policies), long_turns=s.long_turns,
                             counts=counts)
    if not examples:
        raise DatasetError(f"no turn to train on: {counts.get('long_turns_skipped', 0)} were longer than "
                           f"{s.max_turn_tokens or context_length(team.policies)} tokens (sft.max_turn_tokens)")
    trainer = SupervisedTrainer(cfg, examples, team.policies, out, artefacts=sft_artefacts(cfg), progress=progress)
    if resume and not trainer.resume():
        log.warning("--resume: no checkpoint in %s; the fine-tuning starts at step 0", out / "checkpoints")
    trainer.fit()  # raises Preempted after a checkpoint on SIGTERM/SIGUSR1 (srpo sft --resume continues)
    trainer.save_model(out / "model")
    if trainer.backend.rank == 0:
        from srpo.runs.metrics_log import read_metrics

        losses = [row["loss"] for row in read_metrics(out) if "loss" in row]
        summary = {**stats, **counts, "examples": len(examples), "steps": trainer.step,
                   "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
                   "by_role": {r: sum(1 for e in examples if e.role == r) for r in sorted({e.role for e in examples})}}
        write_text_atomic(out / "sft.json", json.dumps(summary, indent=1))
        write_text_atomic(out / "config.json", json.dumps(redacted(cfg.to_dict()), indent=1, default=str))
    return out / "model"
