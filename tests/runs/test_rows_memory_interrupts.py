"""Reliability IV (the rest of issue #38): rows no tokenizer can take, evaluation memory flat in k,
a checkpoint pruned while it loads, and Ctrl-C during a step.  (srpo serve under load:
tests/serving/test_serve_load.py.)"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest

from srpo.tasks.base import DatasetError
from helpers.runs import ENV, cli_train, trained  # noqa: F401  (shared helpers)
from helpers import HELPERS, ROOT


@contextlib.contextmanager
def _children_take_sigint():
    """Processes started inside take SIGINT as a run started from a terminal does, even when this
    test process inherited it ignored (as anything started by a non-interactive shell's ``&``
    does): an exec'd child keeps an ignored signal ignored but resets a handled one to default."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_row_no_tokenizer_can_take_is_refused_at_load_naming_file_and_line(tmp_path):
    from srpo.tasks.math import load_math

    path = tmp_path / "rows.jsonl"
    path.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n'
                    '{"question": "What is \\ud800 + 1?", "answer": "3"}\n')
    with pytest.raises(DatasetError, match=rf"{path}, line 2: the question is not valid Unicode text: surrogates not "
                                           r"allowed \(U\+D800\) at character 8"):
        load_math(path)
    tasks, report = load_math(path, skip_bad_rows=True)
    assert [t.question for t in tasks] == ["What is 1 + 1?"] and report.skipped == 1


def test_evaluation_keeps_no_episode_past_its_chunk_and_writes_every_one(tmp_path, monkeypatch):
    from srpo.evaluation import evaluate
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.tasks.base import Task
    from srpo.workflows.builtins import build_workflow
    from srpo.workflows.runtime import Runtime

    workflow = build_workflow("single")
    policies = ScriptedPolicies(lambda role, prompt: "The answer is 2.", workflow.roles())
    refs: list[weakref.ref] = []  # every episode the runtime returned (EpisodeResult is unhashable)
    most = []
    real_run = Runtime.run

    sizes = []

    def run(self, wf, jobs):
        gc.collect()
        sizes.append(len(jobs))
        most.append(sum(r() is not None for r in refs))  # episodes of earlier chunks still held now
        out = real_run(self, wf, jobs)
        refs.extend(weakref.ref(ep) for ep in out)
        return out

    monkeypatch.setattr(Runtime, "run", run)
    tasks = [Task(f"t{i}", f"What is 1 + {i}?", (str(1 + i),), "math") for i in range(40)]
    k = 8
    results = evaluate(policies, workflow, workflow.default_role_specs(), {"set": tasks}, k=k,
                       episodes_path=tmp_path / "episodes.jsonl")
    gc.collect()
    assert len(most) > 3 and max(most) == 0  # flat: nothing kept across chunks
    assert not any(r() is not None for r in refs)
    lines = [json.loads(x) for x in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert len(lines) == 40 * k and {(x["task_id"], x["sample"]) for x in lines} == {
        (f"t{i}", j) for i in range(40) for j in range(k)}
    assert results["datasets"]["set"][f"avg@{k}"] == pytest.approx(1 / 40)  # only 1 + 1 = 2 is right
    assert sum(x["reward"] for x in lines) == k
    # k larger than a chunk: still at most 64 episodes at a time (a chunk of k = 5,000 held 5,000),
    # each sample counted in its own task's row.
    sizes.clear()
    big = evaluate(policies, workflow, workflow.default_role_specs(), {"set": tasks[:3]}, k=150,
                   episodes_path=tmp_path / "big.jsonl")
    assert max(sizes) == 64 and sum(sizes) == 3 * 150
    assert big["datasets"]["set"]["avg@150"] == pytest.approx(1 / 3) and big["datasets"]["set"]["pass@150"] == pytest.approx(1 / 3)
    assert len((tmp_path / "big.jsonl").read_text().splitlines()) == 3 * 150


@pytest.mark.slow
def test_a_checkpoint_pruned_while_it_loads_gives_way_to_the_newest(tmp_path, monkeypatch, capsys):
    import shutil

    from srpo import build
    from srpo.apps import cli

    run = tmp_path / "run"
    trained(run, ["run.steps=2"])
    first = cli._checkpoint_for_eval(str(run))
    newer = first.with_name("step-00000099")
    shutil.copytree(first, newer)  # what the still-running training saves meanwhile
    team = build.team(build.config_from_dict(build.checkpoint_config(first), training=False))
    real = team.policies.load_pretrained_weights

    def load(folder):
        if Path(folder).parent == first:  # ... pruning the checkpoint this evaluation began to load
            shutil.rmtree(first)
            raise FileNotFoundError(f"{folder}/shared/model.safetensors")
        return real(folder)

    team.policies.load_pretrained_weights = load
    monkeypatch.setattr(cli, "_checkpoint_for_eval", lambda model: newer)
    assert cli._load_checkpoint(team, first, str(run)) == newer
    assert f"checkpoint {first.name} was pruned by the still-running training while it loaded; loading the " \
           f"newest, step-00000099" in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_during_a_step_exits_within_seconds(tmp_path):
    """SIGINT while a step's rewards run: the run ends promptly, not after the step — shown with
    rewards that hold the step far longer than the test waits for the exit."""
    from helpers.slow_reward import GATE_LIMIT_S, calls_started

    run = tmp_path / "run"
    log = tmp_path / "rewards.log"
    env = {**ENV, "PYTHONPATH": f"{ENV['PYTHONPATH']}{os.pathsep}{HELPERS}", "SRPO_TEST_REWARD_LOG": str(log),
           "SRPO_TEST_REWARD_GATE": str(tmp_path / "never")}
    with _children_take_sigint():
        proc = subprocess.Popen(cli_train(run, ["run.steps=50", "task.reward=slow_reward:reward"]), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while calls_started(log) == 0:  # inside step 1's rewards, which wait at a gate never opened
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=GATE_LIMIT_S / 3)
    assert proc.returncode == 130, err[-2000:]


@pytest.mark.slow
def test_ctrl_c_while_calls_wait_on_a_frozen_retriever_prints_no_traceback(tmp_path):
    """SIGINT while every episode's retrieval call waits on a server that never answers: exit 130
    with one line, never a traceback (from the main thread, a worker thread or the exit)."""
    import http.server

    reached, thaw = threading.Event(), threading.Event()

    class Frozen(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            reached.set()
            thaw.wait(120)  # answers only once the test is over

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Frozen)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cmd = [sys.executable, "-m", "srpo", "train", "--config", str(ROOT / "configs/search/search/srpo.yaml"),
           *[x for o in ["run.output_dir=" + str(tmp_path / "run"), "run.steps=2", "model.name=tiny-llama",
                         "model.autocast_bf16=false", "workflow.name=always_search:AlwaysSearch",
                         "workflow.max_new_tokens=4", "train.tasks_per_step=2", "train.group_size=2",
                         "task.corpus=''", f"retriever.url=http://127.0.0.1:{server.server_port}/retrieve",
                         "log.backends=[]", "eval.every=0", "task.eval=[]"] for x in ("--set", o)]]
    env = {**ENV, "PYTHONPATH": f"{ENV['PYTHONPATH']}{os.pathsep}{HELPERS}"}
    with _children_take_sigint():
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not reached.wait(0.05):  # a retrieval call is in flight, frozen
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        thaw.set()
        server.shutdown()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err + out and "interrupted" in err, err[-3000:]


class _ToolThenAsk:
    """A workflow that calls a tool, then asks the solver.  ``order``: episodes whose tools finish
    in this order (each waits for the one before it; the others at once); ``frozen``: episodes whose
    tool answers only when ``thaw`` is set."""

    def __init__(self, order=(), frozen=()):
        self.order, self.frozen = list(order), set(frozen)
        self.finished = {e: threading.Event() for e in self.order}
        self.thaw, self.frozen_returned = threading.Event(), threading.Event()

    async def run(self, ctx, task):
        def tool():
            me = ctx.episode_id
            if me in self.frozen:
                self.thaw.wait(120)
                self.frozen_returned.set()
            if me in self.order:
                i = self.order.index(me)
                if i:
                    assert self.finished[self.order[i - 1]].wait(120)
                self.finished[me].set()
            return "found"

        result = await ctx.call_tool("search", tool)
        return (await ctx.ask("solver", f"{task.question} ({result.value if result.ok else 'no result'})")).text


def _tool_run(workflow, tool_timeout_s=30.0):
    import torch

    from srpo.policies.layouts import build_policies
    from srpo.types import SamplingParams
    from srpo.rollout.builtin import BuiltinEngine
    from srpo.tasks.base import Task
    from srpo.types import RoleSpec
    from srpo.workflows.runtime import Runtime

    policies = build_policies("shared", "tiny-llama", ["solver"], seed=0)
    runtime = Runtime(BuiltinEngine(policies), {"solver": RoleSpec("solver", sampling=SamplingParams(max_new_tokens=8))},
                      lambda t, a: 0.0, generator=torch.Generator().manual_seed(0), tool_timeout_s=tool_timeout_s)
    tasks = [Task(f"t{i}", f"What is {i} + 1?", (str(i + 1),), "math") for i in range(4)]
    return runtime.run(workflow, [(f"e{i}", t) for i, t in enumerate(tasks)])


def test_a_frozen_tool_costs_its_call_its_time_limit_and_nothing_else():
    workflow = _ToolThenAsk(frozen=["e1"])  # e1's service never answers while the run lasts
    try:
        results = _tool_run(workflow, tool_timeout_s=1.0)
        # the call was abandoned and the loop never blocked: the run ended with the tool still frozen
        assert not workflow.frozen_returned.is_set()
    finally:
        workflow.thaw.set()
    assert [r.info.get("tool_timeouts", 0) for r in results] == [0, 1, 0, 0]


def test_the_batch_and_its_samples_do_not_depend_on_which_tool_finished_first():
    first = _tool_run(_ToolThenAsk(order=["e3", "e0"]))
    second = _tool_run(_ToolThenAsk(order=["e0", "e3"]))  # the other order of arrival at the batch
    assert [r.answer for r in first] == [r.answer for r in second]
    assert [[m.completion_ids for e in r.events for m in e.members] for r in first] == \
           [[m.completion_ids for e in r.events for m in e.members] for r in second]


def test_a_run_logs_its_peak_memory_and_states_it_against_the_floor(tmp_path):
    from srpo.runs.metrics_log import read_metrics
    from srpo.train import memory

    trainer = trained(tmp_path / "run", ["run.steps=2"])
    rows = read_metrics(tmp_path / "run")
    assert all(0 < r["memory/rss_gb"] <= r["memory/peak_rss_gb"] for r in rows)
    assert rows[0]["memory/peak_rss_gb"] <= rows[1]["memory/peak_rss_gb"]  # a peak so far never falls
    floor = memory.floor_bytes(trainer.policies.modules(), trainer.optimizers.values())
    model = trainer.policies.modules()[0]
    n = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert floor == 16 * n + buffers  # float32 weights, gradients and two AdamW moments (+ rotary tables)
    assert f"the floor of {floor / 2**20:.1f} MB (weights" in trainer.memory_summary()  # the tiny model: MB


def test_a_run_says_what_it_needs_before_its_first_step_and_warns_when_that_cannot_fit(tmp_path, monkeypatch,
                                                                                         capsys):
    from srpo.train import memory

    trainer = trained(tmp_path / "run", ["run.steps=1"])
    floor = memory.floor_bytes(trainer.policies.modules(), trainer.optimizers.values())
    line, fits = trainer.memory_preflight()
    assert fits and f"needs at least {memory.human(floor)} (weights, gradients, AdamW moments)" in line
    assert "of memory is free now" in line and memory.available_bytes() > floor
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: floor // 2)  # a machine too small
    line, fits = trainer.memory_preflight()
    assert not fits and "the floor alone does not fit" in line and "model.layout: lora" in line
    capsys.readouterr()  # what training wrote before
    trainer.announce_memory_preflight()
    assert capsys.readouterr().err.startswith("warning: memory: this run needs at least")
    weights, training = memory.floor_parts(trainer.policies.modules(), trainer.optimizers.values())
    assert weights + training == floor and training == 12 * sum(p.numel() for p in trainer.policies.modules()[0].parameters())
    # The weights are loaded already: room for the gradients and moments is enough, less is not.
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: training + 1)
    assert trainer.memory_preflight()[1]
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: training - 1)
    assert not trainer.memory_preflight()[1]
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: None)  # nothing readable: no claim
    line, fits = trainer.memory_preflight()
    assert fits and "free" not in line


def test_a_cgroup_limit_caps_the_memory_said_to_be_free(monkeypatch, tmp_path):
    from srpo.train import memory

    (tmp_path / "memory.max").write_text("1000\n")
    (tmp_path / "memory.current").write_text("900\n")
    (tmp_path / "memory.stat").write_text("anon 500\nfile 400\ninactive_file 300\n")
    assert memory._cgroup_room(str(tmp_path)) == 400  # the inactive page cache is reclaimable: room
    (tmp_path / "memory.max").write_text("max\n")
    assert memory._cgroup_room(str(tmp_path)) is None  # no limit
    monkeypatch.setattr(memory, "_cgroup_room", lambda: 12345)
    assert memory.available_bytes() == 12345
