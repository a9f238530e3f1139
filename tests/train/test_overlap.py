"""rollout.max_staleness: 1 — the next step's rollout overlaps this step's update, one version
behind; it trains, logs its staleness, and a killed run resumes exactly."""

import signal
import subprocess
import time

import pytest
import torch

from srpo.build import config_from_dict, load_config
from srpo.config import ConfigError
from srpo.runs.metrics_log import read_metrics
from srpo.train import Trainer
from helpers.overlap_worker import fit_until
from helpers.runs import ENV, cli_train, steps_logged, tiny, varied_reward
from helpers import HELPERS

STALE = ["rollout.max_staleness=1", "run.threads=1"]


def _final_weights(run):
    from safetensors.torch import load_file

    newest = sorted((run / "checkpoints").glob("step_*"))[-1]
    return {k: v for f in sorted((newest / "model").rglob("*.safetensors")) for k, v in load_file(f).items()}


def _run(run, extra, kill_after=None, resume=False):
    return fit_until(Trainer(load_config(None, tiny(run, extra)), progress=False, reward_fn=varied_reward),
                     kill_after, resume)


def test_staleness_one_overlaps_logs_its_staleness_and_resumes_exactly(tmp_path):
    steps = ["run.steps=5", *STALE]
    ref = _run(tmp_path / "ref", steps)
    rows = read_metrics(tmp_path / "ref")
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1, 1, 1]
    assert all(r["rollout/staleness_mean"] <= r["rollout/staleness_max"] <= 1 for r in rows)
    assert all(r["time/overlap_s"] > 0 for r in rows[:-1]) and rows[-1]["time/overlap_s"] == 0  # none after the last
    # Every member records the version it was sampled with: one behind the weights it updates.
    assert ref.policies.version("shared") == 5
    _run(tmp_path / "cut", steps, kill_after=3)
    assert steps_logged(tmp_path / "cut") == [1, 2, 3]
    _run(tmp_path / "cut", steps, resume=True)
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))}  # noqa: E731
    assert [strip(r) for r in read_metrics(tmp_path / "cut")] == [strip(r) for r in rows]
    a, b = _final_weights(tmp_path / "ref"), _final_weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_staleness_zero_is_the_synchronous_loop(tmp_path):
    rows0 = read_metrics((_run(tmp_path / "a", ["run.steps=2", "run.threads=1"]), tmp_path / "a")[1])
    rows1 = read_metrics((_run(tmp_path / "b", ["run.steps=2", "run.threads=1", "rollout.max_staleness=0"]),
                          tmp_path / "b")[1])
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))}  # noqa: E731
    assert [strip(r) for r in rows0] == [strip(r) for r in rows1]
    assert all(r["rollout/staleness_max"] == 0 and "time/overlap_s" not in r for r in rows0)


@pytest.mark.slow
def test_a_run_killed_with_a_rollout_in_flight_resumes_without_losing_or_repeating_an_episode(tmp_path):
    extra = ["run.steps=8", *STALE]
    assert subprocess.run(cli_train(tmp_path / "ref", extra), env=ENV, capture_output=True, timeout=600).returncode == 0
    victim = tmp_path / "victim"
    proc = subprocess.Popen(cli_train(victim, extra), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(steps_logged(victim) if (victim / "metrics.jsonl").exists() else []) < 3:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)  # mid-step: an update and the next rollout in flight
    proc.wait()
    again = subprocess.run(cli_train(victim, extra, ["--resume"]), env=ENV, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))}  # noqa: E731
    assert [strip(r) for r in read_metrics(victim)] == [strip(r) for r in read_metrics(tmp_path / "ref")]
    episodes = lambda run: [(row["step"], row["episode"], row["answer"]) for row in _samples(run)]  # noqa: E731
    assert episodes(victim) == episodes(tmp_path / "ref")  # each logged once, in order, the same samples
    a, b = _final_weights(tmp_path / "ref"), _final_weights(victim)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _samples(run):
    import json

    return [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("extra, match", [
    ({"train": {"parallel": "fsdp"}}, "max_staleness: 1 with train.parallel: fsdp needs an engine that holds its own copy"),
    ({"rollout": {"engine": "vllm", "max_staleness": 1, "sleep_during_update": True}, "run": {"device": "cuda"}},
     "sleep_during_update with rollout.max_staleness: 1"),
])
def test_what_the_overlap_cannot_combine_with_is_refused(extra, match):
    data = {"model": {"name": "tiny-llama"}, "task": {"kind": "math", "train": {"source": "synthetic_arithmetic"}},
            "rollout": {"max_staleness": 1}}
    for key, value in extra.items():
        data.setdefault(key, {}).update(value)
    with pytest.raises(ConfigError, match=match):
        config_from_dict(data)


@pytest.mark.slow
@pytest.mark.torchrun
def test_staleness_one_trains_under_ddp(tmp_path):
    import shutil
    import sys
    from pathlib import Path

    from helpers.runs import free_port
    from helpers import ROOT

    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun is not installed")
    run = tmp_path / "run"
    cmd = [str(torchrun if torchrun.exists() else "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "srpo.apps.cli", "train", "--config", str(ROOT / "configs/math/single/srpo.yaml"),
           *[x for o in tiny(run, ["run.steps=3", "rollout.max_staleness=1"]) for x in ("--set", o)]]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["rollout/staleness_max"] for r in read_metrics(run)] == [0, 1, 1]


@pytest.mark.slow
@pytest.mark.torchrun
def test_staleness_one_resumes_every_rank_exactly_under_ddp(tmp_path):
    """Each rank's pending batch is its own in the checkpoint: a run cut in step 3 (newest
    checkpoint step 2, holding both ranks' batches for step 3) and resumed on 2 ranks ends with
    the straight run's metrics, episodes and weights (before, every rank resumed rank 0's batch)."""
    import json
    import shutil
    import sys
    from pathlib import Path

    from helpers.runs import free_port

    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun is not installed")
    worker = str(HELPERS / "overlap_worker.py")

    def launch(run, *args):
        cmd = [str(torchrun if torchrun.exists() else "torchrun"), "--nproc_per_node", "2", "--master_port",
               str(free_port()), worker, str(run), "4", *args]
        done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]

    launch(tmp_path / "ref")
    launch(tmp_path / "cut", "--kill-after", "3")
    state = json.loads((tmp_path / "cut" / "checkpoints" / "step_0000002" / "trainer_state.json").read_text())
    batches = [rank["pending"] for rank in state["overlap"]["by_rank"]]
    assert len(batches) == 2 and all(batches), "both ranks' step-3 batches are saved"
    assert {e["episode_id"] for e in batches[0]}.isdisjoint(e["episode_id"] for e in batches[1])
    launch(tmp_path / "cut", "--resume")
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))}  # noqa: E731
    assert [strip(r) for r in read_metrics(tmp_path / "cut")] == [strip(r) for r in read_metrics(tmp_path / "ref")]
    samples = lambda run: (run / "samples.jsonl").read_text().splitlines()  # noqa: E731
    assert samples(tmp_path / "cut")[-8:] == samples(tmp_path / "ref")[-8:]
    a, b = _final_weights(tmp_path / "ref"), _final_weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
