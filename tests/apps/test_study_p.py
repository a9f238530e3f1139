"""Study (p)'s declared measures and tests (scripts/study_p.py) on a study folder whose runs grow,
hold or shrink their measures with K by construction."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "study_p.py"
_spec = importlib.util.spec_from_file_location("study_p", _PATH)
study_p = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study_p)

GROWTH = {"sum": 0.1, "sqrt": 0.0, "mean": -0.02, "grpo": 0.01}  # clip fraction per doubling of K


def _folder(root: Path, seeds=4):
    cells = []
    for arm, growth in GROWTH.items():
        for k in (2, 4, 8):
            for s in range(seeds):
                run = root / f"{arm}-k{k}" / f"seed{s}"
                run.mkdir(parents=True)
                clip = 0.2 + growth * math.log2(k) + 0.001 * s
                rows = [{"step": t, "objective/num_events": 8, "grad_norm/total": 1.0 + 0.1 * (t % 3),
                         f"by_k/clip_frac/k{k}": clip, f"by_k/unit_log_ratio_std/k{k}": 0.5,
                         f"by_k/approx_kl/k{k}": 0.01 * k} for t in range(1, 7)]
                rows.append({"step": 7, "grad_norm/total": 0.0})  # a step with nothing to learn: not counted
                (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
                cells.append({"label": f"{arm}-k{k}", "seed": s,
                              "eval": {"datasets": {"parts-test": {"per_part": 0.6 + (0.05 if arm == "sqrt" else 0) + 0.01 * s}}}})
    (root / "results.json").write_text(json.dumps({"cells": cells}))


def test_slopes_over_log2_k_and_the_declared_family(tmp_path):
    _folder(tmp_path)
    table = study_p.collect(tmp_path)
    assert table[("sum", 2)][0]["steps_updated"] == 6 and table[("sum", 2)][0]["spikes"] == 0
    assert study_p.slopes(table, "sum", "clip_frac") == pytest.approx({s: 0.1 for s in range(4)})
    assert study_p.slopes(table, "sqrt", "clip_frac") == pytest.approx({s: 0.0 for s in range(4)}, abs=1e-12)
    assert table[("mean", 8)][1]["log_ratio_var"] == pytest.approx(0.25)
    tests = study_p.declared_tests(table)
    assert len(tests) == 28 and {t["family"] for t in tests} == {"flatness", "contrast", "cost"}
    contrast = next(t for t in tests if t["comparison"] == "slope of ratio-clip fraction: sqrt − sum")
    assert contrast["mean"] == pytest.approx(-0.1)
    cost = next(t for t in tests if t["comparison"].startswith("held-out per part, sqrt − grpo"))
    assert cost["n"] == 12 and cost["mean"] == pytest.approx(0.05)
    text = study_p.markdown(table, tests)
    assert "| sum | 8 | 4 |" in text
    study_p.figure(table, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 1000
