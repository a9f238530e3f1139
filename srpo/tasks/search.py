"""Search tasks: a retriever protocol with BM25 behind it, QA loaders, EM/F1, a synthetic KB.

The retriever is a protocol (``search(query, k) -> list[Passage]``) so that a dense or remote
retriever can replace BM25 without touching workflows.  The synthetic knowledge base invents
entities (names built from random syllables) whose facts exist only in its own corpus, so a
model cannot answer from memory: it has to search.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from srpo.tasks.base import Task, load_jsonl_rows, read_jsonl, require_text
from srpo.tasks.splits import in_split


@dataclass(frozen=True)
class Passage:
    pid: str
    title: str
    text: str

    def render(self) -> str:
        return f"{self.title}: {self.text}" if self.title else self.text


class Retriever(Protocol):
    def search(self, query: str, k: int) -> list[Passage]: ...


class BM25Retriever:
    """Lexical retrieval over passages with ``bm25s`` (title + text, English stopwords)."""

    def __init__(self, passages: Sequence[Passage], *, k1: float = 0.9, b: float = 0.4):
        import bm25s

        if not passages:
            raise ValueError("a BM25 index needs at least one passage")
        self.passages = list(passages)
        self._bm25s = bm25s
        self.index = bm25s.BM25(k1=k1, b=b)
        tokens = bm25s.tokenize([f"{p.title}\n{p.text}" for p in self.passages], stopwords="en", show_progress=False)
        self.index.index(tokens, show_progress=False)

    def search(self, query: str, k: int = 3) -> list[Passage]:
        return self.search_many([query], k)[0]

    def search_many(self, queries: Sequence[str], k: int = 3) -> list[list[Passage]]:
        """Top-k passages for each query, best first (an empty query returns nothing)."""
        return [[p for p, _ in row] for row in self.search_many_scored(queries, k)]

    def search_many_scored(self, queries: Sequence[str], k: int = 3) -> list[list[tuple[Passage, float]]]:
        """Top-k ``(passage, BM25 score)`` for each query, best first; passages scoring 0 are left out."""
        k = min(k, len(self.passages))
        tokens = self._bm25s.tokenize(list(queries), stopwords="en", show_progress=False, allow_empty=True)
        docs, scores = self.index.retrieve(tokens, k=k, show_progress=False)
        return [[(self.passages[int(d)], float(s)) for d, s in zip(row_docs, row_scores) if s > 0]
                for row_docs, row_scores in zip(docs, scores)]


def load_corpus(path: str | Path) -> list[Passage]:
    """jsonl with ``text`` (or ``contents``/``paragraph_text``) and optional ``id`` and ``title``."""
    passages = []
    for line_no, row in read_jsonl(path):
        try:
            _, text = require_text(row, "text", "contents", "paragraph_text")
        except (KeyError, ValueError) as err:
            from srpo.tasks.base import DatasetError

            raise DatasetError(f"{path}, line {line_no}: {err.args[0]}") from None
        passages.append(Passage(str(row.get("id", line_no)), str(row.get("title", "")), text))
    return passages


# ---------------------------------------------------------------------------------- EM and F1


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in golds))


def token_f1(prediction: str, golds: Sequence[str]) -> float:
    """Best token-level F1 over the gold answers."""
    best = 0.0
    pred = normalize_answer(prediction).split()
    for g in golds:
        gold = normalize_answer(g).split()
        common = Counter(pred) & Counter(gold)
        same = sum(common.values())
        if same == 0:
            continue
        precision, recall = same / len(pred), same / len(gold)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


_ANSWER_TAG = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL)


def extract_tagged_answer(text: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` (an unclosed final tag counts)."""
    found = _ANSWER_TAG.findall(text or "")
    return found[-1].strip() if found else None


def answer_text(text: str) -> str:
    """What a QA reply answers: its tagged ``<answer>`` content, or the whole text when untagged."""
    answer = extract_tagged_answer(text)
    return answer if answer is not None else (text or "")


def grade_qa(text: str, golds: Sequence[str]) -> float:
    """EM of the tagged answer (or of the whole text when untagged) against the gold answers."""
    return exact_match(answer_text(text), golds)


# ------------------------------------------------------------------------------------- loaders


def load_qa(path: str | Path, *, skip_bad_rows: bool = False, limit: int | None = None, rows=None):
    """QA jsonl with ``question`` and gold ``answers`` (list) — also ``golden_answers`` (list),
    ``answer`` (str), or IRCoT's ``question_text`` + ``answers_objects[0].spans``."""
    name = Path(path).stem

    def make(line_no: int, row: dict) -> Task:
        _, question = require_text(row, "question", "question_text")
        golds = _gold_answers(row)
        meta = {}
        if "contexts" in row:
            meta["supporting_titles"] = [c["title"] for c in row["contexts"] if c.get("is_supporting")]
        tid = str(row.get("question_id", row.get("id", row.get("idx", line_no))))
        return Task(f"{name}-{tid}", question, golds, "qa", name, meta)

    return load_jsonl_rows(path, make, skip_bad_rows=skip_bad_rows, limit=limit, rows=rows)


def _gold_answers(row: dict) -> tuple[str, ...]:
    for name in ("answers", "golden_answers"):
        if name in row:
            values = row[name]
            if not isinstance(values, list) or not values or not all(isinstance(v, str) and v.strip() for v in values):
                raise ValueError(f"field {name!r} must be a non-empty list of non-empty strings")
            return tuple(values)
    if "answers_objects" in row:
        spans = [s for obj in row["answers_objects"] for s in obj.get("spans", []) if isinstance(s, str) and s.strip()]
        if not spans:
            raise ValueError("field 'answers_objects' holds no answer span")
        return tuple(spans)
    _, answer = require_text(row, "answer")
    return (answer,)


# ------------------------------------------------------------------------- synthetic knowledge base

_SYLLABLES = ["ka", "lo", "vi", "dra", "mon", "ter", "sil", "qua", "bex", "nor", "zel", "ith", "gar", "pum",
              "ros", "fen", "tul", "mar", "ov", "esk", "yr", "dal", "wen", "cor"]
_OCCUPATIONS = ["sculptor", "astronomer", "violinist", "cartographer", "botanist", "architect", "chemist", "poet"]


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


def synthetic_kb(n_people: int = 40, *, seed: int = 0, n_cities: int | None = None, split: str = "all"):
    """A fictional knowledge base → ``(passages, tasks)``.

    People have a birthplace and an occupation; cities have a country and a founding year.
    Questions are one-hop ("In which city was X born?", "What is X's occupation?") or two-hop
    ("In which country was X born?" needs X → city → country); every answer lives only in the
    corpus.  Deterministic for a seed.  ``split`` (:mod:`srpo.tasks.splits`): people's family names
    come only from that part of the name space, so a ``test`` KB never asks about a person a
    ``train`` KB holds, whatever the seeds; ``all`` draws as before parts existed.
    """
    rng = random.Random(f"kb-{seed}")
    n_cities = n_cities or min(200, max(4, n_people // 4))
    used: set[str] = set()

    def fresh(parts, part="all"):
        # Names are unique across the KB; the space is finite (24^parts), so give up loudly
        # rather than loop forever when a KB asks for more names than it holds.
        for _ in range(10_000):
            name = _name(rng, parts)
            if name not in used and in_split(f"kb-family:{name}", part):
                used.add(name)
                return name
        raise ValueError(f"synthetic_kb: ran out of {parts}-syllable names (n_people={n_people}, "
                         f"n_cities={n_cities}); use fewer")

    countries = [fresh(3) + "ia" for _ in range(max(3, n_cities // 3))]
    cities = {fresh(2): (rng.choice(countries), rng.randint(900, 1900)) for _ in range(n_cities)}
    passages, tasks = [], []
    for c, (country, year) in cities.items():
        passages.append(Passage(f"city-{c}", c, f"{c} is a city in {country}, founded in {year}."))
    city_names = list(cities)
    for i in range(n_people):
        # A 2-syllable given name (may repeat, like real ones, but never a place name) and a unique
        # 3-syllable family name: up to thousands of distinct people.
        given = _name(rng, 2)
        while given in cities:
            given = _name(rng, 2)
        person = f"{given} {fresh(3, split)}"
        city, job = rng.choice(city_names), rng.choice(_OCCUPATIONS)
        article = "an" if job[0] in "aeiou" else "a"
        passages.append(Passage(f"person-{i}", person, f"{person} is {article} {job} who was born in {city}."))
        kind = i % 3
        if kind == 0:
            q, a, hops = f"In which city was {person} born?", city, 1
        elif kind == 1:
            q, a, hops = f"What is the occupation of {person}?", job, 1
        else:
            q, a, hops = f"In which country was {person} born?", cities[city][0], 2
        tasks.append(Task(f"kb{'' if split == 'all' else '-' + split}-s{seed}-{i}", q, (a,), "qa", "synthetic-kb", {"hops": hops, "person": person}))
    rng.shuffle(passages)
    return passages, tasks
