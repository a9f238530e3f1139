"""Task sets and corpora from the config: synthetic generators, files (jsonl/parquet), hub ids."""

from __future__ import annotations

import random
from pathlib import Path

from srpo.config import Config, DataSource
from srpo.tasks.base import DatasetError, Task
from srpo.tasks.math import load_math_file, synthetic_arithmetic
from srpo.tasks.search import BM25Retriever, Passage, load_corpus, load_qa, synthetic_kb


def epoch_order(num_tasks: int, seed: int, epoch: int) -> list[int]:
    """The order in which a training run visits its ``num_tasks`` tasks in ``epoch`` (seeded)."""
    order = list(range(num_tasks))
    random.Random(f"{seed}-{epoch}").shuffle(order)
    return order


def source_name(src: DataSource) -> str:
    if src.name:
        return src.name
    if src.source == "synthetic_arithmetic":
        return f"arith-L{src.level}-s{src.seed}"
    if src.source == "synthetic_kb":
        return f"kb-s{src.seed}"
    return Path(src.source.removeprefix("hub:")).stem


def _hub_rows(src: DataSource):
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{src.source}: hub datasets need the 'datasets' package (pip install datasets)") from None
    ds = datasets.load_dataset(src.source.removeprefix("hub:"), split=src.split)
    return iter(enumerate(ds, start=1))


def load_tasks(src: DataSource, kind: str) -> list[Task]:
    """The tasks of one data source (validated; bad rows fail or are skipped and counted)."""
    limit = src.n or None
    if src.source == "synthetic_arithmetic":
        return synthetic_arithmetic(src.n, level=src.level, seed=src.seed, prefix="arith")
    if src.source == "synthetic_kb":
        return synthetic_kb(src.n, seed=src.seed)[1]
    rows = _hub_rows(src) if src.source.startswith("hub:") else None
    if src.fields:
        from srpo.tasks.base import read_rows

        rename = {theirs: ours for ours, theirs in src.fields.items()}
        rows = ((n, {rename.get(k, k): v for k, v in row.items()}) for n, row in (rows or read_rows(src.source)))
    loader = load_math_file if kind == "math" else load_qa
    tasks, _ = loader(src.source, skip_bad_rows=src.skip_bad_rows, limit=limit, rows=rows)
    name = source_name(src)
    return [Task(t.task_id, t.question, t.answers, t.kind, name, t.meta) for t in tasks]


def build_retriever(cfg: Config) -> BM25Retriever | None:
    """BM25 over the configured corpus; ``synthetic_kb`` joins the KBs of every synthetic source."""
    if not cfg.task.corpus:
        return None
    if cfg.task.corpus == "synthetic_kb":
        passages: list[Passage] = []
        for src in [cfg.task.train, *cfg.task.eval]:
            if src.source == "synthetic_kb":
                passages += synthetic_kb(src.n, seed=src.seed)[0]
        if not passages:
            raise DatasetError("task.corpus is synthetic_kb but no data source is synthetic_kb")
        return BM25Retriever(passages)
    return BM25Retriever(load_corpus(cfg.task.corpus))
