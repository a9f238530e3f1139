"""The paper configs load their real datasets as written (issue: the paper's launches).

Each hub dataset is rebuilt here, offline, with the exact column layout its dataset card gives
(nested columns included), as a real ``datasets.Dataset``; ``datasets.load_dataset`` is replaced by
a stand-in that serves these by (id, configuration, split) and refuses what the hub refuses (a
multi-configuration dataset without its configuration).  Each paper config's own ``task``
section then loads through :func:`srpo.data.load_tasks`.
"""

import glob
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

from srpo.config import Config, parse_section, read_yaml  # noqa: E402
from srpo.data import field_path, field_value, load_tasks  # noqa: E402
from srpo.tasks.base import DatasetError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response should be of the "
               "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\n"
               "Remember to put your answer on its own line after \"Answer:\".")


def dapo_row(i, problem, answer):
    """BytedTsinghua-SIA/DAPO-Math-17k (verl format): prompt is a list of chat messages, the gold
    answer is reward_model.ground_truth; there is no solution column."""
    return {"data_source": "math_dapo", "prompt": [{"content": DAPO_PROMPT.format(problem), "role": "user"}],
            "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule-lean"},
            "extra_info": {"index": f"9a9b6eb4-a1cb-49d1-8c1e-{i:012d}"}}


HUB = {
    ("BytedTsinghua-SIA/DAPO-Math-17k", None, "train"): [
        dapo_row(1, "In triangle $ABC$, $AB = 13$, $BC = 14$, $CA = 15$. Find the area.", "84"),
        dapo_row(2, "How many positive divisors does $2^4 \\cdot 3^2$ have?", "15"),
    ],
    ("HuggingFaceH4/MATH-500", None, "test"): [
        {"problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
         "solution": "We have that $r = 3$ ... $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$",
         "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
         "unique_id": "test/precalculus/807.json"},
        {"problem": "What is $1^{(2^{235423523})}$?", "solution": "... $\\boxed{1}$", "answer": "1",
         "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1747.json"},
    ],
    ("HuggingFaceH4/aime_2024", None, "train"): [
        {"id": 60, "problem": "Every morning Aya goes for a $9$-kilometer-long walk ... Find the number of minutes.",
         "solution": "... $\\boxed{204}$", "answer": "204",
         "url": "https://artofproblemsolving.com/wiki/index.php/2024_AIME_I_Problems/Problem_1", "year": "2024"},
    ],
    ("hotpotqa/hotpot_qa", "distractor", "train"): [
        {"id": "5a7a06935542990198eaf050", "question": "Which magazine was started first Arthur's Magazine or "
         "First for Women?", "answer": "Arthur's Magazine", "type": "comparison", "level": "medium",
         "supporting_facts": {"title": ["Arthur's Magazine", "First for Women"], "sent_id": [0, 0]},
         "context": {"title": ["Radio City (Indian radio station)", "Arthur's Magazine"],
                     "sentences": [["Radio City is India's first private FM radio station."],
                                   ["Arthur's Magazine (1844-1846) was an American literary periodical."]]}},
    ],
}
NEEDS_CONFIG = {"hotpotqa/hotpot_qa": ["distractor", "fullwiki"]}


@pytest.fixture
def offline_hub(monkeypatch):
    calls = []

    def load_dataset(path, name=None, split=None, **kw):
        calls.append((path, name, split))
        if path in NEEDS_CONFIG and name is None:  # what the hub answers
            raise ValueError(f"Config name is missing.\nPlease pick one among the available configs: "
                             f"{NEEDS_CONFIG[path]}\nExample of usage:\n\t`load_dataset('{path}', "
                             f"'{NEEDS_CONFIG[path][0]}')`")
        rows = HUB.get((path, name, split))
        if rows is None:
            raise FileNotFoundError(f"Couldn't find {path} ({name}, {split}) offline")
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def paper_sources():
    for f in sorted(glob.glob(str(ROOT / "configs" / "paper" / "*.yaml"))):
        if "study" in Path(f).name:
            continue
        cfg = parse_section(Config, read_yaml(f))
        for held_out, src in [(False, cfg.task.train), *((True, e) for e in cfg.task.eval)]:
            if src.source.startswith("hub:"):
                yield Path(f).name, cfg.task.kind, held_out, src


EXPECTED = {  # dataset id → (text the first question contains, its gold answer)
    "BytedTsinghua-SIA/DAPO-Math-17k": ("$AB = 13$, $BC = 14$, $CA = 15$. Find the area.", "84"),
    "HuggingFaceH4/MATH-500": ("Convert the point $(0,3)$", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    "HuggingFaceH4/aime_2024": ("Aya goes for a $9$-kilometer-long walk", "204"),
    "hotpotqa/hotpot_qa": ("Arthur's Magazine or First for Women?", "Arthur's Magazine"),
}


def test_every_paper_config_loads_its_hub_datasets_as_written(offline_hub):
    seen = set()
    for config, kind, held_out, src in paper_sources():
        tasks = load_tasks(src, kind, held_out=held_out)
        dataset_id = src.source.removeprefix("hub:")
        question, answer = EXPECTED[dataset_id]
        assert question in tasks[0].question, (config, dataset_id)
        assert tasks[0].answers[0] == answer, (config, dataset_id)
        assert len(tasks) == len(HUB[(dataset_id, src.config or None, src.split or "train")])
        seen.add(dataset_id)
    assert seen == set(EXPECTED), "every paper dataset is covered"
    assert ("hotpotqa/hotpot_qa", "distractor", "train") in offline_hub


def test_a_missing_nested_field_is_named_with_its_path_and_row(offline_hub):
    src = next(s for _, _, held_out, s in paper_sources() if "DAPO" in s.source)
    rows = HUB[("BytedTsinghua-SIA/DAPO-Math-17k", None, "train")]
    broken = [*rows, {**dapo_row(3, "x", "1"), "reward_model": {"style": "rule-lean"}}]
    HUB[("BytedTsinghua-SIA/DAPO-Math-17k", None, "train")] = broken
    try:
        with pytest.raises(DatasetError, match=r"line 3: reward_model.ground_truth \(at 'ground_truth'\) missing"):
            load_tasks(src, "math", held_out=False)
        skipping = src.model_copy(update={"skip_bad_rows": True})
        assert len(load_tasks(skipping, "math", held_out=False)) == 2, "skipped and counted, not fatal"
    finally:
        HUB[("BytedTsinghua-SIA/DAPO-Math-17k", None, "train")] = rows


def test_a_multi_configuration_dataset_without_config_says_to_name_one(offline_hub):
    src = next(s for _, _, _, s in paper_sources() if "hotpot_qa" in s.source)
    with pytest.raises(DatasetError, match="several configurations; name one with 'config:'"):
        load_tasks(src.model_copy(update={"config": ""}), "qa", held_out=False)


def test_field_paths():
    row = {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], "a": {"b": 3}}
    assert field_path("prompt[-1].content") == ["prompt", -1, "content"]
    assert field_value(row, "prompt[-1].content") == "q" and field_value(row, "prompt[0].role") == "system"
    assert field_value(row, "a.b") == 3
    with pytest.raises(KeyError, match=r"prompt\[5\].content \(at 5\) missing: no item \[5\]"):
        field_value(row, "prompt[5].content")
    for bad in ("a..b", ".a", "a[x]", ""):
        with pytest.raises(ValueError, match="is not valid"):
            field_path(bad)


def test_plain_columns_still_rename(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_text('{"problem": "ignored", "q": "What is 2 + 2?", "sol": "4"}\n')
    src = parse_section(Config, {"task": {"train": {"source": str(f), "fields": {"question": "q", "answer": "sol"}}}}).task.train
    (task,) = load_tasks(src, "math", held_out=False)
    assert task.question == "What is 2 + 2?" and task.answers == ("4",)
