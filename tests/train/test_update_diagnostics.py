"""What a run logs of its update's two clips — the gradient-norm clip (``grad_norm/*``,
``grad_clip/*``) and the ratio clip — and the report's stability section built from them."""

import json

import pytest

from srpo.train.update import GradientNorms
from tests.helpers.runs import trained


def test_gradient_norms_average_the_optimizer_steps_and_count_the_clipped_ones():
    norms = GradientNorms(max_grad_norm=1.0)
    norms.add({"a": 2.0, "b": 0.5})   # a clipped
    norms.add({"a": 0.5, "b": 0.25})  # nothing clipped
    out = norms.result()
    assert out["grad_norm/a"] == pytest.approx(1.25) and out["grad_norm/b"] == pytest.approx(0.375)
    assert out["grad_clip/a"] == 0.5 and out["grad_clip/b"] == 0.0 and out["grad_clip/any"] == 0.5
    assert out["grad_norm/total"] == pytest.approx((1.25 ** 2 + 0.375 ** 2) ** 0.5)
    assert out["update/optimizer_steps"] == 2
    unclipped = GradientNorms(max_grad_norm=0.0)  # 0: no clipping, whatever the norm
    unclipped.add({"a": 1e6})
    assert unclipped.result()["grad_clip/any"] == 0.0
    assert GradientNorms(1.0).result() == {}  # no optimizer step: nothing to report


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_several_optimizer_steps_a_rollout_let_the_ratio_clip_act_and_the_report_shows_it(tmp_path):
    from srpo.apps.report import write_summary

    run = tmp_path / "run"
    trained(run, ["train.epochs=2", "train.minibatches=2", "train.max_grad_norm=1e-6", "checkpoint.every=0"])
    rows = [r for r in _rows(run) if "update/optimizer_steps" in r]
    # Four optimizer steps a rollout; the clip acts in each whose mini-batch has a gradient (a
    # mini-batch of zero-advantage events has none).
    assert rows and all(r["update/optimizer_steps"] == 4 and 0 < r["grad_clip/any"] <= 1 for r in rows)
    assert all(r["grad_clip/shared"] == r["grad_clip/any"] and r["grad_norm/shared"] > 1e-6 for r in rows)
    assert any(r["objective/clip_frac"] > 0 for r in rows)  # later optimizer steps see ratios ≠ 1
    report = write_summary(run).read_text()
    assert "## Stability by set size" in report and "Every ratio stayed at 1" not in report
    assert "| norm clip acted (share of optimizer steps) | `grad_clip/shared` |" in report  # one policy: no total row
    assert (run / "report" / "stability.png").is_file() and "*Stability by set size:" in report


def test_one_optimizer_step_a_rollout_says_the_ratios_cannot_move_and_draws_no_flat_diagnostic(tmp_path):
    from srpo.apps.report import write_summary

    run = tmp_path / "run"
    trained(run, ["train.max_grad_norm=0", "checkpoint.every=0"])
    rows = [r for r in _rows(run) if "update/optimizer_steps" in r]
    assert rows and all(r["grad_clip/any"] == 0.0 and r["objective/clip_frac"] == 0.0 for r in rows)
    report = write_summary(run).read_text()
    assert "Every ratio stayed at 1" in report
    assert not (run / "report" / "stability.png").exists()
    assert not (run / "report" / "clip_fraction_by_set_size.png").exists()  # flat at 0: left out, and said
    assert "Not drawn, flat over the whole run:" in report and "Ratio-clip fraction by set size K" in report
