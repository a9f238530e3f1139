"""Reliability III: the run folder is srpo's alone to delete, changed data is caught, preemption
and dead services cost nothing, user code and the retrieval server fail clearly."""

import json
import os
import re
from pathlib import Path

import pytest

from srpo.runs.run_dir import RunDirError
from helpers.runs import steps_logged, tiny, trained  # noqa: F401  (shared helpers)
from srpo.build import load_config
from srpo.train import Trainer
from helpers import HELPERS


def attempt(run_dir, extra=(), overwrite=False):
    """A training run that may be refused; its folder is released however it ends."""
    from helpers.runs import varied_reward

    trainer = Trainer(load_config(None, tiny(run_dir, extra)), progress=False, reward_fn=varied_reward,
                      overwrite=overwrite)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer


# ------------------------------------------------------- 1. srpo deletes and overwrites only what it wrote

def test_overwrite_deletes_only_what_srpo_recorded_writing(tmp_path):
    home = tmp_path / "home"  # a folder full of the user's things, given as the run folder
    home.mkdir()
    (home / "wandb").mkdir()
    (home / "wandb" / "my-run.txt").write_text("the user's own W&B files")
    (home / "notes.txt").write_text("mine")
    trainer = trained(home, ["run.steps=2"])  # no W&B in this run: its wandb/ is not in the way
    assert trainer.step == 2
    owned = set(json.loads((home / ".srpo-owned.json").read_text())["created"])
    assert {"metrics.jsonl", "checkpoints", "samples.jsonl"} <= owned and "wandb" not in owned
    trained(home, ["run.steps=1"], overwrite=True)
    assert (home / "wandb" / "my-run.txt").read_text() == "the user's own W&B files"
    assert (home / "notes.txt").read_text() == "mine" and steps_logged(home) == [1]


def test_a_users_own_checkpoints_are_never_written_into_or_deleted(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "model.pt").write_text("the user's weights")
    for overwrite in (False, True):
        with pytest.raises(RunDirError, match="checkpoints/, which srpo did not write"):
            attempt(run, overwrite=overwrite)
    assert (run / "checkpoints" / "model.pt").read_text() == "the user's weights"


@pytest.mark.parametrize("name", ["metrics.jsonl", ".lock", "checkpoints"])
def test_a_planted_link_refuses_the_run_and_its_target_is_untouched(tmp_path, name):
    target = tmp_path / "precious"
    if name == "checkpoints":
        target.mkdir()
        (target / "keep.txt").write_text("precious")
    else:
        target.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(target, run / name)
    for overwrite in (False, True):
        with pytest.raises(RunDirError, match="symbolic link srpo did not make"):
            attempt(run, overwrite=overwrite)
    assert (target / "keep.txt" if name == "checkpoints" else target).read_text() == "precious"


def test_sft_claims_its_output_folder_as_train_does(tmp_path):
    from srpo.build import config_from_dict
    from srpo.apps.sft import run_sft

    out = tmp_path / "sft"
    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps({"turns": [{"role": "solver", "input": "What is 1 + 1?", "output": "2"}]}) + "\n")

    def cfg():
        return config_from_dict({"model": {"name": "tiny-llama"}, "workflow": {"name": "single"},
                                 "task": {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 0, "n": 4}},
                                 "sft": {"data": str(data), "output_dir": str(out), "epochs": 1}})

    (out / "model").mkdir(parents=True)
    (out / "model" / "mine.bin").write_text("the user's")
    with pytest.raises(RunDirError, match="model/, which srpo did not write"):
        run_sft(cfg(), progress=False, overwrite=True)
    (out / "model" / "mine.bin").unlink()
    (out / "model").rmdir()
    run_sft(cfg(), progress=False)
    with pytest.raises(RunDirError, match="holds a previous run"):
        run_sft(cfg(), progress=False)
    (out / "notes.txt").write_text("mine")
    run_sft(cfg(), progress=False, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "model").is_dir()


# ------------------------------------------------------------ 7. SFT turns longer than the context

def test_a_runaway_sft_turn_is_skipped_or_cut_and_counted_never_trained_whole(tmp_path):
    from srpo.build import config_from_dict
    from srpo.apps.sft import run_sft

    data = tmp_path / "t.jsonl"
    turns = [{"role": "solver", "input": "What is 1 + 1?", "output": "2"},
             {"role": "solver", "input": "Tell me everything.", "output": "x" * 10_000_000}]  # a 10 MB answer
    data.write_text(json.dumps({"turns": turns}) + "\n")
    for mode, key in (("skip", "long_turns_skipped"), ("truncate", "long_turns_truncated")):
        out = tmp_path / mode
        cfg = config_from_dict({"model": {"name": "tiny-llama"}, "workflow": {"name": "single"},
                                "task": {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 0, "n": 4}},
                                "sft": {"data": str(data), "output_dir": str(out), "epochs": 1, "long_turns": mode}})
        run_sft(cfg, progress=False)
        summary = json.loads((out / "sft.json").read_text())
        assert summary[key] == 1 and summary["examples"] == (1 if mode == "skip" else 2)


def test_bad_prompt_ids_are_named_with_file_and_line(tmp_path):
    from srpo.build import config_from_dict
    from srpo.apps.sft import run_sft
    from srpo.tasks import DatasetError

    data = tmp_path / "t.jsonl"
    good = {"turns": [{"role": "solver", "input": "q", "output": "a"}]}
    for bad, match in ((["7", 8], "must be a non-empty list of token ids"), ([1, 10 ** 9], "outside this model's vocabulary")):
        data.write_text(json.dumps(good) + "\n" + json.dumps({"turns": [{"role": "solver", "prompt_ids": bad,
                                                                         "output": "a"}]}) + "\n")
        cfg = config_from_dict({"model": {"name": "tiny-llama"}, "workflow": {"name": "single"},
                                "task": {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 0, "n": 4}},
                                "sft": {"data": str(data), "output_dir": str(tmp_path / "o"), "epochs": 1}})
        with pytest.raises(DatasetError, match=f"t.jsonl, line 2.*{match}"):
            run_sft(cfg, progress=False, overwrite=True)


# ------------------------------------------------------------------------------- 2. data identity

@pytest.mark.slow
def test_resume_on_changed_data_is_refused_naming_the_file_unless_allowed(tmp_path):
    import subprocess

    from helpers.runs import ENV, cli_train

    data = tmp_path / "train.jsonl"

    def write(rows):
        data.write_text("".join(json.dumps({"question": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
                                for a, b in rows))

    write([(a, b) for a in range(4) for b in range(2)])
    run = tmp_path / "run"
    extra = [f"task.train.source={data}", "task.train.n=0", "run.steps=2"]
    assert subprocess.run(cli_train(run, extra), env=ENV, capture_output=True, timeout=300).returncode == 0
    write([(a, b) for a in range(4, 8) for b in range(2)])  # as many rows, other problems
    again = subprocess.run(cli_train(run, [*extra[:-1], "run.steps=4"], ["--resume"]), env=ENV, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 2 and f"{data}" in again.stderr and "other content (same row count)" in again.stderr
    assert steps_logged(run) == [1, 2]
    write([(a, b) for a in range(3) for b in range(2)])  # fewer rows
    fewer = subprocess.run(cli_train(run, [*extra[:-1], "run.steps=4"], ["--resume"]), env=ENV, capture_output=True,
                           text=True, timeout=300)
    assert fewer.returncode == 2 and "8 → 6 rows" in fewer.stderr
    allowed = subprocess.run(cli_train(run, [*extra[:-1], "run.steps=4"], ["--resume", "--allow-data-change"]), env=ENV,
                             capture_output=True, text=True, timeout=300)
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert steps_logged(run) == [1, 2, 3, 4] and "a new epoch starts" in allowed.stderr


# ------------------------------------------------------------------------------- 3. preemption

def _popen_train(run, extra, flags=(), env=None):
    import subprocess

    from helpers.runs import ENV, cli_train
    from helpers import ROOT

    env = {**ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{HELPERS}", **(env or {})}
    return subprocess.Popen(cli_train(run, extra, flags), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait_for_step(run, step, proc, timeout=120):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").is_file() and len(steps_logged(run)) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} logged: rc {proc.poll()}, {proc.stderr.read()[-2000:] if proc.poll() else ''}")


@pytest.mark.slow
def test_sigterm_saves_at_the_step_end_closes_trackers_as_killed_and_resume_continues(tmp_path, monkeypatch):
    import signal

    run = tmp_path / "run"
    extra = ["run.steps=40", "checkpoint.every=0", "log.backends=[mlflow]"]  # checkpoint.every=0: only at the end
    proc = _popen_train(run, extra)
    _wait_for_step(run, 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert "stopped: SIGTERM: stopped after step" in err
    stopped_at = steps_logged(run)[-1]
    assert 2 <= stopped_at < 40 and (run / "checkpoints" / f"step_{stopped_at:07d}").is_dir()
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as srpo's tracker allows it for its own file store
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.status for r in runs] == ["KILLED"]
    proc = _popen_train(run, ["run.steps=40", "checkpoint.every=0", "log.backends=[mlflow]"], ["--resume"])
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    assert steps_logged(run) == list(range(1, 41))


@pytest.mark.slow
def test_sigterm_past_the_grace_time_exits_at_once_keeping_the_previous_checkpoint(tmp_path):
    import signal
    import time

    from helpers.slow_reward import GATE_LIMIT_S, calls_started

    run = tmp_path / "run"
    log, gate = tmp_path / "rewards.log", tmp_path / "open"
    extra = ["run.steps=20", "checkpoint.every=1", "run.preempt_grace_s=0.5", "task.reward=slow_reward:reward"]
    proc = _popen_train(run, extra, env={"SRPO_TEST_REWARD_LOG": str(log), "SRPO_TEST_REWARD_GATE": str(gate)})
    while calls_started(log) == 0:  # step 1's rewards have begun: let them, and only them, through
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        time.sleep(0.01)
    gate.touch()
    _wait_for_step(run, 1, proc, timeout=300)
    gate.unlink()  # step 2's rewards now wait at the gate: the step cannot reach a safe point
    while not (run / "checkpoints" / "step_0000001").is_dir():
        time.sleep(0.01)
    before = calls_started(log)
    while calls_started(log) == before:  # a reward of step 2 is running
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    # The rewards hold step 2 for GATE_LIMIT_S: exiting well before, the run did not wait for them.
    _, err = proc.communicate(timeout=GATE_LIMIT_S / 3)
    assert proc.returncode == 143, err[-2000:]
    assert "no safe point within" in err
    from srpo.runs.checkpoint import candidates

    assert candidates(run), "the previous checkpoint is there to resume from"


# ------------------------------------------------------------------------ 4. services never stop a run

@pytest.mark.slow
def test_a_dead_or_silent_tracker_server_is_switched_off_and_the_run_goes_on(tmp_path, caplog):
    import socket

    pytest.importorskip("mlflow")
    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    dead_port = refused.getsockname()[1]
    refused.close()  # nothing listens there: connections are refused
    try:
        for name, port in (("refused", dead_port), ("silent", silent.getsockname()[1])):
            run = tmp_path / name
            with caplog.at_level("WARNING"):
                trainer = trained(run, ["run.steps=3", "log.backends=[mlflow]", "log.tracker_timeout_s=3",
                                        f"log.mlflow_tracking_uri=http://127.0.0.1:{port}"])
            assert trainer.step == 3 and steps_logged(run) == [1, 2, 3]
            warnings = [r.message for r in caplog.records if "tracker mlflow" in r.message]
            assert len(warnings) == 1 and "switched off for the rest of this run" in warnings[0]
            caplog.clear()
    finally:
        silent.close()


@pytest.mark.slow
@pytest.mark.torchrun
@pytest.mark.timeout(300)
def test_a_frozen_torchrun_rank_is_named_and_the_run_ends(tmp_path):
    import shutil
    import signal
    import subprocess
    import sys
    import time

    from helpers.runs import free_port
    from helpers import ROOT
    from helpers.runs import ENV

    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun is not installed")
    run = tmp_path / "run"
    overrides = [*tiny(run, ["run.steps=50", "run.collective_timeout_s=5", "checkpoint.every=0"])]
    cmd = [str(torchrun if torchrun.exists() else "torchrun"), "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "srpo.apps.cli", "train", "--config", str(ROOT / "configs/math/single/srpo.yaml"),
           *[x for o in overrides for x in ("--set", o)]]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and not ((run / "metrics.jsonl").is_file() and steps_logged(run)):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.1)
        rank1 = _rank_process(run, 1)
        os.kill(rank1, signal.SIGSTOP)  # frozen: alive, holding its sockets, answering nothing
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode != 0
        assert "rank(s) 1 did not answer within 5 s (run.collective_timeout_s)" in out, out[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            os.kill(rank1, signal.SIGKILL)
        except (OSError, TypeError, UnboundLocalError):
            pass


@pytest.mark.slow
@pytest.mark.torchrun
@pytest.mark.timeout(600)
def test_a_rank_killed_mid_update_stops_every_rank_and_the_newest_checkpoint_resumes(tmp_path):
    """FSDP over two gloo ranks, a checkpoint every step; rank 1 is SIGKILLed (as the OOM killer
    does) after step 2: the whole job ends within the collective timeout, the newest checkpoint
    verifies, and --resume continues from it (resumption's exactness: tests/parallel/test_fsdp.py)."""
    import shutil
    import signal
    import subprocess
    import sys
    import time

    from srpo.runs.checkpoint import candidates, verify
    from helpers.runs import ENV, free_port
    from helpers import ROOT

    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed")
    run = tmp_path / "run"

    def launch(steps, *flags):
        overrides = tiny(run, [f"run.steps={steps}", "run.collective_timeout_s=20", "train.parallel=fsdp"])
        return [str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "srpo.apps.cli",
                "train", "--config", str(ROOT / "configs/math/single/srpo.yaml"),
                *[x for o in overrides for x in ("--set", o)], *flags]

    proc = subprocess.Popen(launch(200), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not ((run / "metrics.jsonl").is_file() and len(steps_logged(run)) >= 2):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.1)
        rank1 = _rank_process(run, 1)
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode != 0 and time.monotonic() - killed < 60, out[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    newest = candidates(run)[0]
    assert verify(newest) is None, verify(newest)
    step = int(newest.name.split("_")[1])
    assert step >= 1  # the step being written when the peer died is a temporary folder, never "newest"
    (run / ".lock").unlink(missing_ok=True)
    done = subprocess.run(launch(step + 1, "--resume"), env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert steps_logged(run) == list(range(1, step + 2))
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]  # the resumed run tidied


def _rank_process(run: Path, rank: int) -> int:
    """The pid of torchrun's rank ``rank`` training into ``run``."""
    for pid in os.listdir("/proc"):
        try:
            env = (Path("/proc") / pid / "environ").read_bytes().split(b"\0")
            cmdline = (Path("/proc") / pid / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"RANK={rank}".encode() in env and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in env) \
                and any(str(run).encode() in a for a in cmdline):
            return int(pid)
    raise AssertionError(f"rank {rank}'s process")


# ------------------------------------------------------------------- 6. the retrieval server's bounds

@pytest.fixture
def retrieval_server():
    import threading
    import time

    pytest.importorskip("fastapi")
    from srpo.runs import serving
    from srpo.tasks.retrieval_service import build_app
    from srpo.tasks.search import BM25Retriever, synthetic_kb

    passages, _ = synthetic_kb(40, seed=0)
    sock = serving.bind("127.0.0.1", 0)
    server = serving.uvicorn_server(build_app(BM25Retriever(passages), max_results=200), header_timeout_s=1.0,
                                    guard=serving.Guard(body_deadline_s=1.0), limit_concurrency=64)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield sock.getsockname()[1], passages[0].title
    server.should_exit = True
    thread.join(timeout=10)


def test_the_retrieval_server_refuses_oversized_work_and_cuts_off_slow_clients(retrieval_server):
    import socket
    import time

    import httpx

    port, word = retrieval_server
    url = f"http://127.0.0.1:{port}/retrieve"
    ok = httpx.post(url, json={"queries": [word], "topk": 3})
    assert ok.status_code == 200 and len(ok.json()["result"][0]) == 3
    big = httpx.post(url, json={"queries": ["q"] * 100, "topk": 3})  # 300 passages > 200
    assert big.status_code == 413 and "at most 200" in big.json()["detail"]
    long = httpx.post(url, json={"queries": ["x" * 5000]})
    assert long.status_code == 422
    # A client that opens a connection and sends half a request line is cut off after the header timeout.
    slow = socket.create_connection(("127.0.0.1", port))
    slow.sendall(b"POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    slow.settimeout(30)  # a bound for a failure only: the server closes it after its 1 s header timeout
    assert slow.recv(100) == b""  # closed by the server
    # A body that stalls is ended too, and the server still answers others.
    stall = socket.create_connection(("127.0.0.1", port))
    stall.sendall(b"POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{")
    stall.settimeout(30)
    assert stall.recv(1000).startswith(b"HTTP/1.1 408")  # past the whole-body deadline
    assert httpx.post(url, json={"queries": [word], "topk": 1}).status_code == 200


def test_a_port_in_use_is_one_error_line(retrieval_server, tmp_path):
    import subprocess
    import sys

    from helpers.runs import ENV

    out = subprocess.run([sys.executable, "-m", "srpo.apps.cli", "retriever", "serve", "--corpus", "synthetic_kb:n=10",
                          "--port", str(retrieval_server[0])], env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith("error: cannot listen on")
    assert "in use" in out.stderr


def test_a_study_folder_with_a_planted_link_is_refused_before_any_cell(tmp_path):
    import yaml

    from srpo.apps.study.runner import run_study

    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"model": {"name": "tiny-llama"}, "task": {"kind": "math",
                                        "train": {"source": "synthetic_arithmetic", "level": 0, "n": 4}}}))
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "precious.md"
    target.write_text("precious")
    os.symlink(target, out / "results.md")
    study = {"output_dir": str(out), "base": "base.yaml", "seeds": [0],
             "axes": {"m": [{"label": "srpo", "set": {"method.name": "srpo"}}]},
             "eval": {"k": 1, "datasets": [{"source": "synthetic_arithmetic", "level": 0, "n": 1}]}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(study))
    with pytest.raises(RunDirError, match="symbolic link srpo did not make"):
        run_study(tmp_path / "s.yaml", progress=False)
    assert target.read_text() == "precious" and not (out / "srpo").exists()


def test_a_run_folder_from_before_ownership_records_is_adopted_only_where_srpo_wrote_it(tmp_path):
    run = tmp_path / "old"
    trained(run, ["run.steps=1"])
    (run / ".srpo-owned.json").unlink()  # as written by srpo before the records existed
    (run / "checkpoints" / "user-notes.txt").write_text("mine")  # a foreign file inside: not adopted
    from srpo.runs.run_dir import owned

    assert owned(run) >= {"metrics.jsonl", "samples.jsonl"} and "checkpoints" not in owned(run)
    (run / "checkpoints" / "user-notes.txt").unlink()
    assert "checkpoints" in owned(run)
    trained(run, ["run.steps=1"], overwrite=True)  # the old demo folder case: --overwrite replaces it
    assert steps_logged(run) == [1]


# ---------------------------------------------------------------- Reliability IV (issue: silently wrong)

def test_a_study_grid_that_makes_a_cell_twice_is_refused_before_any_cell_runs(tmp_path):
    from srpo.config import ConfigError
    from srpo.apps.study.schema import load_study

    base = tmp_path / "base.yaml"
    base.write_text("run: {steps: 1}\nmodel: {name: tiny-llama}\n")
    body = (f"output_dir: {tmp_path / 'out'}\nbase: base.yaml\neval: {{k: 2, datasets: []}}\n")
    cases = [("seeds: [0, 0]\naxes: {m: [{label: a}]}\n", "seeds lists 0 more than once"),
             ("seeds: [0]\naxes: {m: [{label: a}, {label: a, set: {train.lr: 0.1}}]}\n", "label 'a' more than once"),
             ("seeds: [0]\naxes: {x: [{label: a-b}, {label: a}], y: [{label: c}, {label: b-c}]}\n",
              "makes cell 'a-b-c' (seed 0) more than once")]
    for text, message in cases:
        study = tmp_path / "study.yaml"
        study.write_text(body + text)
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_study(study)


def test_metrics_saved_by_an_editor_with_a_bom_and_crlf_lose_no_row(tmp_path):
    from srpo.runs.metrics_log import read_metrics

    rows = [{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.25}]
    text = "\r\n".join(json.dumps(r) for r in rows) + "\r\n"
    (tmp_path / "metrics.jsonl").write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert read_metrics(tmp_path) == rows


@pytest.mark.parametrize("gold", ["NaN", "Infinity", "-inf", "1e400"])
def test_non_finite_gold_answers_are_refused_naming_file_and_line(tmp_path, gold):
    from srpo.tasks.base import DatasetError
    from srpo.tasks.math import load_math

    f = tmp_path / "m.jsonl"
    f.write_text(json.dumps({"problem": "1 + 1?", "answer": "2"}) + "\n" + json.dumps({"problem": "x?", "answer": gold}) + "\n")
    with pytest.raises(DatasetError, match=re.escape(f"{f}, line 2: field 'answer' is not a finite number")):
        load_math(f)
    tasks, report = load_math(f, skip_bad_rows=True)
    assert [t.answers for t in tasks] == [("2",)] and report.skipped == 1


def test_checkpoint_files_follow_the_umask(tmp_path):
    """safetensors writes 0600 files whatever the umask: a teammate could not read the weights."""
    import os
    import stat

    from helpers.runs import trained

    old = os.umask(0o022)
    try:
        trained(tmp_path, ["run.steps=1"])
    finally:
        os.umask(old)
    files = [p for p in (tmp_path / "checkpoints").rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in files), \
        {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files if stat.S_IMODE(p.stat().st_mode) != 0o644}


def test_two_questions_under_one_id_get_their_own_groups_or_are_refused(tmp_path, caplog):
    """Concatenated MATH-style files repeat unique_ids: two different problems under one id were put
    in one advantage group.  Renamed with a warning naming file and lines (or refused)."""
    from srpo.config import DataSource
    from srpo.data import load_tasks
    from srpo.tasks.base import DatasetError

    f = tmp_path / "math.jsonl"
    rows = [{"problem": "1 + 1?", "answer": "2", "unique_id": "test/a/1.json"},
            {"problem": "2 + 2?", "answer": "4", "unique_id": "test/a/2.json"},
            {"problem": "3 + 3?", "answer": "6", "unique_id": "test/a/1.json"},  # another problem, same id
            {"problem": "1 + 1?", "answer": "2", "unique_id": "test/a/1.json"}]  # the same problem again
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level("WARNING"):
        tasks = load_tasks(DataSource(source=str(f), n=0), "math", held_out=False)
    ids = [t.task_id for t in tasks]
    assert ids == ["test/a/1.json", "test/a/2.json", "test/a/1.json#3", "test/a/1.json"]
    assert "names two different questions (lines 1 and 3)" in caplog.text and str(f) in caplog.text
    with pytest.raises(DatasetError, match=r"id 'test/a/1.json' names two different questions \(lines 1 and 3\)"):
        load_tasks(DataSource(source=str(f), n=0, duplicate_ids="refuse"), "math", held_out=False)


def test_unreadable_data_files_and_a_missing_include_are_one_line_naming_the_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from srpo.config import ConfigError, read_yaml
    from srpo.tasks.base import DatasetError, read_rows

    whole = tmp_path / "t.parquet"
    pq.write_table(pa.table({"question": ["a"], "answer": ["1"]}), whole)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(DatasetError, match=re.escape(f"{cut}: not a readable parquet file — truncated or damaged?")):
        list(read_rows(cut))
    gz = tmp_path / "rows.jsonl"
    gz.write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(DatasetError, match="a gzip-compressed file; decompress it first"):
        list(read_rows(gz))
    cfg = tmp_path / "run.yaml"
    cfg.write_text("include: base.yaml\nrun: {steps: 1}\n")
    with pytest.raises(ConfigError, match=re.escape(f"{cfg}: include: base.yaml — no such file")):
        read_yaml(cfg)


def test_rewards_run_concurrently_under_a_time_limit():
    """A reward that sleeps held every episode behind it (a step of 2 episodes took 60 s) and Ctrl-C
    behind that.  Rewards now run at once, each in a daemon thread, and one that overruns
    task.reward_timeout_s is a counted failed reward."""
    import threading
    import time

    from srpo.policies.scripted import ScriptedPolicies
    from srpo.tasks.math import synthetic_arithmetic
    from srpo.rollout.builtin import BuiltinEngine
    from srpo.workflows import Runtime, build_workflow

    tasks = synthetic_arithmetic(4, level=0, seed=1)
    wf = build_workflow("single")
    together = threading.Barrier(4, timeout=10)

    def meets_the_others(task, answer):  # passes only if all four rewards run at the same time
        together.wait()
        return 1.0

    rt = Runtime(BuiltinEngine(ScriptedPolicies(lambda role, prompt: "4", wf.roles())), wf.default_role_specs(), meets_the_others)
    results = rt.run(wf, [(f"e{i}", t) for i, t in enumerate(tasks)])
    assert [r.reward for r in results] == [1.0] * 4 and not rt.failures

    release = threading.Event()
    hung = Runtime(BuiltinEngine(ScriptedPolicies(lambda role, prompt: "4", wf.roles())), wf.default_role_specs(),
                   lambda task, answer: release.wait(60) and 1.0, reward_timeout_s=0.3)
    start = time.perf_counter()
    results = hung.run(wf, [(f"e{i}", t) for i, t in enumerate(tasks[:2])])
    release.set()
    assert time.perf_counter() - start < 10, "the hung rewards were waited for"
    assert [r.reward for r in results] == [0.0, 0.0] and all(r.info["reward_timeouts"] == 1 for r in results)
    assert hung.failures["reward"] == 2 and "did not return within 0.3 s" in hung.first_traceback["reward"]


def test_symbolic_answers_grade_right_off_the_main_thread():
    """math-verify times itself out with SIGALRM, which only the main thread may set: in a reward
    thread (or an overlapped rollout's) it raised and every symbolic answer was graded wrong."""
    import threading

    from srpo.tasks.math import answers_equivalent

    out = []
    thread = threading.Thread(target=lambda: out.append(answers_equivalent("\\frac{1}{2}", "0.5")))
    thread.start()
    thread.join()
    assert out == [True] and answers_equivalent("\\frac{1}{2}", "0.5")


@pytest.mark.slow
def test_a_lost_terminal_saves_and_exits_143_like_sigterm(tmp_path):
    """SIGHUP (the terminal went away) used to leave a run writing to a dead terminal — a run that
    trained every step ended with exit 1.  It is handled like SIGTERM: saved at the step's end,
    exit 143, and --resume continues."""
    import signal

    run = tmp_path / "run"
    proc = _popen_train(run, ["run.steps=40", "checkpoint.every=0"])
    _wait_for_step(run, 2, proc)
    proc.send_signal(signal.SIGHUP)
    proc.communicate(timeout=60)
    assert proc.returncode == 143
    stopped_at = steps_logged(run)[-1]
    assert 2 <= stopped_at < 40 and (run / "checkpoints" / f"step_{stopped_at:07d}").is_dir()


def test_a_failed_write_is_one_line_naming_the_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    import errno
    import subprocess
    import sys

    from srpo.runs import fileio

    target = tmp_path / "results.md"
    target.write_text("old")
    real_fsync = os.fsync

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.os, "fsync", full_disk)
    with pytest.raises(fileio.WriteError, match=re.escape(f"cannot write {target}: the disk is full")):
        fileio.write_text_atomic(target, "new")
    monkeypatch.setattr(fileio.os, "fsync", real_fsync)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["results.md"]

    # Leftovers of a writer that died are removed when the folder is next claimed; a live
    # writer's (another shard's), and files that only look alike, are not.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".results.md.tmp{int(dead.stdout)}"
    live = tmp_path / f".results.json.tmp{os.getppid()}"
    theirs = tmp_path / f".notes.txt.tmp{int(dead.stdout)}"
    for p in (stale, live, theirs):
        p.write_text("x")
    assert fileio.remove_stale_temp_files(tmp_path, ("results.md", "results.json")) == [stale]
    assert live.exists() and theirs.exists()


def test_a_full_disk_in_the_command_line_is_exit_2_naming_the_file(tmp_path, capsys, monkeypatch):
    import errno

    from srpo.apps import cli

    def fails(args):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "metrics.jsonl"))

    monkeypatch.setattr(cli, "_report", fails, raising=False)
    parser = cli.build_parser()
    args = parser.parse_args(["report", str(tmp_path)])
    monkeypatch.setattr(args, "func", fails)
    monkeypatch.setattr(parser, "parse_args", lambda argv=None: args)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    assert cli.main(["report", str(tmp_path)]) == 2
    assert f"error: cannot write {tmp_path / 'metrics.jsonl'}: the disk is full" in capsys.readouterr().err


def test_a_planted_ownership_record_cannot_make_overwrite_delete_a_users_folder(tmp_path):
    """The record is a file in the folder: a name in it that srpo never writes is not deleted."""
    run = tmp_path / "run"
    trained(run, ["run.steps=1"])
    (run / "Documents").mkdir()
    (run / "Documents" / "thesis.tex").write_text("years of work")
    record = json.loads((run / ".srpo-owned.json").read_text())
    (run / ".srpo-owned.json").write_text(json.dumps({"created": [*record["created"], "Documents"]}))
    trained(run, ["run.steps=1"], overwrite=True)
    assert (run / "Documents" / "thesis.tex").read_text() == "years of work"
