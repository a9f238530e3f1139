"""Reliability: bad input, adversarial model output, failing components, NaN, crashes, kills."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from srpo.runs import checkpoint as ckpt
from srpo.build import load_config
from srpo.policies.scripted import ScriptedPolicies
from srpo.tasks import DatasetError
from srpo.tasks.math import answers_equivalent, extract_answer, grade_math, last_boxed
from srpo.tasks.rewards import task_reward
from srpo.tasks.search import BM25Retriever, extract_tagged_answer, normalize_answer, synthetic_kb, token_f1
from srpo.tasks.math import synthetic_arithmetic
from srpo.train import Trainer, TrainingStopped
from srpo.rollout.builtin import BuiltinEngine
from srpo.workflows import Runtime, build_workflow
from srpo.workflows.parsing import parse_decision, parse_router_choice, parse_search_step, search_call_context

ROOT = Path(__file__).resolve().parents[2]


def varied_reward(task, answer):
    return float(sum(map(ord, answer or "")) % 5) / 4.0


def tiny(tmp_path, extra=()):
    return [f"run.output_dir={tmp_path}", "run.steps=3", "model.name=tiny-llama", "workflow.max_new_tokens=6",
            "train.tasks_per_step=2", "train.group_size=2", "train.lr=0.01", "task.train.n=8",
            "checkpoint.every=1", "log.backends=[]", *extra]


# ------------------------------------------------------------------------- fuzzing the parsers

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
tricky_text = st.text(alphabet=st.sampled_from(list("0123456789+-*/^{}()[]\\$%,. =abcxWORKERS:<>/searchanswerinfo#\n")),
                      max_size=300) | st.text(max_size=200)


@FUZZ
@given(tricky_text)
def test_extraction_never_crashes(text):
    out = extract_answer(text)
    assert out is None or isinstance(out, str)
    assert last_boxed(text) is None or isinstance(last_boxed(text), str)


@FUZZ
@given(tricky_text, st.sampled_from(["3", "\\frac{1}{2}", "1000", "x^2", "(1, 2)"]))
def test_grading_returns_a_bounded_score(text, gold):
    start = time.perf_counter()
    score = grade_math(text, gold)
    assert score in (0.0, 1.0)
    assert time.perf_counter() - start < 10


@FUZZ
@given(tricky_text, st.integers(1, 8))
def test_router_choice_is_valid_or_none(text, n):
    chosen = parse_router_choice(text, n)
    assert chosen is None or (chosen == sorted(set(chosen)) and all(1 <= c <= n for c in chosen))


@FUZZ
@given(tricky_text)
def test_search_parsing_and_context_are_safe(text):
    kind, value = parse_search_step(text)
    assert kind in ("answer", "search", "none") and isinstance(value, str)
    ctx = search_call_context(text)
    assert "<information>" not in ctx.lower() and "</information>" not in ctx.lower()
    assert ctx.endswith("</search>") and ctx.count("</search>") == 1
    assert parse_decision(text, ("SEARCH", "ANSWER")) in (None, "SEARCH", "ANSWER")
    assert isinstance(normalize_answer(text), str) and 0 <= token_f1(text, ["a b"]) <= 1
    tagged = extract_tagged_answer(text)
    assert tagged is None or isinstance(tagged, str)


@pytest.mark.parametrize("text", [
    "", " ", "\\boxed{}", "\\boxed{" + "9" * 100000 + "}", "1" * 100000, "\\boxed{" + "\\sqrt{" * 500 + "2" + "}" * 500 + "}",
    "\\frac{1}{0}", "\\boxed{\\infty}", "nan", "1e999999", "\\boxed{\\text{" + "a" * 5000 + "}}", "\x00\x01\x02",
])
def test_adversarial_answers_grade_wrong_quickly(text):
    start = time.perf_counter()
    assert answers_equivalent(extract_answer(text), "7") is False
    assert time.perf_counter() - start < 10


# ---------------------------------------------------------------- adversarial model outputs in workflows

ADVERSARIAL = ["", "\\boxed{" + "{" * 300, "9" * 5000, "WORKERS: 99, -3, banana", "</search></information><answer>",
               "<information>the answer is 42</information>", "<search></search>", "\\boxed{\\frac{" * 40]


@pytest.mark.parametrize("workflow, options", [("routed", {"num_workers": 3}), ("parallel_aggregate", {"num_workers": 2}),
                                               ("solver_verifier", {"rounds": 2})])
def test_adversarial_outputs_never_crash_math_workflows(workflow, options):
    wf = build_workflow(workflow, **options)
    calls = {"n": 0}

    def script(role, prompt):
        calls["n"] += 1
        return ADVERSARIAL[calls["n"] % len(ADVERSARIAL)]

    rt = Runtime(BuiltinEngine(ScriptedPolicies(script, wf.roles())), wf.default_role_specs(), task_reward)
    tasks = synthetic_arithmetic(6, level=2, seed=3)
    res = rt.run(wf, [(f"e{i}", t) for i, t in enumerate(tasks)])
    assert all(r.reward in (0.0, 1.0) for r in res)
    assert "workflow" not in rt.failures
    if workflow == "routed":
        assert sum(r.info.get("router_fallbacks", 0) for r in res) > 0


def test_adversarial_outputs_never_crash_search_workflows():
    passages, tasks = synthetic_kb(12, seed=2)
    for name, opts in [("search", {"max_turns": 3}), ("search_team", {"num_searchers": 2, "max_turns": 2})]:
        wf = build_workflow(name, retriever=BM25Retriever(passages), **opts)
        calls = {"n": 0}

        def script(role, prompt):
            calls["n"] += 1
            return ADVERSARIAL[calls["n"] % len(ADVERSARIAL)]

        rt = Runtime(BuiltinEngine(ScriptedPolicies(script, wf.roles())), wf.default_role_specs(), task_reward)
        res = rt.run(wf, [(f"e{i}", t) for i, t in enumerate(tasks[:6])])
        assert all(r.reward in (0.0, 1.0) for r in res) and "workflow" not in rt.failures


def test_slow_tool_times_out_and_costs_only_that_call():
    passages, tasks = synthetic_kb(6, seed=2)

    release = threading.Event()

    class Frozen:  # answers only once the test is over: the runtime must not wait for it
        def search(self, query, k):
            release.wait(60)
            return []

    wf = build_workflow("search", retriever=Frozen(), max_turns=2)
    rt = Runtime(BuiltinEngine(ScriptedPolicies(lambda r, p: "<search>x</search>", wf.roles())), wf.default_role_specs(),
                 task_reward, tool_timeout_s=0.2)
    try:
        res = rt.run(wf, [("a", tasks[0])])
    finally:
        release.set()
    assert res[0].info["tool_timeouts"] == 1 and rt.failures["tool"] == 1


# ------------------------------------------------------------------------ data errors before models

@pytest.mark.parametrize("content, message", [
    (None, "no such dataset file"),
    ("", "holds no rows"),
    ("{nope\n", "line 1: not valid JSON"),
    ('{"question": "q"}\n', "line 1: missing field 'answer'"),
    ('{"answer": "#### 3"}\n', "line 1: missing field 'question'"),
])
def test_bad_dataset_fails_before_any_model_loads(tmp_path, monkeypatch, content, message):
    data = tmp_path / "train.jsonl"
    if content is not None:
        data.write_text(content)
        cfg = load_config(None, tiny(tmp_path, [f"task.train.source={data}"]))
    else:
        cfg = load_config(None, tiny(tmp_path))
        cfg.task.train.source = str(data)

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the data was checked")

    monkeypatch.setattr("srpo.build.policies", no_model)
    with pytest.raises(DatasetError, match=message):
        Trainer(cfg, progress=False)


def test_bad_rows_can_be_skipped_and_counted(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "What is 1 + 1?", "answer": "#### 2"}\n{"question": "x"}\n'
                    '{"question": "What is 2 + 2?", "answer": "#### 4"}\n')
    cfg = load_config(None, tiny(tmp_path, [f"task.train.source={data}", "task.train.skip_bad_rows=true"]))
    trainer = Trainer(cfg, progress=False)
    assert len(trainer.train_tasks) == 2


def test_router_cannot_choose_more_workers_than_exist():
    from srpo.config import ConfigError

    with pytest.raises(ConfigError, match="max_chosen.*larger than num_workers"):
        load_config(None, ["workflow.name=routed", "workflow.options={num_workers: 2, max_chosen: 3}"])


# ---------------------------------------------------------------------------------- numerics

def test_nan_loss_skips_the_step_then_stops_with_a_checkpoint(tmp_path, monkeypatch):
    import srpo.train.update as trainer_module

    real = trainer_module.policy_loss

    def poisoned(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * float("nan"), metrics

    cfg = load_config(None, tiny(tmp_path, ["train.max_nonfinite_steps=2", "run.steps=5", "checkpoint.every=0"]))
    trainer = Trainer(cfg, progress=False, reward_fn=varied_reward)
    before = [p.detach().clone() for p in trainer.policies.parameters("shared")]
    monkeypatch.setattr(trainer_module, "policy_loss", poisoned)
    with pytest.raises(TrainingStopped, match="2 consecutive steps had NaN/Inf"):
        trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.policies.parameters("shared")))
    assert trainer.step == 2 and trainer.totals["nonfinite_steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite_skipped"] for r in rows] == [1, 1]
    assert ckpt.latest_checkpoint(tmp_path).name == "step_0000002"


def test_one_nan_step_is_skipped_and_training_continues(tmp_path, monkeypatch):
    import srpo.train.update as trainer_module

    real = trainer_module.policy_loss
    calls = {"n": 0}

    def once(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("inf") if calls["n"] == 1 else loss), metrics

    monkeypatch.setattr(trainer_module, "policy_loss", once)
    trainer = Trainer(load_config(None, tiny(tmp_path, ["checkpoint.every=0"])), progress=False, reward_fn=varied_reward)
    history = trainer.fit()
    assert [h["nonfinite_skipped"] for h in history] == [1, 0, 0]


# ---------------------------------------------------------------------------------- checkpoints

def test_crash_while_writing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer = Trainer(load_config(None, tiny(tmp_path, ["run.steps=2"])), progress=False, reward_fn=varied_reward)
    trainer.fit()
    good = ckpt.latest_checkpoint(tmp_path)
    assert good.name == "step_0000002"
    real_save = torch.save

    def dies(obj, path, *a, **k):
        real_save(obj, path, *a, **k)
        Path(path).write_bytes(b"half")  # a torn file ...
        raise OSError("disk full")  # ... and the process fails mid-checkpoint

    monkeypatch.setattr(ckpt.torch, "save", dies)
    trainer.step = 3
    with pytest.raises(ckpt.CheckpointError, match=r"step_0000003 \(disk full; .* MiB free.*step_0000002 is intact"):
        trainer.save()
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    trainer.close()
    assert ckpt.latest_checkpoint(tmp_path) == good
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]
    again = Trainer(load_config(None, tiny(tmp_path, ["run.steps=2"])), progress=False)
    assert again.resume() and again.step == 2


# ----------------------------------------------------------------------------------- kill test

def _final_weights(run_dir: Path):
    from safetensors.torch import load_file

    latest = ckpt.latest_checkpoint(run_dir)
    return latest.name, load_file(str(latest / "model" / "shared" / "model.safetensors"))


@pytest.mark.slow
def test_sigkill_at_a_random_moment_then_resume_matches_uninterrupted(tmp_path):
    steps = 6
    args = lambda d: [sys.executable, "-m", "srpo.apps.cli", "train", "--config", str(ROOT / "configs/math/parallel_aggregate/srpo.yaml"),
                      *[x for o in tiny(d, [f"run.steps={steps}", "workflow.options={num_workers: 2}",
                                            "model.autocast_bf16=false"]) for x in ("--set", o)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(args(tmp_path / "straight"), check=True, env=env, timeout=600, capture_output=True)
    victim = tmp_path / "killed"
    proc = subprocess.Popen(args(victim), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (victim / "checkpoints" / "step_0000002").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    seed = int.from_bytes(os.urandom(2), "little")
    time.sleep((seed % 1000) / 1000 * 1.5)  # not a wait for anything: a random moment, mid-step, mid-checkpoint
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run([*args(victim), "--resume"], env=env, timeout=600, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    name_a, a = _final_weights(tmp_path / "straight")
    name_b, b = _final_weights(victim)
    assert name_a == name_b == f"step_{steps:07d}"
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"kill after {seed % 1000} ms"
    rows = [json.loads(line)["step"] for line in (victim / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, steps + 1))


# ------------------------------------------------------------------------------ no code execution

def test_no_eval_or_exec_of_text_anywhere():
    offenders = []
    pattern = re.compile(r"(?<![\w.])(eval|exec|sympify|compile)\s*\(")
    for path in (ROOT / "srpo").rglob("*.py"):
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#")[0]):
                offenders.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not offenders, offenders


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_reward_is_a_failed_reward(value):
    """A reward of ±inf or NaN never reaches the advantages, the loss or the logs: the episode
    scores as failed (the failure reward), the failure is counted and its first traceback kept."""
    wf = build_workflow("single")
    rt = Runtime(BuiltinEngine(ScriptedPolicies(lambda role, prompt: "4", wf.roles())), wf.default_role_specs(),
                 lambda task, answer: value)
    res = rt.run(wf, [(f"e{i}", t) for i, t in enumerate(synthetic_arithmetic(3, level=0, seed=1))])
    assert [r.reward for r in res] == [0.0, 0.0, 0.0] and all(r.info.get("failed") for r in res)
    assert rt.failures["reward"] == 3 and "returned" in rt.first_traceback["reward"]


@pytest.mark.parametrize("body, message", [
    ("raise ValueError('broken at import')", "raised ValueError: broken at import"),
    ("import sys\nsys.exit(0)", r"called sys.exit\(0\)"),
    ("def f(:\n  pass", "raised SyntaxError"),
])
def test_user_code_that_fails_at_import_names_the_field_and_the_path(tmp_path, monkeypatch, body, message):
    """A module named by a config import path that raises, exits or does not parse at import gives
    one config error naming the field and the path (a sys.exit(0) used to end srpo train with 0)."""
    from srpo.config import ConfigError

    (tmp_path / "badteam.py").write_text(body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("badteam", None)
    with pytest.raises(ConfigError, match=rf"workflow.name: 'badteam:Team': .*{message}"):
        load_config(None, [f"run.output_dir={tmp_path / 'run'}", "workflow.name=badteam:Team"])


def test_a_terminal_that_goes_away_mid_run_ends_nothing(tmp_path):
    """stdout and stderr on a pty whose reader closes after step 1 (an ssh session dropped): the run
    trains every step, checkpoints the last, exits 0, and says so in the run folder's srpo.log."""
    import pty
    import select

    from helpers.runs import cli_train

    run = tmp_path / "run"
    master, slave = pty.openpty()
    proc = subprocess.Popen(cli_train(run, ["run.steps=4"]), stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(slave)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 1) and time.monotonic() < deadline:
        if select.select([master], [], [], 0.05)[0]:  # drain, as a terminal does, until step 1 is logged
            try:
                os.read(master, 65536)
            except OSError:
                break
    os.close(master)  # the terminal is gone: every later write to it fails with EIO
    assert proc.wait(timeout=600) == 0
    assert (run / "checkpoints" / "step_0000004").is_dir()
    assert len(metrics.read_text().splitlines()) == 4
    assert "the terminal behind" in (run / "srpo.log").read_text()


def test_an_engine_whose_process_died_stops_the_run_naming_what_to_resume_from(tmp_path):
    """An engine that reports its process gone (vLLM's EngineDeadError becomes EngineDied) stops
    the run at the next rollout with one message — not one failed episode after another."""
    from srpo.rollout.engine import EngineDied
    from helpers.runs import tiny

    trainer = Trainer(load_config(None, tiny(tmp_path / "run", ["run.steps=1"])), progress=False)
    try:
        trainer.fit()

        def dead(*args, **kwargs):
            raise EngineDied("the vLLM engine's process died (EngineCore exited); srpo does not restart it")

        trainer.runtime.engine.generate = dead
        trainer.cfg.run.steps = 2
        with pytest.raises(TrainingStopped, match=r"process died .* in the rollout of step 2; the newest checkpoint, "
                                                  r"step_0000001, is intact: --resume starts a fresh engine on it"):
            trainer.fit()
        assert trainer.step == 1 and not trainer.runtime.failures.get("workflow")
    finally:
        trainer.close()


def test_an_engine_that_dies_during_the_weight_sync_stops_the_run_with_the_trainers_weights_saved(tmp_path):
    from srpo.rollout.engine import EngineDied
    from helpers.runs import tiny

    trainer = Trainer(load_config(None, tiny(tmp_path / "run", ["run.steps=2", "checkpoint.every=0"])), progress=False)
    try:
        def dead():
            raise EngineDied("the vLLM engine's process died (EngineCore_DP0 (pid 1) killed by SIGKILL)")

        trainer.engine.update_weights = dead
        with pytest.raises(TrainingStopped, match=r"killed by SIGKILL\) \(after step 1; the trainer's weights are in "
                                                  r".*step_0000001, and --resume starts a fresh engine on them\)"):
            trainer.fit()
        assert (tmp_path / "run" / "checkpoints" / "step_0000001").is_dir()
    finally:
        trainer.close()
