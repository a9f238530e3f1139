"""Reliability II: a run folder is never mixed, Ctrl-C never hangs, every failure is a message."""

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from srpo.policies.scripted import ScriptedPolicies
from srpo.tasks.math import synthetic_arithmetic
from srpo.tasks.rewards import task_reward
from srpo.rollout.builtin import BuiltinEngine
from srpo.workflows import Runtime
from srpo.workflows.builtins import Workflow
from helpers import HELPERS
from helpers.runs import ENV, cli_train, steps_logged, tiny, trained, varied_reward  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------- 1. Ctrl-C never hangs a rollout

class InterruptedEarly(Workflow):
    """Episode 0 asks (its request waits in the batcher's queue) and then Ctrl-C arrives, before
    the other episodes have run a line: the moment at which the batcher used to wait forever."""

    name = "interrupted_early"

    def roles(self):
        return ["solver"]

    async def run(self, ctx, task):
        if ctx.episode_id == "e0":
            signal.raise_signal(signal.SIGINT)  # asyncio.run's handler cancels the main task
        return (await ctx.ask("solver", task.question)).text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("episodes", [2, 3, 8])
def test_ctrl_c_while_episodes_have_not_started_raises_instead_of_hanging(episodes):
    wf = InterruptedEarly()
    rt = Runtime(BuiltinEngine(ScriptedPolicies(lambda role, prompt: "\\boxed{1}", wf.roles())), wf.default_role_specs(), task_reward)
    tasks = synthetic_arithmetic(episodes, level=1, seed=0)
    outcome = {}

    def target():
        try:
            rt.run(wf, [(f"e{i}", t) for i, t in enumerate(tasks)])
            outcome["result"] = "returned"
        except KeyboardInterrupt:
            outcome["result"] = "KeyboardInterrupt"
        except BaseException as err:  # noqa: BLE001 - report whatever it was
            outcome["result"] = repr(err)

    # signal.raise_signal needs the main thread's handler, so run in the main thread but watch it.
    def hung():
        outcome["hung"] = True
        os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C: asyncio.run raises at once

    watchdog = threading.Timer(10, hung)
    watchdog.start()
    # Ctrl-C as in a terminal, also when the suite itself runs in the background (`cmd &` starts
    # it with SIGINT ignored, and asyncio.run then installs no handler).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        target()
    finally:
        watchdog.cancel()
        signal.signal(signal.SIGINT, previous)
    assert "hung" not in outcome, "the rollout hung after Ctrl-C"
    assert outcome["result"] == "KeyboardInterrupt"
    # The runtime is reusable after an interruption.
    rt2 = Runtime(BuiltinEngine(ScriptedPolicies(lambda role, prompt: "\\boxed{1}", wf.roles())), wf.default_role_specs(), task_reward)
    assert len(rt2.run(InterruptedLater(), [("x", tasks[0])])) == 1


class InterruptedLater(InterruptedEarly):
    async def run(self, ctx, task):
        return (await ctx.ask("solver", task.question)).text


# ------------------------------------------------------------------------------------ helpers

import torch  # noqa: E402

from srpo.runs import checkpoint as ckpt  # noqa: E402
from srpo.apps.cli import main  # noqa: E402
from srpo.build import load_config  # noqa: E402
from srpo.config import ConfigError  # noqa: E402
from srpo.runs.metrics_log import read_metrics  # noqa: E402
from srpo.runs.run_dir import RunDirError, RunLock  # noqa: E402
from srpo.train import Trainer, TrainingStopped  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"




# ------------------------------------------------------------- 2. two runs in one folder, and the lock

@pytest.mark.slow
def test_a_second_process_on_the_same_run_folder_is_refused(tmp_path):
    run = tmp_path / "run"
    # The first run's rewards wait at a gate the test opens only after the second has been refused:
    # the first lives while the second starts, however loaded the machine is.
    gate = tmp_path / "open"
    slow_env = {**ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{HELPERS}", "SRPO_TEST_REWARD_GATE": str(gate)}
    first = subprocess.Popen(cli_train(run, ["run.steps=3", "task.reward=slow_reward:reward"]), env=slow_env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not ((run / ".lock").is_file() and (run / ".lock").read_text().strip()) and time.time() < deadline:
        time.sleep(0.05)
    second = subprocess.run(cli_train(run, ["run.steps=6", "run.seed=1"]), env=ENV, capture_output=True, text=True,
                            timeout=300)
    gate.touch()
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-2000:]
    assert second.returncode == 2
    assert f"is in use by another srpo run (pid {first.pid}" in second.stderr
    assert "Traceback" not in second.stderr
    assert steps_logged(run) == [1, 2, 3]  # one run's rows, once each


def test_a_stale_lock_of_a_killed_run_is_taken_over(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").write_text(json.dumps({"pid": 999999, "host": "elsewhere", "started": "2026-01-01T00:00:00"}))
    with caplog.at_level("WARNING"):
        trainer = trained(run, ["run.steps=1"])
    assert trainer.step == 1 and "took over the stale lock" in caplog.text and "999999" in caplog.text
    assert (run / ".lock").read_text() == ""  # released


def test_the_lock_is_held_for_the_trainers_life(tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(load_config(None, tiny(run)), progress=False)
    with pytest.raises(RunDirError, match="in use by another srpo run"):
        RunLock(run).acquire()
    trainer.close()
    RunLock(run).acquire().release()


# --------------------------------------------------- 3. a rerun without --resume into a finished run

@pytest.mark.slow
def test_a_rerun_into_a_finished_run_is_refused_unless_overwritten(tmp_path):
    run = tmp_path / "run"
    assert subprocess.run(cli_train(run, ["run.steps=4"]), env=ENV, capture_output=True, timeout=300).returncode == 0
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    again = subprocess.run(cli_train(run, ["run.steps=3"]), env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "holds a previous run (metrics.jsonl" in again.stderr
    assert "--resume" in again.stderr and "--overwrite" in again.stderr
    assert steps_logged(run) == [1, 2, 3, 4] and sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    both = subprocess.run(cli_train(run, flags=["--resume", "--overwrite"]), env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert both.returncode == 2 and "choose one" in both.stderr
    (run / "notes.txt").write_text("mine")
    fresh = subprocess.run(cli_train(run, ["run.steps=3"], ["--overwrite"]), env=ENV, capture_output=True, text=True,
                           timeout=300)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert steps_logged(run) == [1, 2, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_0000002", "step_0000003"]
    assert (run / "checkpoints" / "latest").read_text() == "step_0000003"
    assert (run / "notes.txt").read_text() == "mine"  # only the run's own artefacts are deleted


# ---------------------------------------- 4. killed before the first checkpoint, then --resume

def test_resume_without_a_checkpoint_starts_the_logs_over(tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(load_config(None, tiny(run, ["checkpoint.every=0", "run.steps=2"])), progress=False,
                      reward_fn=varied_reward)
    trainer.train_step()
    trainer.train_step()  # killed here: two steps logged, no checkpoint written
    trainer.close()
    assert steps_logged(run) == [1, 2] and not (run / "checkpoints").exists()
    again = Trainer(load_config(None, tiny(run, ["checkpoint.every=0", "run.steps=3"])), progress=False,
                    reward_fn=varied_reward)
    assert again.resume() is False
    assert steps_logged(run) == [] and (run / "samples.jsonl").read_text() == ""
    again.fit()
    again.close()
    assert steps_logged(run) == [1, 2, 3]
    assert [json.loads(line)["step"] for line in (run / "samples.jsonl").read_text().splitlines()] == [1, 1, 2, 2, 3, 3]


# ------------------------------------------------------------- 5. a cut-off last line in the logs

def test_a_cut_off_last_line_neither_blocks_resume_nor_report(tmp_path):
    run = tmp_path / "run"
    trained(run, ["run.steps=2"])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward": 0.5, "accura')  # a write cut off by a full disk
    with open(run / "samples.jsonl", "a") as f:
        f.write('{"step": 3, "episo')
    assert main(["report", str(run)]) == 0
    assert steps_logged(run) == [1, 2]
    trainer = Trainer(load_config(None, tiny(run, ["run.steps=3"])), progress=False, reward_fn=varied_reward)
    assert trainer.resume() and trainer.step == 2
    trainer.fit()
    trainer.close()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    assert all(json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines())


def test_an_append_after_a_cut_off_line_starts_on_a_line_of_its_own(tmp_path):
    from srpo.runs.metrics_log import MetricsLogger

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "rew')
    MetricsLogger(tmp_path, backends=[]).log(3, {"reward": 1.0})
    assert steps_logged(tmp_path) == [1, 3]


def _small_filesystem(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()[:80]}); the injected-error "
                    f"tests cover the same paths")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small file system needs root")
def test_a_fresh_run_on_a_full_disk_names_the_file_and_leaves_no_lock(tmp_path, capsys):
    """The very first write of a run (its lock's record) fails on a full disk: the error names the
    file and the cause, and nothing of the run is left — no lock file, no empty folder.  A start
    that fails later (a data file that is not there) releases and removes its lock too."""
    disk = tmp_path / "disk"
    _small_filesystem(disk, "64k")
    try:
        with open(disk / "filler", "wb", buffering=0) as f:  # unbuffered: nothing left to fail at close
            try:
                while True:
                    f.write(b"x" * 4096)
            except OSError:
                pass
        run = disk / "run"
        assert main(["train", "--config", "configs/math/single/srpo.yaml", *[x for o in tiny(run) for x in ("--set", o)]]) == 2
        assert f"error: cannot write {run / '.lock'}: the disk is full" in capsys.readouterr().err
        assert not run.exists()
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    run = tmp_path / "run"
    missing = ["task.train.source=" + str(tmp_path / "nowhere.jsonl")]
    assert main(["train", "--config", "configs/math/single/srpo.yaml",
                 *[x for o in tiny(run, missing) for x in ("--set", o)]]) == 2
    assert "nowhere.jsonl" in capsys.readouterr().err and not (run / ".lock").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small file system needs root")
def test_a_real_full_disk_cuts_a_metrics_line_and_a_checkpoint_then_resume_works(tmp_path):
    """A real 3 MiB file system: the checkpoint write fails cleanly, a metrics row is cut off by
    ENOSPC mid-line; after space is freed, --resume continues from the last good checkpoint."""
    disk = tmp_path / "disk"
    _small_filesystem(disk, "3m")
    try:
        run = disk / "run"
        trainer = Trainer(load_config(None, tiny(run, ["run.steps=2", "checkpoint.every=0"])), progress=False,
                          reward_fn=varied_reward)
        trainer.fit()  # step_0000002 (~1.2 MB) fits
        filler = disk / "filler"
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        filler.write_bytes(b"x" * max(free - 64_000, 0))  # room for a step's log rows, not a checkpoint
        with pytest.raises(ckpt.CheckpointError, match="No space left on device.*step_0000002 is intact"):
            trainer.cfg.run.steps = 3
            trainer.fit()  # step 3 logs, then its checkpoint does not fit
        while True:  # fill the disk to the byte, then a metrics row is written half
            try:
                with open(disk / "filler2", "ab") as f:
                    f.write(b"y" * 256)
            except OSError:
                break
        with pytest.raises(OSError):
            trainer.logger.log(4, {"reward": 0.25, "long": "z" * 4000})
        trainer.close()
        raw = (run / "metrics.jsonl").read_bytes()
        assert not raw.endswith(b"\n")  # really cut off mid-line
        assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
        filler.unlink()
        (disk / "filler2").unlink()
        again = Trainer(load_config(None, tiny(run, ["run.steps=3", "checkpoint.every=0"])), progress=False,
                        reward_fn=varied_reward)
        assert again.resume() and again.step == 2
        again.fit()
        again.close()
        assert steps_logged(run) == [1, 2, 3]
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)  # lazy: a failed test may hold files open


def test_torch_s_disk_full_message_becomes_a_checkpoint_error(tmp_path, monkeypatch):
    trainer = trained(tmp_path / "run", ["run.steps=1"])

    def enforce_fail(obj, path, *a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(ckpt.torch, "save", enforce_fail)
    trainer.step = 2
    with pytest.raises(ckpt.CheckpointError, match=r"could not write checkpoint .*step_0000002 .*step_0000001 is intact"):
        trainer.save()


# ------------------------------------------------------------- 6. non-finite settings and weights

@pytest.mark.parametrize("override, message", [
    ("train.lr=.inf", "train.lr: expected a finite number"),
    ("train.lr=.nan", "train.lr: expected a finite number"),
    ("train.lr=-1e-5", "train.lr: must be > 0"),
    ("train.betas=[1.5, 0.9]", r"train.betas: two numbers in \[0, 1\)"),
    ("train.betas=[0.9]", r"train.betas: two numbers in \[0, 1\)"),
    ("train.weight_decay=.nan", "train.weight_decay: expected a finite number"),
    ("method.clip_eps=.inf", "method.clip_eps: expected a finite number"),
    ("train.max_grad_norm=-1", "train.max_grad_norm: must be ≥ 0"),
    ("eval.temperature=-0.5", "eval.temperature: must be ≥ 0"),
])
def test_impossible_numbers_fail_validation(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_nan_weights_are_never_saved(tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(load_config(None, tiny(run, ["run.steps=2"])), progress=False, reward_fn=varied_reward)
    trainer.fit(steps=1)
    with torch.no_grad():
        trainer.policies.parameters("shared")[0].fill_(float("inf"))  # what lr=inf did after one step
    with pytest.raises(TrainingStopped, match="weights hold NaN/Inf after step 2; no checkpoint was written"):
        trainer.fit()
    trainer.close()
    assert ckpt.latest_checkpoint(run).name == "step_0000001"


# ------------------------------------------------------------------- 7. damaged checkpoints

@pytest.mark.parametrize("victim", ["model/shared/model.safetensors", "trainer_state.pt", "trainer_state.json"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous(tmp_path, victim, caplog):
    run = tmp_path / "run"
    reference = trained(run, ["run.steps=2"])
    latest = run / "checkpoints" / "step_0000002"
    data = (latest / victim).read_bytes()
    (latest / victim).write_bytes(data[: len(data) // 2])  # truncated
    trainer = Trainer(load_config(None, tiny(run, ["run.steps=2"])), progress=False, reward_fn=varied_reward)
    with caplog.at_level("WARNING"):
        assert trainer.resume()
    assert trainer.step == 1
    assert f"{victim} is {len(data) // 2} bytes, the manifest says {len(data)}" in caplog.text
    assert "resumed from the older checkpoint step_0000001" in caplog.text
    trainer.close()
    del reference


def test_a_same_size_corruption_is_caught_by_the_digest(tmp_path, caplog):
    run = tmp_path / "run"
    trained(run, ["run.steps=2"])
    p = run / "checkpoints" / "step_0000002" / "model" / "shared" / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[-10] ^= 0xFF
    p.write_bytes(bytes(data))
    trainer = Trainer(load_config(None, tiny(run, ["run.steps=2"])), progress=False)
    with caplog.at_level("WARNING"):
        assert trainer.resume() and trainer.step == 1
    assert "does not match its SHA-256" in caplog.text
    trainer.close()


def test_no_usable_checkpoint_is_an_error_that_names_each_problem(tmp_path, capsys):
    run = tmp_path / "run"
    trained(run, ["run.steps=2"])
    for step in ("step_0000001", "step_0000002"):
        (run / "checkpoints" / step / "manifest.json").unlink()
    code = main(["train", "--config", str(ROOT / "configs/math/single/srpo.yaml"),
                 *[x for o in tiny(run) for x in ("--set", o)], "--resume"])
    assert code == 2
    err = capsys.readouterr().err
    assert "no usable checkpoint to resume from" in err
    assert "step_0000001: no manifest.json" in err and "step_0000002: no manifest.json" in err


# ----------------------------------------------------------------- 8. evaluating model folders

def test_eval_of_a_plain_hf_folder_a_checkpoints_model_and_a_run_folder(tmp_path, capsys):
    from srpo.policies import load_model

    model, tok = load_model("tiny-llama")
    plain = tmp_path / "plain"
    model.save_pretrained(plain)
    tok.save_pretrained(plain)
    run = tmp_path / "run"
    trained(run, ["run.steps=1"])
    data = ["--data", "synthetic_arithmetic:level=1:n=2:seed=5", "-k", "1", "--max-new-tokens", "3"]
    assert main(["eval", "--model", str(plain), *data]) == 0
    assert main(["eval", "--model", str(run / "checkpoints" / "step_0000001" / "model" / "shared"), *data]) == 0
    capsys.readouterr()
    assert main(["eval", "--model", str(run), *data]) == 0
    assert f"evaluating checkpoint {run / 'checkpoints' / 'step_0000001'}" in capsys.readouterr().err
    assert main(["eval", "--model", str(tmp_path / "nowhere"), *data]) == 2


# ------------------------------------------------------------ 9, 10. inputs that used to traceback

def test_non_utf8_config_and_dataset_are_named(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_bytes(b"run:\n  steps: 2\n  output_dir: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"bad.yaml, line 3: not UTF-8 text \(byte 0xe9"):
        load_config(cfg)
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"question": "1+1?", "answer": "#### 2"}\n{"question": "caf\xe9", "answer": "#### 3"}\n')
    from srpo.tasks import DatasetError

    cfg = load_config(None, tiny(tmp_path / "run", [f"task.train.source={data}"]))
    with pytest.raises(DatasetError, match=r"d.jsonl, line 2: not UTF-8 text"):
        Trainer(cfg, progress=False)


def test_empty_config_and_include_forms(tmp_path):
    (tmp_path / "empty.yaml").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="the config file is empty"):
        load_config(tmp_path / "empty.yaml")
    (tmp_path / "a.yaml").write_text("run: {steps: 5}\n")
    (tmp_path / "b.yaml").write_text("run: {seed: 7}\ntrain: {lr: 0.001}\n")
    (tmp_path / "top.yaml").write_text("include: [a.yaml, b.yaml]\ntrain: {lr: 0.002}\n")
    cfg = load_config(tmp_path / "top.yaml")
    assert (cfg.run.steps, cfg.run.seed, cfg.train.lr) == (5, 7, 0.002)
    (tmp_path / "bad.yaml").write_text("include: {file: a.yaml}\n")
    with pytest.raises(ConfigError, match="include: must be a file name or a list"):
        load_config(tmp_path / "bad.yaml")


@pytest.mark.parametrize("flag", [["-k", "0"], ["--n", "-1"], ["--temperature", "-1"], ["--temperature", "nan"]])
def test_eval_arguments_are_checked(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--model", "tiny-llama", "--data", "synthetic_arithmetic:n=2", *flag])
    assert exit_.value.code == 2 and flag[0] in capsys.readouterr().err


def test_report_of_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl rows" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "absent")]) == 2


def test_models_prepare_into_an_unwritable_cache_fails_at_once(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SRPO_CACHE", str(blocker / "cache"))  # unwritable for root too
    start = time.perf_counter()
    assert main(["models", "prepare", "smollm2-135m"]) == 2
    assert time.perf_counter() - start < 5
    assert "cannot write the model cache" in capsys.readouterr().err


def test_an_unknown_model_name_fails_fast(monkeypatch, capsys):
    start = time.perf_counter()
    assert main(["eval", "--model", "no-such-model-xyz", "--data", "synthetic_arithmetic:n=2", "-k", "1"]) == 2
    assert time.perf_counter() - start < 15
    err = capsys.readouterr().err
    assert "no-such-model-xyz" in err and "smollm2-135m" in err


def test_an_unexpected_error_is_one_line_unless_verbose(monkeypatch, capsys):
    import srpo.apps.cli as cli

    def broken(args):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(cli, "_report", broken)
    assert main(["report", "x"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "error: ZeroDivisionError: division by zero — unexpected; run with -v for the traceback"
    assert main(["-v", "report", "x"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_ctrl_c_in_a_command_exits_130_without_a_traceback(monkeypatch, capsys):
    import srpo.apps.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_report", interrupted)
    assert main(["report", "x"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


# ------------------------------------------------------------------- 11. the wrong grader

def test_a_dataset_under_the_wrong_grader_is_refused(tmp_path):
    from srpo.config import DataSource
    from srpo.data import guess_kind, load_tasks
    from srpo.tasks import DatasetError

    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}) + "\n"
                           for i in range(5)))
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"question": f"who {i}?", "answer": name}) + "\n"
                          for i, name in enumerate(["Kauffman Stadium", "The Home Rule League", "five", "Paris", "1974"])))
    with pytest.raises(DatasetError, match="looks like a math dataset, not QA"):
        load_tasks(DataSource(source=str(gsm), n=0), "qa", held_out=False)
    with pytest.raises(DatasetError, match="looks like a QA dataset, not math.*'Kauffman Stadium'"):
        load_tasks(DataSource(source=str(qa), n=0), "math", held_out=False)
    assert guess_kind(DataSource(source=str(gsm))) == "math" and guess_kind(DataSource(source=str(qa))) == "qa"
    assert len(load_tasks(DataSource(source=str(gsm), n=0), "math", held_out=False)) == 5


@pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared/data")
def test_the_real_datasets_fit_their_own_grader_only():
    from srpo.config import DataSource
    from srpo.data import guess_kind, load_tasks
    from srpo.tasks import DatasetError

    for name, kind in [("gsm8k_test", "math"), ("math500_test", "math"), ("hotpotqa_dev500", "qa"),
                       ("musique_dev500", "qa"), ("2wikimultihopqa_dev500", "qa"), ("bamboogle_test", "qa")]:
        src = DataSource(source=str(SHARED / f"{name}.jsonl"), n=0)
        assert guess_kind(src) == kind, name
        assert load_tasks(src, kind, held_out=False)
        with pytest.raises(DatasetError):
            load_tasks(src, "qa" if kind == "math" else "math", held_out=False)


# --------------------------------------------------------- 12. data paths relative to the config

@pytest.mark.skipif(not SHARED.is_dir(), reason="the paper configs name ../shared/data")
@pytest.mark.parametrize("cwd", ["repo", "elsewhere"])
def test_paper_configs_validate_from_any_directory(cwd, tmp_path, monkeypatch):
    import importlib.util

    from srpo.config import ConfigError

    monkeypatch.chdir(ROOT if cwd == "repo" else tmp_path)
    has_vllm = importlib.util.find_spec("vllm") is not None
    for path in sorted((ROOT / "configs" / "paper").glob("*.yaml")):
        if path.name.startswith("study_"):
            continue
        if not has_vllm:  # the paper configs sample with vLLM: a machine without it is told what to install
            with pytest.raises(ConfigError, match=r"rollout.engine: vllm needs vllm, which is not installed \(pip install 'srpo\[vllm\]'"):
                load_config(path)
        cfg = load_config(path, [] if has_vllm else ["rollout.engine=builtin"])
        for src in cfg.task.eval:
            if not src.source.startswith(("hub:", "synthetic_")):
                assert Path(src.source).is_file(), (path.name, src.source)


def test_set_overrides_resolve_against_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "cfgs").mkdir()
    (tmp_path / "data.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    (tmp_path / "cfgs" / "c.yaml").write_text("task: {train: {source: ../data.jsonl, n: 0}}\n")
    monkeypatch.chdir(tmp_path / "cfgs")
    assert Path(load_config("c.yaml").task.train.source).resolve() == (tmp_path / "data.jsonl").resolve()
    monkeypatch.chdir(tmp_path)
    assert load_config("cfgs/c.yaml", ["task.train.source=data.jsonl"]).task.train.source == "data.jsonl"


# ------------------------------------------------------- 13. leftovers of a killed checkpoint write

def test_a_killed_writers_temporary_folder_is_removed_and_modes_are_normal(tmp_path):
    run = tmp_path / "run"
    trained(run, ["run.steps=1"])
    stale = run / "checkpoints" / ".step_0000002-abc123"
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "big.bin").write_bytes(b"0" * 1000)
    trainer = Trainer(load_config(None, tiny(run, ["run.steps=2"])), progress=False)
    assert not stale.exists()
    trainer.close()
    umask = os.umask(0)
    os.umask(umask)
    mode = (run / "checkpoints" / "step_0000001").stat().st_mode & 0o777
    assert mode == 0o777 & ~umask


# ------------------------------------------------------------------ 14. no code in a checkpoint

class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def _vouch_for(checkpoint, name: str, manifest: dict | None = None) -> None:
    """Rewrite ``checkpoint``'s manifest (or write ``manifest``) so that it vouches for the file
    ``name`` as it is now — what a crafted or foreign folder would hold."""
    from srpo.runs.fileio import sha256_file

    manifest = manifest if manifest is not None else json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = {"size": (checkpoint / name).stat().st_size, "sha256": sha256_file(checkpoint / name)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_a_crafted_pickle_in_the_trainer_state_is_refused_not_run(tmp_path, caplog):
    import pickle

    run = tmp_path / "run"
    trained(run, ["run.steps=1"])
    latest = run / "checkpoints" / "step_0000001"
    marker = tmp_path / "marker"
    state = latest / "trainer_state.pt"
    with open(state, "wb") as f:
        pickle.dump({"optimizers": _Payload(str(marker))}, f)
    _vouch_for(latest, "trainer_state.pt")  # the attacker rewrites the manifest too: size and digest pass
    trainer = Trainer(load_config(None, tiny(run, ["run.steps=2"])), progress=False)
    with pytest.raises(ckpt.CheckpointError, match="refused, not loaded"):
        trainer.resume()
    trainer.close()
    assert not marker.exists()
    assert main(["eval", "--model", str(run), "--data", "synthetic_arithmetic:level=1:n=1", "-k", "1",
                 "--max-new-tokens", "2"]) == 0  # eval reads the weights only
    assert not marker.exists()


# ------------------------------------------------------------------------ the fault soak, briefly

@pytest.mark.slow
def test_fault_soak_in_brief(tmp_path):
    """Two random kills (the full soak in benchmarks/ does 20+), resumed to the clean run's bits."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from fault_soak import soak
    finally:
        sys.path.pop(0)
    summary = soak(tmp_path / "soak", kills=2, steps=40, seed=3, max_delay=0.3, sigint_timeout=30, log=lambda *_: None)
    assert summary["kills"] >= 2 and summary["sigint_hangs"] == 0
    assert summary["weights_bit_equal"] and summary["metrics_equal"] and summary["samples_equal"]
    assert summary["ok"], {k: v for k, v in summary.items() if k != "events"}


def test_a_checkpoint_without_its_manifest_or_fingerprint_is_refused_by_name(tmp_path, capsys):
    """Nothing is released that wrote checkpoints without them: eval and resume refuse such a
    folder with the reason, and nothing of it is read."""
    run = tmp_path / "run"
    trained(run, ["run.steps=1"])
    latest = run / "checkpoints" / "step_0000001"
    manifest_text = (latest / "manifest.json").read_text()
    (latest / "manifest.json").unlink()
    assert main(["eval", "--model", str(latest), "--data", "synthetic_arithmetic:level=1:n=1", "-k", "1",
                 "--max-new-tokens", "2"]) != 0
    assert "step_0000001: no manifest.json (an incomplete checkpoint" in capsys.readouterr().err

    state = latest / "trainer_state.json"  # a manifest that vouches for a state without a fingerprint
    plain = json.loads(state.read_text())
    # the run's parts, each entry holding a tensor in the torch file, the rest in JSON
    assert list(plain) == ["counters", "data", "update", "rng"]
    tensors = torch.load(latest / "trainer_state.pt", weights_only=True)
    assert set(tensors) == {"update", "rng"} and set(tensors["update"]) == {"optimizers"}
    assert set(plain["update"]) == {"schedulers", "nonfinite_in_a_row"} and plain["counters"]["step"] == 1
    assert plain["data"].pop("fingerprint")
    state.write_text(json.dumps(plain))
    _vouch_for(latest, "trainer_state.json", json.loads(manifest_text))
    trainer = Trainer(load_config(None, tiny(run, ["run.steps=2"])), progress=False)
    with pytest.raises(ckpt.CheckpointError, match="records no data fingerprint"):
        trainer.resume()
    trainer.close()


@pytest.mark.parametrize("limit", [300_000, 500_000], ids=["safetensors-file", "torch-zip-file"])
def test_a_checkpoint_over_the_file_size_limit_names_the_limit(tmp_path, limit):
    """``ulimit -f`` below a checkpoint file's size: the message names the limit (the writers say
    only "File too large" inside their own text, or torch's "unexpected pos"), not a free-space
    figure that points the wrong way; the run's log rows are intact."""
    import resource

    run = tmp_path / "run"
    done = subprocess.run(cli_train(run), env=ENV, capture_output=True, text=True, timeout=600,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert f"file-size limit of {limit} bytes (ulimit -f)" in last and "free on that disk" not in last, last
    assert "step_0000001" in last and steps_logged(run) == [1]


@pytest.mark.parametrize("code, words", [
    (errno.EDQUOT, "quota is used up"), (errno.EROFS, "read-only"), (errno.EFBIG, "ulimit -f"),
    (errno.ENOSPC, "the disk is full"),
])
def test_every_disk_error_names_its_cause(tmp_path, code, words):
    from srpo.runs.fileio import write_error

    err = write_error(OSError(code, os.strerror(code)), tmp_path / "metrics.jsonl")
    assert words in str(err) and str(tmp_path / "metrics.jsonl") in str(err)


def test_inodes_exhausted_are_told_apart_from_a_full_disk(tmp_path, monkeypatch):
    """ENOSPC with space left but no free inode says so (``df -i``), not 'the disk is full'."""
    from srpo.runs.fileio import write_error

    real = os.statvfs(tmp_path)
    fake = os.statvfs_result((real.f_bsize, real.f_frsize, real.f_blocks, real.f_bfree, real.f_bavail,
                              1000, 0, 0, real.f_flag, real.f_namemax))
    monkeypatch.setattr(os, "statvfs", lambda path: fake)
    message = str(write_error(OSError(errno.ENOSPC, "No space left on device"), tmp_path / "x"))
    assert "no free inodes" in message and "df -i" in message and "disk is full" not in message
