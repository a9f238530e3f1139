"""The study harness on a tiny model: grid, evaluation, table, resumability."""

import json

import pytest
import torch
import yaml

from srpo.config import ConfigError
from srpo.apps.study.runner import run_study


@pytest.mark.slow
def test_study_runs_tabulates_and_resumes(tmp_path, monkeypatch):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({
        "run": {"steps": 2}, "model": {"name": "tiny-llama"},
        "workflow": {"name": "parallel_aggregate", "options": {"num_workers": 2}, "max_new_tokens": 4},
        "task": {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 0, "n": 8}},
        "train": {"tasks_per_step": 2, "group_size": 2, "lr": 0.01},
        "checkpoint": {"every": 0}, "log": {"backends": []},
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
    # Strict JSON: the one-seed untrained row has no SE (None, not NaN, which jq and browsers refuse).
    data = json.loads((tmp_path / "out" / "results.json").read_text(),
                      parse_constant=lambda c: pytest.fail(f"results.json holds {c}"))
    assert len(data["cells"]) == 5, "4 trained cells + the untrained starting point of their one workflow"
    assert "| untrained (srpo workflow) | 1 |" in text
    assert all("grad_norm" in c["diagnostics"] for c in data["cells"] if not c["label"].startswith("untrained"))
    cell_dir = tmp_path / "out" / "srpo" / "seed0"  # keep_checkpoints: false — the record stays, the weights go
    assert (cell_dir / "cell.json").is_file() and (cell_dir / "metrics.jsonl").is_file()
    assert not (cell_dir / "checkpoints").exists()
    png = tmp_path / "out" / "results.png"  # accuracy bars + training-reward curves
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # Running it again re-uses every finished cell (no training: the trainer must not be built).
    import srpo.train

    monkeypatch.setattr(srpo.train, "Trainer", None)
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


def _record(label, seed, avg, method="srpo"):
    return {"label": label, "seed": seed, "overrides": {"method.name": method},
            "eval": {"datasets": {}, "macro": {"avg@2": avg, "pass@2": avg}}}


def test_paired_differences_against_the_baseline():
    from srpo.stats import t_interval
    from srpo.apps.study.statistics import paired_differences

    base = [0.50, 0.40, 0.60, 0.55, 0.45]
    gain = [0.10, 0.12, 0.08, 0.11, 0.09]   # a consistent gain: small SE once paired
    noise = [0.20, -0.25, 0.15, -0.10, 0.05]
    records = [_record("grpo", s, b) for s, b in enumerate(base)]
    records += [_record("srpo", s, b + g) for s, (b, g) in enumerate(zip(base, gain))]
    records += [_record("gspo", s, b + n) for s, (b, n) in enumerate(zip(base, noise))]
    records += [_record("dr_mas", 0, 0.9)]  # one seed: no interval
    records += [_record("untrained (x)", 0, 0.1)]
    out = paired_differences(records, "grpo", "avg@2")
    assert set(out) == {"srpo", "gspo", "dr_mas"}
    s = out["srpo"]
    sd = torch.tensor(gain, dtype=torch.float64).std().item()
    assert s["n"] == 5 and s["mean"] == pytest.approx(0.10) and s["se"] == pytest.approx(sd / 5 ** 0.5)
    assert s["ci95"][0] == pytest.approx(0.10 - 2.7764451 * s["se"]) and s["significant"]
    assert s["ci95"] == pytest.approx(list(t_interval(gain)))
    assert s["p_sign_flip"] == pytest.approx(2 / 32)  # all 5 positive: the smallest exact p of 5 seeds
    assert not out["gspo"]["significant"] and out["gspo"]["ci95"][0] < 0 < out["gspo"]["ci95"][1]
    assert out["dr_mas"]["n"] == 1 and not out["dr_mas"]["significant"] and out["dr_mas"]["ci95"] is None
    json.dumps(out, allow_nan=False)  # results.json stays valid JSON (no NaN for the one-seed cell)


def test_paired_differences_per_dataset_see_what_the_macro_average_hides():
    from srpo.apps.study.statistics import paired_differences

    def record(label, seed, kb, hotpot):
        return {"label": label, "seed": seed, "eval": {"datasets": {"kb": {"avg@2": kb}, "hotpot": {"avg@2": hotpot}},
                                                       "macro": {"avg@2": (kb + hotpot) / 2}}}

    # srpo gains 0.2 on kb and loses 0.2 on hotpot, seed by seed (with a little noise): the macro
    # difference is ~0, the per-dataset ones are significant and opposite.
    jitter, other = [0.01, -0.01, 0.02, 0.0, -0.02], [0.03, 0.0, -0.02, 0.01, -0.02]
    records = [record("grpo", s, 0.5, 0.3) for s in range(5)]
    records += [record("srpo", s, 0.7 + j, 0.1 + o) for s, (j, o) in enumerate(zip(jitter, other))]
    macro = paired_differences(records, "grpo", "avg@2")["srpo"]
    kb = paired_differences(records, "grpo", "avg@2", "kb")["srpo"]
    hotpot = paired_differences(records, "grpo", "avg@2", "hotpot")["srpo"]
    assert macro["mean"] == pytest.approx(0.0) and not macro["significant"]
    assert kb["mean"] == pytest.approx(0.2) and kb["significant"]
    assert hotpot["mean"] == pytest.approx(-0.2) and hotpot["significant"]


@pytest.mark.slow
def test_references_are_evaluated_untrained_with_their_own_overrides(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({
        "run": {"steps": 1}, "model": {"name": "tiny-llama"},
        "workflow": {"name": "parallel_aggregate", "options": {"num_workers": 2}, "max_new_tokens": 4},
        "task": {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 0, "n": 8}},
        "train": {"tasks_per_step": 1, "group_size": 2}, "checkpoint": {"every": 0}, "log": {"backends": []},
    }))
    study = tmp_path / "study.yaml"
    study.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "out"), "base": "base.yaml", "overrides": {"workflow.max_new_tokens": 3},
        "axes": {"method": [{"label": "srpo", "set": {}}]}, "seeds": [4, 5], "keep_checkpoints": False,
        "references": [{"label": "one worker", "set": {"workflow.options": {"num_workers": 1}}}],
        "eval": {"k": 1, "datasets": [{"source": "synthetic_arithmetic", "level": 0, "n": 2, "seed": 9, "name": "a"}]},
    }))
    run_study(study, progress=False, only=1)
    ref = tmp_path / "out" / "untrained (one worker)" / "seed4"
    record = json.loads((ref / "cell.json").read_text())
    assert record["recipe"]["train"] is False and record["eval"]["datasets"]["a"]["n"] == 2
    assert record["recipe"]["overrides"] == {"workflow.max_new_tokens": 3, "workflow.options": {"num_workers": 1},
                                             "run.seed": 4}
    assert not (ref / "metrics.jsonl").exists(), "a reference never trains"
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [c["label"] for c in data["cells"]] == ["untrained (one worker)", "srpo"]
    (tmp_path / "study.yaml").write_text(study.read_text().replace("num_workers: 1", "num_wrkers: 1"))
    with pytest.raises(ConfigError, match=r"cell untrained \(one worker\).*num_wrkers"):
        run_study(study, progress=False)


def test_held_out_sizes_load_each_set_as_the_study_s_own_task_kind(tmp_path):
    """A study that overrides task.kind (parts on a math base) counts its held-out problems with
    that kind: with the base's kind the parts source fails to load and the count was silently lost."""
    from srpo.apps.study.schema import heldout_sizes, load_study

    (tmp_path / "base.yaml").write_text(yaml.safe_dump({
        "model": {"name": "tiny-llama"}, "workflow": {"name": "parallel_aggregate"},
        "task": {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 0, "n": 8}},
    }))
    study = tmp_path / "study.yaml"
    study.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "out"), "base": "base.yaml", "seeds": [0],
        "overrides": {"task.kind": "parts", "workflow.name": "parts", "workflow.options": {"max_parts": 4},
                      "task.train": {"source": "synthetic_parts", "n": 8, "level": 0, "split": "train"}},
        "axes": {"method": [{"label": "srpo", "set": {}}]},
        "eval": {"k": 1, "datasets": [{"source": "synthetic_parts", "level": 0, "n": 30, "seed": 777,
                                       "split": "test", "name": "parts-test"}]},
    }))
    assert heldout_sizes(load_study(study, check_cells=False)) == {"parts-test": 30}


def test_mechanism_reads_by_k_metrics_per_seed(tmp_path):
    from srpo.apps.study.statistics import mechanism

    for seed, clip in ((0, 0.1), (1, 0.3)):
        run = tmp_path / "dr_mas" / f"seed{seed}"
        run.mkdir(parents=True)
        rows = [{"step": step, "by_k/events/k1": 4, "by_k/events/k3": 6,  # dr_mas: members (2 K=3 transitions)
                 "by_k/clip_frac/k1": 0.0, "by_k/clip_frac/k3": clip,
                 "by_k/grad_share/k1": 0.25, "by_k/grad_share/k3": 0.75} for step in (1, 2)]
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    records = [_record("dr_mas", 0, 0.5, "dr_mas"), _record("dr_mas", 1, 0.5, "dr_mas")]
    mech = mechanism(tmp_path, records)["dr_mas"]
    assert mech["3"]["clip_frac"]["mean"] == pytest.approx(0.2) and mech["3"]["clip_frac"]["seeds"] == 2
    # 4 K=1 transitions and 2 K=3 ones: K=3 holds 1/3 of the transitions and 3/4 of the gradient.
    assert mech["3"]["weight_per_transition"]["mean"] == pytest.approx(0.75 / (2 / 6))
    assert mech["1"]["weight_per_transition"]["mean"] == pytest.approx(0.25 / (4 / 6))
    assert mech["3"]["by_step"]["clip_frac"] == {1: pytest.approx(0.2), 2: pytest.approx(0.2)}


def test_shipped_results_files_are_strict_json():
    """Every docs/results_*.json parses without NaN/Infinity (jq and browsers refuse those)."""
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[2] / "docs").glob("results_*.json"))
    assert len(files) >= 9
    for f in files:
        data = json.loads(f.read_text(), parse_constant=lambda c: pytest.fail(f"{f.name} holds {c}"))
        assert "paired" not in data, f"{f.name}: unadjusted tables; restate it (srpo study --restate)"


@pytest.mark.slow
def test_seed_planning_script_runs_reduced_on_cpu(tmp_path):
    """scripts/plan_seeds.py (the GPU seed-planning run) in a reduced form: it trains every cell,
    evaluates the test part and reports each method's paired SD against GRPO."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "plan_seeds.py"
    spec = importlib.util.spec_from_file_location("plan_seeds", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--device", "cpu", "--model", "tiny-llama", "--steps", "1", "--seeds", "2", "--tasks", "2",
                        "--episodes", "2", "--max-new-tokens", "4", "--eval-n", "12", "--out", str(tmp_path / "plan")]) == 0
    report = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert {r["cell"] for r in report["comparisons"]} == {"srpo", "srpo_sum"}
    assert all(r["seeds"] == 2 and r["sd_paired"] >= 0 for r in report["comparisons"])
    assert report["heldout"]["items"] == 12 and report["heldout"]["distinct_problems"] == {"arith-L2-test": 11}
    assert all(r["evaluation_share_of_variance"] is None or 0 <= r["evaluation_share_of_variance"] <= 1
               for r in report["comparisons"])
    cells = list((tmp_path / "plan").glob("*/seed*/cell.json"))
    assert len(cells) == 6 and all(json.loads(c.read_text())["environment"]["eval_seed"] >= 1000 for c in cells)


def test_a_torn_cell_record_is_named_set_aside_and_the_cell_run_again(tmp_path):
    """A cell.json cut off mid-write (written before records were atomic, or a full disk) used to
    stop the whole study with an unnamed JSONDecodeError; now it is named, moved aside, redone."""
    from srpo.apps.study.runner import read_cell

    cell = tmp_path / "srpo" / "seed0" / "cell.json"
    cell.parent.mkdir(parents=True)
    cell.write_text('{"label": "srpo", "eval": {"macro": {"avg@2"')
    with pytest.warns(UserWarning, match=r"seed0/cell.json: unreadable cell record"):
        assert read_cell(cell) is None
    assert not cell.exists() and (cell.parent / "cell.json.unreadable").is_file()
    cell.write_text(json.dumps({"label": "srpo", "eval": {"macro": {}}}))
    assert read_cell(cell)["label"] == "srpo"


def _one_cell_study(tmp_path, run: dict, workflow: dict):
    """A study of one cell (srpo, seed 0) on the tiny model, its folder tmp_path/out."""
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({
        "run": run, "model": {"name": "tiny-llama"}, "workflow": workflow,
        "task": {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 0, "n": 8}},
        "train": {"tasks_per_step": 2, "group_size": 2}, "checkpoint": {"every": 0}, "log": {"backends": []}}))
    study = tmp_path / "study.yaml"
    study.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "out"), "base": "base.yaml", "seeds": [0],
        "axes": {"method": [{"label": "srpo", "set": {"method.name": "srpo"}}]},
        "eval": {"k": 1, "datasets": [{"source": "synthetic_arithmetic", "level": 0, "n": 2, "seed": 9}]}}))
    return study


def test_each_cell_runs_in_its_own_process_and_a_cell_process_that_dies_is_named(tmp_path, monkeypatch):
    """cell_process (the default): a cell's process that is killed (here: its workflow kills it)
    ends the study with a message naming the cell and the exit code — not a hang — and the study's
    own process never trains (its Trainer is gone)."""

    (tmp_path / "killer_team.py").write_text(
        "import os, signal\n"
        "from dataclasses import dataclass\n"
        "from srpo.workflows import Workflow\n\n\n"
        "@dataclass\n"
        "class Killer(Workflow):\n"
        "    name = 'killer'\n\n"
        "    def roles(self):\n"
        "        return ['solver']\n\n"
        "    async def run(self, ctx, task):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    study = _one_cell_study(tmp_path, {"steps": 1}, {"name": "killer_team:Killer"})
    import srpo.train

    monkeypatch.setattr(srpo.train, "Trainer", None)  # the study's own process never trains
    with pytest.raises(RuntimeError, match=r"cell srpo seed 0: its process ended with exit code -9 without a result"):
        run_study(study, progress=False)


@pytest.mark.slow
def test_a_preempted_study_stops_its_cell_s_process_at_a_checkpoint_and_continues(tmp_path):
    """SIGTERM to `srpo study` alone (not its process group): the signal is passed on to the cell's
    process, which checkpoints at its step's end; the study exits 143; run again, the cell resumes
    from that checkpoint and finishes."""
    import os
    import signal
    import subprocess
    import sys
    import time

    # Steps of the tiny model take ~7 ms: the cell must still be running when the signal has been
    # passed on, so it has far more steps than it runs before the signal (it stops at the next).
    STEPS = 300
    study = _one_cell_study(tmp_path, {"steps": STEPS, "threads": 1}, {"name": "single", "max_new_tokens": 4})
    srpo_cli = [sys.executable, "-m", "srpo.apps.cli", "study", "--config", str(study)]
    metrics = tmp_path / "out" / "srpo" / "seed0" / "metrics.jsonl"
    proc = subprocess.Popen(srpo_cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.2)
    assert metrics.is_file(), "the cell never started training"
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    stopped_at = len(metrics.read_text().splitlines())
    assert proc.returncode == 143, f"exit {proc.returncode} after {stopped_at} steps\n{out[-1000:]}\n{err[-3000:]}"
    assert (tmp_path / "out" / "srpo" / "seed0" / "checkpoints" / "latest").exists()
    assert 2 <= stopped_at < STEPS
    done = subprocess.run([*srpo_cli[:3], "-v", *srpo_cli[3:]], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"at step {stopped_at}" in done.stderr and "resumed from" in done.stderr  # the cell's process logs it
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1)), "every step once"


def test_a_base_that_evaluates_during_training_makes_cells_that_do_not_unless_the_study_keeps_it(tmp_path):
    """Cells drop the base's held-out sets (the study evaluates after training), so they turn its
    evaluation during training off too; ``eval.during_training: true`` keeps both."""
    from srpo.apps.study.schema import cell_config, cells, load_study

    (tmp_path / "base.yaml").write_text(yaml.safe_dump({
        "model": {"name": "tiny-llama"}, "workflow": {"name": "single"},
        "task": {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 0, "n": 8},
                 "eval": [{"source": "synthetic_arithmetic", "level": 0, "n": 4, "name": "curve"}]},
        "eval": {"k": 1, "every": 5}, "log": {"backends": []},
    }))
    study = {"output_dir": str(tmp_path / "out"), "base": "base.yaml", "seeds": [0],
             "axes": {"method": [{"label": "srpo", "set": {}}, {"label": "grpo", "set": {"method.name": "grpo"}}]},
             "eval": {"k": 1, "datasets": [{"source": "synthetic_arithmetic", "level": 0, "n": 2, "name": "a"}]}}
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    spec = load_study(tmp_path / "study.yaml")
    cfg = cell_config(spec, cells(spec)[1], tmp_path / "cell")
    assert cfg.eval.every == 0 and not cfg.task.eval and cfg.method.name == "grpo"
    study["eval"]["during_training"] = True
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    spec = load_study(tmp_path / "study.yaml")
    cfg = cell_config(spec, cells(spec)[0], tmp_path / "cell")
    assert cfg.eval.every == 5 and [s.name for s in cfg.task.eval] == ["curve"]


def test_the_untrained_reference_runs_at_the_cell_s_thread_count(tmp_path, monkeypatch):
    """run.threads applies to the untrained starting point too (no trainer applies it there): at
    torch's default thread count beside a shard on the other core it evaluated ~10x slower per
    episode than a trained cell (study (n)'s pilot)."""
    import torch

    from srpo.apps.study.runner import run_cell
    from srpo.apps.study.schema import cells, load_study

    (tmp_path / "base.yaml").write_text(yaml.safe_dump({
        "run": {"steps": 1, "threads": 1}, "model": {"name": "tiny-llama"},
        "workflow": {"name": "single", "max_new_tokens": 2}, "log": {"backends": []},
        "task": {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 0, "n": 4}}}))
    (tmp_path / "study.yaml").write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "out"), "base": "base.yaml", "seeds": [0],
        "axes": {"method": [{"label": "grpo", "set": {"method.name": "grpo"}}]},
        "eval": {"k": 1, "datasets": [{"source": "synthetic_arithmetic", "level": 0, "n": 2, "seed": 9}]}}))
    spec = load_study(tmp_path / "study.yaml")
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    record = run_cell(spec, {**cells(spec)[0], "label": "untrained (grpo workflow)"}, tmp_path / "out",
                      progress=False, train=False)
    assert threads == [1] and record["eval"]["macro"]
