"""Task sets and corpora from the config: synthetic generators, files (jsonl/parquet), hub ids."""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path
from typing import Any

from srpo.config import DataSource
from srpo.tasks.base import DatasetError, Task, UnreadableRow
from srpo.tasks.kinds import TASK_KINDS, synthetic_source
from srpo.tasks.kinds import task_kind as get_kind
from srpo.tasks.search import BM25Retriever, Passage, load_corpus, synthetic_kb
from srpo.tasks.splits import resolve_split

log = logging.getLogger(__name__)


def epoch_order(num_tasks: int, seed: int, epoch: int) -> list[int]:
    """The order in which a training run visits its ``num_tasks`` tasks in ``epoch`` (seeded)."""
    order = list(range(num_tasks))
    random.Random(f"{seed}-{epoch}").shuffle(order)
    return order


class DataCursor:
    """Where a training run is in its data: the epoch, the position in that epoch's seeded order.

    Each step takes the global step's tasks (:meth:`take`) and deals them round-robin to ranks, so
    every rank advances the same cursor and none looks at another's share."""

    def __init__(self, tasks: list, seed: int):
        self.tasks, self.seed = tasks, seed
        self.epoch, self.pos = 0, 0
        self.order = epoch_order(len(tasks), seed, 0)

    def take(self, n: int, rank: int = 0, world: int = 1) -> list:
        """This rank's share of the next ``n`` tasks (a new epoch, reshuffled, when one runs out)."""
        picked = []
        for _ in range(n):
            if self.pos >= len(self.order):
                self.epoch, self.pos = self.epoch + 1, 0
                self.order = epoch_order(len(self.tasks), self.seed, self.epoch)
            picked.append(self.tasks[self.order[self.pos]])
            self.pos += 1
        return picked[rank::world]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "order": list(self.order)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at a recorded position; on data with another row count (a resume with
        ``--allow-data-change``) a new epoch starts over the new rows (said once)."""
        self.epoch, self.pos, self.order = state["epoch"], state["pos"], list(state["order"])
        if len(self.order) != len(self.tasks):
            self.epoch, self.pos = self.epoch + 1, 0
            self.order = epoch_order(len(self.tasks), self.seed, self.epoch)
            log.warning("the training data now has %d rows: a new epoch starts over them", len(self.tasks))


def source_name(src: DataSource) -> str:
    if src.name:
        return src.name
    if src.source == "synthetic_arithmetic":
        return f"arith-L{src.level}-s{src.seed}"
    if src.source == "synthetic_kb":
        return f"kb-s{src.seed}"
    return Path(src.source.removeprefix("hub:")).stem


def synthetic_source_for(src: DataSource, *, held_out: bool) -> DataSource:
    """``src`` with its ``split`` resolved: a synthetic source's own, else ``test`` for a held-out
    set and ``train`` for the training set (:mod:`srpo.tasks.splits`)."""
    return src.model_copy(update={"split": resolve_split(src.split, held_out=held_out)})


def generate(src: DataSource, *, held_out: bool) -> tuple[list[Task], list[Passage]]:
    """The tasks and passages of the synthetic source ``src``, from its part of the problem space."""
    return synthetic_source(src.source).synthetic[src.source](synthetic_source_for(src, held_out=held_out))


def _hub_rows(src: DataSource):
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{src.source}: hub datasets need the 'datasets' package "
                           "(pip install 'srpo[hub]')") from None
    dataset_id = src.source.removeprefix("hub:")
    try:
        ds = datasets.load_dataset(dataset_id, src.config or None, split=src.split or "train")
    except ValueError as err:
        if "config" in str(err).lower() and not src.config:
            raise DatasetError(f"{src.source}: the dataset has several configurations; name one with "
                               f"'config:' in this data source ({err})") from None
        raise DatasetError(f"{src.source}: {err}") from None
    except (OSError, ConnectionError) as err:  # offline, unknown id, no access
        raise DatasetError(f"{src.source}: could not load it ({type(err).__name__}: {err})") from None
    return iter(enumerate(ds, start=1))


_PATH_STEP = re.compile(r"([^.\[\]]+)|\[(-?\d+)\]")


def field_path(path: str) -> list[str | int]:
    """``"prompt[-1].content"`` → ``["prompt", -1, "content"]`` (a ValueError names a bad path)."""
    steps: list[str | int] = []
    pos = 0
    for m in _PATH_STEP.finditer(path):
        gap = path[pos:m.start()]
        if gap not in ("", ".") or (gap == "." and not steps):
            break
        steps.append(m.group(1) if m.group(1) is not None else int(m.group(2)))
        pos = m.end()
    if not steps or pos != len(path):
        raise ValueError(f"field path {path!r} is not valid: use keys joined by '.' and list items as [i]")
    return steps


def field_value(row: dict, path: str):
    """The value at ``path`` in ``row``; a KeyError names the path and the step that is missing."""
    value: Any = row
    for i, step in enumerate(field_path(path)):
        where = path if i == 0 else f"{path} (at {step!r})"
        if isinstance(step, int):
            if not isinstance(value, (list, tuple)) or not -len(value) <= step < len(value):
                raise KeyError(f"{where} missing: no item [{step}]")
            value = value[step]
        else:
            if not isinstance(value, dict) or step not in value or value[step] is None:
                raise KeyError(f"{where} missing")
            value = value[step]
    return value


_LOADER_ALIASES = {"question": ("problem", "question_text"),
                   "answer": ("answers", "golden_answers", "answers_objects")}


def map_fields(rows, fields: dict[str, str]):
    """Rows with our fields taken from the dataset's columns or paths (``DataSource.fields``).

    A plain column is renamed (the dataset's name no longer appears, so a loader that looks for
    it first does not pick the unmapped value); a row missing a path becomes an
    :class:`~srpo.tasks.base.UnreadableRow` the loader reports (or skips and counts) by row.
    """
    for theirs in fields.values():
        field_path(theirs)  # a malformed path fails here, once, before any row is read
    plain = {theirs for theirs in fields.values() if "." not in theirs and "[" not in theirs}
    # A mapped field replaces every column the built-in loaders read in its place (MATH's
    # ``problem`` is read before ``question``): the user's mapping must win.
    plain |= {alias for ours in fields for alias in _LOADER_ALIASES.get(ours, ())}

    def mapped():
        for n, row in rows:
            out = {k: v for k, v in row.items() if k not in plain}
            try:
                for ours, theirs in fields.items():
                    out[ours] = field_value(row, theirs)
            except KeyError as err:
                yield n, UnreadableRow(err.args[0])
                continue
            yield n, out

    return mapped()


def load_tasks(src: DataSource, kind: str, *, held_out: bool) -> list[Task]:
    """The tasks of one data source for the task kind ``kind`` (a registered name or import
    path); rows are validated (bad rows fail, or are skipped and counted).  ``held_out``: the
    source is an evaluation set (a synthetic one then draws from its test part by default)."""
    task_kind = get_kind(kind)
    generator = synthetic_source(src.source)
    if generator is not None:
        if generator.name != task_kind.name:
            raise DatasetError(f"{src.source} is a {generator.name} source but task.kind is {task_kind.name!r}")
        return generate(src, held_out=held_out)[0]
    rows = _hub_rows(src) if src.source.startswith("hub:") else None
    if src.fields:
        from srpo.tasks.base import read_rows

        try:
            rows = map_fields(rows or read_rows(src.source), src.fields)
        except ValueError as err:
            raise DatasetError(f"{src.source}: {err}") from None
    tasks, _ = task_kind.load_file(src.source, skip_bad_rows=src.skip_bad_rows, limit=src.n or None, rows=rows)
    tasks = unique_ids(tasks, src)
    name = source_name(src)
    if task_kind.check_fits is not None:
        task_kind.check_fits(tasks, src.source)
    return [Task(t.task_id, t.question, t.answers, t.kind, name, t.meta) for t in tasks]


def unique_ids(tasks: list[Task], src: DataSource) -> list[Task]:
    """Tasks whose ids name one question each (``src.duplicate_ids``).  An id is what groups a
    question's episodes for its advantages: two questions under one id would be compared with
    each other.  Rows repeating the same question under its id are left alone (one question)."""
    first: dict[str, Task] = {}
    out = []
    for t in tasks:
        seen = first.setdefault(t.task_id, t)
        if seen is t or seen.question == t.question:
            out.append(t)
            continue
        where = f"lines {seen.meta.get('line', '?')} and {t.meta.get('line', '?')}"
        if src.duplicate_ids == "refuse":
            raise DatasetError(f"{src.source}: id {t.task_id!r} names two different questions ({where}); make the ids "
                               f"unique, or set duplicate_ids: rename on this data source")
        new_id = f"{t.task_id}#{t.meta.get('line', len(out) + 1)}"
        log.warning("%s: id %r names two different questions (%s): the later one is now %r (duplicate_ids: refuse "
                    "stops instead)", src.source, t.task_id, where, new_id)
        out.append(Task(new_id, t.question, t.answers, t.kind, t.source, t.meta))
        first.setdefault(new_id, out[-1])
    return out


def guess_kind(src: DataSource) -> str | None:
    """The registered task kind a source's rows look like (None for hub sources, or when no
    kind recognizes them)."""
    generator = synthetic_source(src.source)
    if generator is not None:
        return generator.name
    if src.source.startswith("hub:"):
        return None
    from srpo.tasks.base import read_rows

    rows = []
    for _, row in map_fields(read_rows(src.source), src.fields):
        rows.append(row)
        if len(rows) >= 50:
            break
    for name in TASK_KINDS.names():
        if TASK_KINDS[name].recognizes is not None and TASK_KINDS[name].recognizes(rows):
            return name
    return None


def eval_retriever(src: DataSource) -> BM25Retriever | None:
    """BM25 over a held-out set's own ``corpus`` (``synthetic_kb``: the passages of this source's
    own KB); None when the set searches the run's corpus."""
    if not src.corpus:
        return None
    if synthetic_source(src.corpus) is not None:
        return BM25Retriever(generate(src, held_out=True)[1])
    return BM25Retriever(load_corpus(src.corpus))


def corpus_passages(spec: str) -> list[Passage]:
    """A corpus jsonl, or ``synthetic_kb:n=40:seed=0[:split=train]`` (the synthetic KB's passages;
    split as a data source's, default ``all``)."""
    if spec.startswith("synthetic_kb"):
        params = dict(p.partition("=")[::2] for p in spec.split(":")[1:])
        unknown = set(params) - {"n", "seed", "split"}
        if unknown:
            raise DatasetError(f"{spec}: unknown parameter {sorted(unknown)[0]!r}; valid: n, seed, split")
        try:
            return synthetic_kb(int(params.get("n", 40)), seed=int(params.get("seed", 0)),
                                split=params.get("split", "all"))[0]
        except ValueError as err:
            raise DatasetError(f"{spec}: {err}" if "split" in str(err) else f"{spec}: n and seed must be integers") from None
    return load_corpus(spec)


def fingerprint(tasks: list[Task], src: DataSource) -> dict[str, Any]:
    """What identifies a data source's content: its row count, a SHA-256 over the loaded tasks (id,
    question, answers, in order) and, for a file, its size — recorded in every checkpoint so that
    ``--resume`` can tell when the data changed under the same path."""
    import hashlib
    import json as _json

    digest = hashlib.sha256()
    for t in tasks:
        digest.update(_json.dumps([t.task_id, t.question, list(t.answers)]).encode())
        digest.update(b"\n")
    out: dict[str, Any] = {"source": src.source, "rows": len(tasks), "sha256": digest.hexdigest()}
    path = Path(src.source)
    if not src.source.startswith("hub:") and path.is_file():
        out["bytes"] = path.stat().st_size
    return out


def fingerprint_changes(recorded: dict[str, dict], now: dict[str, dict]) -> list[str]:
    """One line per data source (of those both fingerprints hold) that differs (empty: the same data)."""
    lines = []
    # Only sources both runs loaded: a held-out set evaluated now but not then (eval.every changed)
    # is not a change of data.
    for key in sorted(set(recorded) & set(now)):
        a, b = recorded[key], now[key]
        if a == b:
            continue
        what = []
        if a.get("source") != b.get("source"):
            what.append(f"source {a.get('source')} → {b.get('source')}")
        if a.get("rows") != b.get("rows"):
            what.append(f"{a.get('rows')} → {b.get('rows')} rows")
        if a.get("bytes") != b.get("bytes") and "bytes" in a and "bytes" in b:
            what.append(f"{a['bytes']} → {b['bytes']} bytes")
        if a.get("sha256") != b.get("sha256"):
            what.append("other content" + (" (same row count)" if a.get("rows") == b.get("rows") else ""))
        lines.append(f"{key} ({b.get('source')}): {', '.join(what)}")
    return lines
