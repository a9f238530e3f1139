"""A held-out set searched in its own corpus (``task.eval[].corpus``): the HotpotQA-next-to-a-
synthetic-KB case, on scripted policies (no model)."""

import json
import re

import pytest
import yaml

from srpo import build
from srpo.build import config_from_dict, load_config
from srpo.config import ConfigError
from srpo.evaluation import evaluate
from srpo.policies.scripted import ScriptedPolicies
from srpo.tasks.search import synthetic_kb


def city_script(role, prompt):
    """Search the person; answer with the city the retrieved text says they were born in."""
    person = re.search(r"city was ([A-Z]\w+ [A-Z]\w+)", prompt).group(1)
    if "<information>[" in prompt:  # a search came back (the system prompt names the tag too)
        hit = re.search(rf"{person} is an? \w+ who was born in (\w+)", prompt.split("<information>")[-1])
        return f"<answer>{hit.group(1) if hit else 'unknown'}</answer>"
    return f"<search>{person}</search>"


@pytest.fixture
def heldout_files(tmp_path):
    """A held-out QA file whose answers live only in its own corpus file (a KB the training
    source does not generate) — like HotpotQA questions over HotpotQA paragraphs."""
    passages, tasks = synthetic_kb(12, seed=5)
    questions = tmp_path / "heldout.jsonl"
    questions.write_text("".join(json.dumps({"question": t.question, "answer": t.answers[0]}) + "\n"
                                 for t in tasks if t.question.startswith("In which city")))
    corpus = tmp_path / "heldout_corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": p.pid, "title": p.title, "text": p.text}) + "\n" for p in passages))
    return questions, corpus


def search_config(eval_sets, **task):
    return config_from_dict({
        "model": {"name": "tiny-llama"},
        "workflow": {"name": "search", "options": {"max_turns": 2, "top_k": 1}},
        "task": {"kind": "qa", "train": {"source": "synthetic_kb", "n": 12, "seed": 3}, "corpus": "synthetic_kb",
                 "eval": eval_sets, **task},
    })


def test_a_heldout_set_is_searched_in_its_own_corpus(heldout_files):
    questions, corpus = heldout_files
    cfg = search_config([{"source": str(questions), "name": "own", "corpus": str(corpus)},
                         {"source": str(questions), "name": "shared"}])
    team_retriever = build.retriever(cfg)  # the training KB only: the held-out people are not in it
    workflow = build.workflow(cfg, team_retriever)
    datasets = build.eval_sets(cfg, n=0)
    workflows = build.eval_workflows(cfg, None, workflow)
    assert workflows["shared"] is workflow and workflows["own"] is not workflow
    assert len(workflows["own"].retriever.passages) == sum(1 for _ in corpus.open())
    policies = ScriptedPolicies(city_script, workflow.roles())
    results = evaluate(policies, workflow, build.role_specs(cfg, workflow), datasets, k=1, workflows=workflows)
    assert results["datasets"]["own"]["avg@1"] == 1.0, "every answer is in the set's own corpus"
    assert results["datasets"]["shared"]["avg@1"] == 0.0, "the same questions over the training KB find nothing"


def test_synthetic_kb_as_a_sets_corpus_is_that_sets_own_kb():
    cfg = search_config([{"source": "synthetic_kb", "n": 12, "seed": 5, "name": "kb5", "corpus": "synthetic_kb"},
                         {"source": "synthetic_kb", "n": 12, "seed": 6, "name": "kb6", "corpus": "synthetic_kb"}])
    workflows = build.eval_workflows(cfg, None, build.workflow(cfg, build.retriever(cfg)))
    for name, seed in (("kb5", 5), ("kb6", 6)):
        own = {p.text for p in synthetic_kb(12, seed=seed, split="test")[0]}  # held-out sets: the test part
        assert {p.text for p in workflows[name].retriever.passages} == own


@pytest.mark.parametrize("change, message", [
    ({"train": {"source": "synthetic_kb", "corpus": "synthetic_kb"}}, r"task.train.corpus: training searches task.corpus"),
    ({"eval": [{"source": "synthetic_arithmetic", "corpus": "synthetic_kb"}]}, r"task.eval\[0\].corpus: synthetic_kb names the set's own"),
])
def test_misplaced_corpora_are_config_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        search_config(change.pop("eval", []), **change)


def test_a_corpus_on_a_workflow_that_searches_nothing_is_an_error():
    with pytest.raises(ConfigError, match=r"task.eval\[0\].corpus: the single workflow searches nothing"):
        config_from_dict({"model": {"name": "tiny-llama"}, "workflow": {"name": "single"},
                          "task": {"eval": [{"source": "synthetic_arithmetic", "corpus": "corpus.jsonl"}]}})


def test_corpus_paths_resolve_against_the_file_that_names_them(tmp_path, heldout_files):
    questions, corpus = heldout_files
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "run.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name": "tiny-llama"}, "workflow": {"name": "search"},
        "task": {"kind": "qa", "train": {"source": "synthetic_kb"}, "corpus": "synthetic_kb",
                 "eval": [{"source": "../heldout.jsonl", "corpus": "../heldout_corpus.jsonl"}]}}))
    cfg = load_config(path)
    assert cfg.task.eval[0].corpus == str(corpus)


def test_a_study_resolves_and_checks_its_eval_corpora(tmp_path, heldout_files):
    from srpo.apps.study.schema import load_study

    questions, corpus = heldout_files
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({
        "model": {"name": "tiny-llama"}, "workflow": {"name": "search"},
        "task": {"kind": "qa", "train": {"source": "synthetic_kb"}, "corpus": "synthetic_kb"}}))
    study = {"output_dir": str(tmp_path / "out"), "base": "base.yaml", "seeds": [0],
             "axes": {"method": [{"label": "srpo", "set": {}}]},
             "eval": {"datasets": [{"source": "heldout.jsonl", "corpus": "heldout_corpus.jsonl"}]}}
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    assert load_study(tmp_path / "study.yaml")["eval_sources"][0].corpus == str(corpus.resolve())
    study["axes"]["method"].append({"label": "single", "set": {"workflow.name": "single", "task.kind": "qa",
                                                               "task.corpus": ""}})
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    with pytest.raises(ConfigError, match=r"cell single .*eval.datasets\[0\].corpus: the single workflow"):
        load_study(tmp_path / "study.yaml")
