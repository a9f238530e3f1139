"""Fitting the ecosystem: experiment trackers, the retrieval service, the wheel."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tiny_train(run_dir, extra=()):
    overrides = [f"run.output_dir={run_dir}", "run.steps=3", "model.name=tiny-llama", "model.autocast_bf16=false",
                 "workflow.max_new_tokens=6", "train.tasks_per_step=2", "train.group_size=2", "train.lr=0.01",
                 "task.train.n=8", "checkpoint.every=2", "train.skip_zero_advantage=false", *extra]
    return [sys.executable, "-m", "srpo.cli", "train", "--config", str(ROOT / "configs/math/single/srpo.yaml"),
            *[x for o in overrides for x in ("--set", o)]]


# ------------------------------------------------------------------------------------ trackers

def wandb_history(path: Path, key: str) -> dict:
    """``step → value`` of ``key`` from an offline W&B run's ``.wandb`` log.

    wandb 0.31 writes it from its Go core and no longer ships a Python reader; the format is a
    LevelDB-style log — a 7-byte header (":W&B", magic 0xBEE1, version), then 32 KiB blocks of
    records, each with a 7-byte header (CRC, length, type: full/first/middle/last) — holding
    protobuf ``Record`` messages."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1
    out, pos, buf = {}, 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                if key in items:
                    out[items["_step"]] = items[key]
    return out


@pytest.mark.slow
def test_every_tracker_logs_offline_and_the_metric_reads_back(tmp_path, monkeypatch):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TRACKIO_DIR": str(tmp_path / "trackio"),
           "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    backends = "log.backends=[tensorboard, wandb, mlflow, trackio]"
    settings = [backends, "log.wandb_mode=offline", "log.project=srpo-test", "log.run_name=trackers"]
    done = subprocess.run(tiny_train(run, settings), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ids = json.loads((run / "trackers.json").read_text())
    # A resumed run continues the same tracker runs.
    done = subprocess.run(tiny_train(run, [*settings, "run.steps=5"]) + ["--resume"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run / "trackers.json").read_text()) == ids
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    metric = "time/step_s"  # differs at every step
    want = {r["step"]: r[metric] for r in rows}
    assert sorted(want) == [1, 2, 3, 4, 5]

    # TensorBoard: the event files.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars(metric)} == pytest.approx(want)

    # W&B offline: the history records of the run's transaction log.
    logs = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 2 and all(p.name == f"run-{ids['wandb']}.wandb" for p in logs)  # one run, two sessions
    assert {**wandb_history(logs[0], metric), **wandb_history(logs[1], metric)} == pytest.approx(want)

    # MLflow file store in <run>/mlruns.
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]
    history = {m.step: m.value for m in client.get_metric_history(run_id, metric)}
    assert history == pytest.approx(want)
    assert client.get_run(run_id).data.params["method.name"] == "srpo"

    # trackio's local database, read by trackio itself (its folder is fixed when it is imported).
    read = subprocess.run([sys.executable, "-c", (
        "import json; from trackio.sqlite_storage import SQLiteStorage as S; "
        f"print(json.dumps({{r['step']: r['{metric}'] for r in S.get_logs('srpo-test', 'trackers') if '{metric}' in r}}))")],
        env=env, capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stderr[-2000:]
    assert {int(k): v for k, v in json.loads(read.stdout.strip().splitlines()[-1]).items()} == pytest.approx(want)


def test_an_unknown_or_missing_tracker_fails_before_any_model(monkeypatch):
    from srpo.config import ConfigError, load_config
    import srpo.trackers as trackers

    with pytest.raises(ConfigError, match="log.backends: 'comet' is not valid; valid: tensorboard, wandb, mlflow, trackio"):
        load_config(None, ["log.backends=[comet]"])
    monkeypatch.setitem(trackers.REQUIREMENTS, "wandb", ("no_such_module_xyz", "srpo[wandb]"))
    with pytest.raises(ConfigError, match=r"log.backends: wandb is not installed; pip install 'srpo\[wandb\]'"):
        load_config(None, ["log.backends=[wandb]"])
    with pytest.raises(ConfigError, match="log.wandb_mode"):
        load_config(None, ["log.wandb_mode=sometimes"])
