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
    check_kind_fits(tasks, kind, src.source)
    return [Task(t.task_id, t.question, t.answers, t.kind, name, t.meta) for t in tasks]


# ------------------------------------------------------------------ which grader fits a dataset

_MATH_MARKS = set("0123456789\\^_{}$=+-*/<>()[]|.,:;!%")


def _worked_solution(gold: str) -> bool:
    """A GSM8K-style solution (``#### N``) or a long derivation: not a QA answer."""
    return "####" in gold or len(gold.split()) > 30


def _prose(gold: str) -> bool:
    """Words without a digit or a math mark, e.g. 'Kauffman Stadium': not a math answer."""
    letters = sum(c.isalpha() for c in gold)
    return letters >= 2 and not any(c in _MATH_MARKS for c in gold)


def check_kind_fits(tasks: list[Task], kind: str, source: str, sample: int = 200) -> None:
    """Refuse a dataset whose gold answers do not fit ``kind``'s grader.

    Graded by the wrong kind, a dataset scores silently wrong: a QA set under the math grader
    compares text answers as math, GSM8K under the QA grader takes the whole worked solution as
    the gold answer and everything scores 0.  Decided on the majority of the first ``sample``
    tasks, so a few odd answers (MATH's word answers) do not trip it.
    """
    golds = [t.answers[0] for t in tasks[:sample] if t.answers]
    if not golds:
        return
    if kind == "qa":
        bad = [g for g in golds if _worked_solution(g)]
        if 2 * len(bad) > len(golds):
            raise DatasetError(
                f"{source}: looks like a math dataset, not QA — {len(bad)} of the first {len(golds)} answers are "
                f"worked solutions (e.g. {_short(bad[0])!r}); use task.kind: math (srpo eval: --kind math)")
    else:
        bad = [g for g in golds if _prose(g)]
        if 2 * len(bad) > len(golds):
            raise DatasetError(
                f"{source}: looks like a QA dataset, not math — {len(bad)} of the first {len(golds)} gold answers are "
                f"plain words (e.g. {_short(bad[0])!r}); use task.kind: qa (srpo eval: --kind qa)")


def _short(text: str, n: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def guess_kind(src: DataSource) -> str | None:
    """``math`` or ``qa`` from a data file's rows (None for synthetic or hub sources)."""
    if src.source == "synthetic_arithmetic":
        return "math"
    if src.source == "synthetic_kb":
        return "qa"
    if src.source.startswith("hub:"):
        return None
    from srpo.tasks.base import read_rows

    rename = {theirs: ours for ours, theirs in src.fields.items()}
    rows = []
    for _, row in read_rows(src.source):
        rows.append({rename.get(k, k): v for k, v in row.items()})
        if len(rows) >= 50:
            break
    if any(k in rows[0] for k in ("golden_answers", "answers", "question_text", "answers_objects")):
        return "qa"
    if "problem" in rows[0]:
        return "math"
    answers = [str(r.get("answer", "")) for r in rows if r.get("answer") is not None]
    if answers and 2 * sum(_prose(a) for a in answers) > len(answers):
        return "qa"
    return "math"


def build_retriever(cfg: Config):
    """A client of ``retriever.url``, or BM25 over the configured corpus (``synthetic_kb`` joins the
    KBs of every synthetic source); None when the run retrieves nothing."""
    if cfg.retriever.url:
        from srpo.tasks.retrieval_service import HTTPRetriever

        return HTTPRetriever(cfg.retriever.url, timeout_s=cfg.retriever.timeout_s, retries=cfg.retriever.retries)
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


def corpus_passages(spec: str) -> list[Passage]:
    """A corpus jsonl, or ``synthetic_kb:n=40:seed=0`` (the synthetic KB's passages)."""
    if spec.startswith("synthetic_kb"):
        params = dict(p.partition("=")[::2] for p in spec.split(":")[1:])
        unknown = set(params) - {"n", "seed"}
        if unknown:
            raise DatasetError(f"{spec}: unknown parameter {sorted(unknown)[0]!r}; valid: n, seed")
        try:
            return synthetic_kb(int(params.get("n", 40)), seed=int(params.get("seed", 0)))[0]
        except ValueError:
            raise DatasetError(f"{spec}: n and seed must be integers") from None
    return load_corpus(spec)
