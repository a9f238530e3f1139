"""Tasks: loaders, extraction, grading, retrieval, EM/F1, metrics, real data files."""

import json
import os
import time
from math import comb
from pathlib import Path

import pytest

from srpo.tasks import DatasetError, avg_at_k, macro_average, pass_at_k
from srpo.tasks.math import (
    LEVELS,
    answers_equivalent,
    extract_answer,
    grade_math,
    load_gsm8k,
    load_math,
    synthetic_arithmetic,
)
from srpo.tasks.search import (
    BM25Retriever,
    exact_match,
    grade_qa,
    load_corpus,
    load_qa,
    normalize_answer,
    synthetic_kb,
    token_f1,
)
from srpo.tasks.splits import part_of

def _shared_data() -> Path:
    """../shared/data next to the checkout, $SRPO_SHARED_DATA, or this workplace's /work/shared/data."""
    for candidate in (os.environ.get("SRPO_SHARED_DATA"), Path(__file__).resolve().parents[3] / "shared" / "data",
                      "/work/shared/data"):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return Path("../shared/data")


DATA = _shared_data()
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data is not present")

EQUIVALENT = [
    ("\\frac{1}{2}", "0.5"), ("0.5", "\\frac{1}{2}"), ("1,000", "1000"), ("1000", "1,000"),
    ("$18", "18"), ("18.00", "18"), ("\\dfrac{3}{4}", "\\frac{3}{4}"), ("3/4", "\\frac{3}{4}"),
    ("5 \\text{ cm}", "5"), ("\\$1,234.50", "1234.5"), ("-7", "-7"), ("50\\%", "50"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\frac{\\pi}{2})"), ("\\sqrt{8}", "2\\sqrt{2}"),
    ("x = 4", "4"), ("10^{2}", "100"),
]
NOT_EQUIVALENT = [
    ("7", "8"), ("0.5", "5"), ("1,001", "1000"), ("\\frac{1}{3}", "0.33"), ("x^2", "x^3"),
    ("", "3"), ("(3, \\pi)", "(3, \\frac{\\pi}{2})"), ("-7", "7"), ("12", "1,2"),
]


@pytest.mark.parametrize("pred, gold", EQUIVALENT)
def test_equivalent_answers(pred, gold):
    assert answers_equivalent(pred, gold)


@pytest.mark.parametrize("pred, gold", NOT_EQUIVALENT)
def test_non_equivalent_answers(pred, gold):
    assert not answers_equivalent(pred, gold)


@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{\\frac{1}{\\sqrt{2}}} is it", "\\frac{1}{\\sqrt{2}}"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("work...\n#### 1,234\n", "1,234"),
    ("The answer is 42.", "42"),
    ("3 apples and 4 pears make 7", "7"),
    ("no number here", None),
    ("\\boxed{unbalanced", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_grading_never_hangs():
    nasty = [
        "\\boxed{" + "9" * 5000 + "}",
        "\\boxed{" + "{" * 400 + "1" + "}" * 400 + "}",
        "\\boxed{" + "\\frac{" * 60 + "1" + "}{2}" * 60 + "}",
        "\\boxed{" + "x^" * 300 + "2}",
        "\\boxed{" + "(" * 2000 + "}",
        "The answer is " + "1+" * 3000 + "1",
    ]
    for text in nasty:
        start = time.perf_counter()
        assert grade_math(text, "2") == 0.0
        assert time.perf_counter() - start < 6.0, text[:40]


def test_synthetic_arithmetic_is_reproducible_and_correct():
    for level in range(0, 6):
        a = synthetic_arithmetic(20, level=level, seed=4)
        assert a == synthetic_arithmetic(20, level=level, seed=4)
        assert a != synthetic_arithmetic(20, level=level, seed=5)
        for t in a:  # the gold answer is the value of the printed expression
            expr = t.question.removeprefix("What is ").removesuffix("?")
            tokens = expr.replace("(", " ( ").replace(")", " ) ").split()
            assert _evaluate(tokens) == int(t.answers[0])
    with pytest.raises(ValueError, match="valid"):
        synthetic_arithmetic(1, level=9)


def _evaluate(tokens):
    """A tiny shunting-yard evaluator for + - * and parentheses (no eval of text)."""
    prec = {"+": 1, "-": 1, "*": 2}
    out, ops = [], []

    def apply():
        op, b, a = ops.pop(), out.pop(), out.pop()
        out.append(a + b if op == "+" else a - b if op == "-" else a * b)

    for tok in tokens:
        if tok.isdigit():
            out.append(int(tok))
        elif tok == "(":
            ops.append(tok)
        elif tok == ")":
            while ops[-1] != "(":
                apply()
            ops.pop()
        else:
            while ops and ops[-1] != "(" and prec[ops[-1]] >= prec[tok]:
                apply()
            ops.append(tok)
    while ops:
        apply()
    return out[0]


# ------------------------------------------------------------------------------ search and QA

def test_bm25_finds_the_passage_holding_a_synthetic_fact():
    passages, tasks = synthetic_kb(60, seed=0)
    retriever = BM25Retriever(passages)
    for t in tasks:
        top = retriever.search(t.question, 1)
        assert top and top[0].title == t.meta["person"], t.question
        if t.meta["hops"] == 1:
            assert t.answers[0] in top[0].text


def test_synthetic_kb_answers_live_only_in_its_corpus():
    passages, tasks = synthetic_kb(30, seed=1)
    corpus = " ".join(p.text for p in passages)
    for t in tasks:
        assert t.answers[0] in corpus
    assert synthetic_kb(30, seed=1)[1] == tasks
    assert {t.meta["hops"] for t in tasks} == {1, 2}


def test_synthetic_kb_scales_to_thousands_of_people_and_refuses_the_impossible():
    # 300 people once needed 600 distinct 2-syllable names out of 576 and looped forever.
    passages, tasks = synthetic_kb(3000, seed=0)
    people = [t.meta["person"] for t in tasks]
    assert len(tasks) == 3000 and len(set(people)) == 3000
    assert len({p.title for p in passages}) == len(passages)
    with pytest.raises(ValueError, match="ran out of 2-syllable names"):
        synthetic_kb(10, seed=0, n_cities=600)


def test_em_and_f1_hand_computed():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert exact_match("the Chief of Protocol", ["Chief of Protocol"]) == 1.0
    assert exact_match("Chief Protocol", ["Chief of Protocol"]) == 0.0
    # pred {chief, protocol} vs gold {chief, of, protocol}: P = 2/2, R = 2/3, F1 = 0.8
    assert token_f1("Chief Protocol", ["Chief of Protocol"]) == pytest.approx(0.8)
    # pred {new, york, city} vs gold {york}: P = 1/3, R = 1, F1 = 0.5; best over golds
    assert token_f1("New York City", ["York", "Boston"]) == pytest.approx(0.5)
    assert token_f1("Paris", ["London"]) == 0.0
    assert grade_qa("I think <answer>Paris</answer>", ["paris"]) == 1.0
    assert grade_qa("Paris", ["paris"]) == 1.0
    assert grade_qa("<answer>Lyon</answer>", ["paris"]) == 0.0


@pytest.mark.parametrize("n, c, k", [(5, 2, 1), (5, 2, 3), (10, 0, 4), (4, 4, 2), (16, 3, 16), (7, 1, 2)])
def test_pass_at_k_matches_closed_form(n, c, k):
    expected = 1 - comb(n - c, k) / comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_small_cases_and_averages():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # = c / n
    assert pass_at_k(2, 1, 2) == 1.0
    assert pass_at_k(3, 0, 2) == 0.0
    assert avg_at_k([1, 0, 0, 1]) == 0.5
    assert macro_average({"a": 0.2, "b": 0.6}) == pytest.approx(0.4)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


# ----------------------------------------------------------------------------- loader errors

def write(tmp_path, name, lines):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


def test_loader_errors_name_file_row_and_field(tmp_path):
    with pytest.raises(DatasetError, match="no such dataset file"):
        load_gsm8k(tmp_path / "missing.jsonl")
    empty = write(tmp_path, "empty.jsonl", [""])
    with pytest.raises(DatasetError, match="holds no rows"):
        load_gsm8k(empty)
    broken = write(tmp_path, "broken.jsonl", ['{"question": "q", "answer": "#### 1"}', "{not json"])
    with pytest.raises(DatasetError, match=r"broken.jsonl, line 2: not valid JSON"):
        load_gsm8k(broken)
    no_answer = write(tmp_path, "noans.jsonl", ['{"question": "q", "answer": "#### 1"}', '{"question": "q2"}'])
    with pytest.raises(DatasetError, match=r"noans.jsonl, line 2: missing field 'answer'"):
        load_gsm8k(no_answer)
    no_final = write(tmp_path, "nofinal.jsonl", ['{"question": "q", "answer": "it is 4"}'])
    with pytest.raises(DatasetError, match="line 1: field 'answer' has no '#### <final answer>'"):
        load_gsm8k(no_final)
    tasks, report = load_gsm8k(no_answer, skip_bad_rows=True)
    assert len(tasks) == 1 and report.skipped == 1 and "line 2" in report.reasons[0]
    qa = write(tmp_path, "qa.jsonl", ['{"question": "q", "answers": []}'])
    with pytest.raises(DatasetError, match="'answers' must be a non-empty list"):
        load_qa(qa)
    math = write(tmp_path, "m.jsonl", ['{"problem": "p"}'])
    with pytest.raises(DatasetError, match="missing field 'answer'"):
        load_math(math)


# --------------------------------------------------------------------------------- real data

@needs_data
def test_real_gsm8k_rows_grade_correct_against_their_gold():
    for name in ("gsm8k_test.jsonl", "gsm8k_train.jsonl"):
        tasks, report = load_gsm8k(DATA / name)
        assert report.skipped == 0 and len(tasks) in (1319, 7473)
        rows = [json.loads(line) for line in open(DATA / name)]
        for t, row in zip(tasks, rows):  # the worked solution itself, graded against its gold
            assert grade_math(row["answer"], t.answers[0]) == 1.0, t.task_id


@needs_data
def test_real_math500_rows_grade_correct_against_their_gold():
    tasks, _ = load_math(DATA / "math500_test.jsonl")
    assert len(tasks) == 500
    wrong = [t.task_id for t in tasks if grade_math(f"\\boxed{{{t.answers[0]}}}", t.answers[0]) != 1.0]
    assert not wrong, wrong[:5]


@needs_data
def test_real_qa_files_load():
    for name, n in [("hotpotqa_dev500.jsonl", 500), ("2wikimultihopqa_dev500.jsonl", 500), ("musique_dev500.jsonl", 500),
                    ("bamboogle_test.jsonl", 125), ("nq_test_flashrag_sample.jsonl", 17)]:
        tasks, _ = load_qa(DATA / name)
        assert len(tasks) == n and all(t.answers for t in tasks)
        assert all(grade_qa(f"<answer>{t.answers[0]}</answer>", t.answers) == 1.0 for t in tasks)


@needs_data
def test_real_hotpotqa_search_task_and_bm25_recall():
    passages = load_corpus(DATA / "hotpotqa_dev500_corpus.jsonl")
    tasks, _ = load_qa(DATA / "hotpotqa_dev500_ircot_contexts.jsonl")
    assert len(passages) == 4858 and len(tasks) == 500
    assert all(len(t.meta["supporting_titles"]) == 2 for t in tasks)
    retriever = BM25Retriever(passages)
    results = retriever.search_many([t.question for t in tasks], k=5)
    any_hit = sum(any(p.title in t.meta["supporting_titles"] for p in r) for t, r in zip(tasks, results)) / 500
    # Measured 0.948 (≥1 supporting paragraph in the top 5); SOURCES.md's own BM25 check saw 0.942.
    assert any_hit > 0.9


# ------------------------------------------------------------------ held-out parts (srpo.tasks.splits)


def _operands_key(question: str) -> str:
    """The problem with the operands of + and × sorted: a commuted problem is the same problem."""
    import re

    nums = re.findall(r"\d+", question)
    if "(" in question:
        a, b, c = nums
        return f"({min(int(a), int(b))}+{max(int(a), int(b))})*{c}"
    if "-" in question:
        return "-".join(nums)
    op = "*" if "*" in question else "+"
    return op.join(map(str, sorted(map(int, nums))))


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_arithmetic_train_and_test_parts_are_disjoint(level):
    """Every level: no problem (nor its commuted form) of the test part is drawn for training,
    whatever the seeds; each part is non-empty; ``all`` draws from both (as before parts)."""
    train = {_operands_key(t.question) for seed in (0, 1) for t in synthetic_arithmetic(3000, level=level, seed=seed,
                                                                                        split="train")}
    test = {_operands_key(t.question) for seed in (777, 999, 12345)
            for t in synthetic_arithmetic(1000, level=level, seed=seed, split="test")}
    assert train and test and not train & test
    assert {part_of(k) for k in train} == {"train"} and {part_of(k) for k in test} == {"test"}
    both = {_operands_key(t.question) for t in synthetic_arithmetic(3000, level=level, seed=0, split="all")}
    assert both & train and both & test


@pytest.mark.parametrize("level", [0, 1, 2, 4, 5, 6])
def test_whole_part_enumerated_and_partition_complete(level):
    """n=0: every problem of the part once; train and test together are the whole space."""
    train, test = (synthetic_arithmetic(0, level=level, split=s) for s in ("train", "test"))
    everything = synthetic_arithmetic(0, level=level, split="all")
    assert len({t.question for t in test}) == len(test) and len(train) + len(test) == len(everything)
    assert {t.question for t in train} | {t.question for t in test} == {t.question for t in everything}
    if level == 0:
        assert (len(train), len(test)) == (57, 24)  # the demo's held-out set: all 24 test problems


def test_level_3_cannot_be_enumerated():
    with pytest.raises(ValueError, match="level 3"):
        synthetic_arithmetic(0, level=3, split="test")


def test_split_all_keeps_the_old_draws():
    """`split: all` is the generator as it was before parts (old study records stay reproducible)."""
    old = ["What is 3 + 3?", "What is 9 + 6?", "What is 7 + 3?", "What is 7 + 7?"]  # recorded before parts
    assert [t.question for t in synthetic_arithmetic(4, level=0, seed=999, split="all")] == old


def test_kb_test_people_never_in_a_train_kb():
    """A test KB's questions are about people whose family names no train KB can hold."""
    train_people = {t.meta["person"].split()[1] for seed in (0, 1, 2) for t in synthetic_kb(300, seed=seed,
                                                                                            split="train")[1]}
    test_people = {t.meta["person"].split()[1] for seed in (777, 999) for t in synthetic_kb(60, seed=seed,
                                                                                           split="test")[1]}
    assert train_people and test_people and not train_people & test_people
    train_q = {t.question for t in synthetic_kb(300, seed=0, split="train")[1]}
    assert not train_q & {t.question for t in synthetic_kb(60, seed=777, split="test")[1]}


def test_held_out_sources_draw_from_the_test_part(tmp_path):
    """Configs: task.train takes the train part, task.eval the test part, unless split says."""
    from srpo import build
    from srpo.build import config_from_dict

    cfg = config_from_dict({"run": {"output_dir": str(tmp_path)}, "task": {
        "train": {"source": "synthetic_arithmetic", "level": 0, "n": 500},
        "eval": [{"source": "synthetic_arithmetic", "level": 0, "n": 200, "seed": 777, "name": "a"},
                 {"source": "synthetic_arithmetic", "level": 0, "n": 0, "split": "train", "name": "b"}]}})
    train = {_operands_key(t.question) for t in build.train_tasks(cfg)}
    sets = build.eval_sets(cfg, n=0)
    held = {_operands_key(t.question) for t in sets["a"]}
    assert not train & held and {_operands_key(t.question) for t in sets["b"]} == train
