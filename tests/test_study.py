"""The study harness on a tiny model: grid, evaluation, table, resumability."""

import json

import pytest
import yaml

from srpo.config import ConfigError
from srpo.study import run_study


def test_study_runs_tabulates_and_resumes(tmp_path, monkeypatch):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({
        "run": {"steps": 2}, "model": {"name": "tiny-llama"},
        "workflow": {"name": "parallel_aggregate", "options": {"num_workers": 2}, "max_new_tokens": 4},
        "task": {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 0, "n": 8}},
        "train": {"tasks_per_step": 2, "group_size": 2, "lr": 0.01},
        "checkpoint": {"every": 0}, "log": {"tensorboard": False},
    }))
    study = tmp_path / "study.yaml"
    study.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "out"), "base": "base.yaml",
        "axes": {"method": [{"label": "srpo", "set": {"method.name": "srpo"}},
                            {"label": "grpo", "set": {"method.name": "grpo"}}]},
        "seeds": [0, 1], "eval_untrained": True, "keep_checkpoints": False,
        "eval": {"k": 2, "datasets": [{"source": "synthetic_arithmetic", "level": 0, "n": 3, "seed": 9, "name": "a"}]},
    }))
    results = run_study(study, progress=False)
    text = results.read_text()
    assert "| srpo | 2 |" in text and "| grpo | 2 |" in text and "macro avg@2" in text
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(data["cells"]) == 5, "4 trained cells + the untrained starting point of their one workflow"
    assert "| untrained (srpo workflow) | 1 |" in text
    assert all("grad_norm" in c["diagnostics"] for c in data["cells"] if not c["label"].startswith("untrained"))
    cell_dir = tmp_path / "out" / "srpo" / "seed0"  # keep_checkpoints: false — the record stays, the weights go
    assert (cell_dir / "cell.json").is_file() and (cell_dir / "metrics.jsonl").is_file()
    assert not (cell_dir / "checkpoints").exists()
    png = tmp_path / "out" / "results.png"  # accuracy bars + training-reward curves
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # Running it again re-uses every finished cell (no training: the trainer must not be built).
    import srpo.trainer

    monkeypatch.setattr(srpo.trainer, "Trainer", None)
    run_study(study, progress=False)
    assert json.loads((tmp_path / "out" / "results.json").read_text())["table"] == data["table"]
    # The study and its base config moved elsewhere (a renamed checkout): the cells are reused.
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "base.yaml").write_text(base.read_text())
    (moved / "study.yaml").write_text(study.read_text())
    run_study(moved / "study.yaml", progress=False)
    # A changed base config or evaluation must not silently reuse cells trained or evaluated the old way.
    (moved / "base.yaml").write_text(base.read_text().replace("lr: 0.01", "lr: 0.02"))
    with pytest.raises(ConfigError, match="different recipe or evaluation"):
        run_study(moved / "study.yaml", progress=False)
    spec = yaml.safe_load(study.read_text())
    spec["eval"]["datasets"].append({"source": "synthetic_arithmetic", "level": 1, "n": 3, "seed": 9, "name": "b"})
    study.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match="different recipe or evaluation"):
        run_study(study, progress=False)
