"""Study (n)'s report (scripts/parts_team_contrast.py): every declared comparison from the cells'
per-seed results, the credit contrast paired by seed, Holm across all twelve."""

import importlib.util
from pathlib import Path

import pytest

from srpo import stats

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "parts_team_contrast.py"
_spec = importlib.util.spec_from_file_location("parts_team_contrast", _PATH)
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def _cell(label, seed, per_part, avg):
    return {"label": label, "seed": seed, "eval": {"datasets": {"parts-test": {"per_part": per_part, "avg@4": avg}}}}


def _cells(seeds=6):
    """SRPO gains 0.05 + 0.01·seed per part over GRPO under the joint reward, nothing under the
    decomposable one; seed 5 of srpo-decomposable-shared never finished."""
    cells = [_cell("untrained (srpo-joint-lora workflow)", 0, 0.5, 0.2)]
    for s in range(seeds):
        for policy in ("lora", "shared"):
            for reward in ("joint", "decomposable"):
                base = 0.55 + 0.02 * ((s * 7) % 5)
                gain = 0.05 + 0.01 * s if reward == "joint" else 0.002 * (-1) ** s
                cells.append(_cell(f"grpo-{reward}-{policy}", s, base, base / 3))
                if not (s == 5 and (reward, policy) == ("decomposable", "shared")):
                    cells.append(_cell(f"srpo-{reward}-{policy}", s, base + gain, (base + gain) / 3))
    return cells


def test_the_contrast_pairs_each_seeds_edges_and_holm_covers_all_twelve():
    comps = report.comparisons(_cells())
    assert len(comps) == 12 and [c["role"] for c in comps].count("secondary") == 10
    by = {(c["comparison"], c["metric"]): c for c in comps}
    primary = by["srpo − grpo, joint, lora", "per_part"]
    assert primary["role"] == "primary" and primary["mean"] == pytest.approx(0.075)
    contrast = by["credit contrast (joint − decomposable edge), lora", "per_part"]
    expected = [0.05 + 0.01 * s - 0.002 * (-1) ** s for s in range(6)]
    assert contrast["role"] == "co-primary" and contrast["mean"] == pytest.approx(sum(expected) / 6)
    assert by["credit contrast (joint − decomposable edge), shared", "per_part"]["seeds"] == [0, 1, 2, 3, 4]
    assert [c["p_t_holm"] for c in comps] == pytest.approx(stats.holm([c["p_t"] for c in comps]))
    # the primaries are judged on their own p; a secondary on its Holm-adjusted p
    assert primary["significant"] == (primary["p_t"] < stats.ALPHA)
    assert all(c["significant"] == (c["p_t_holm"] < stats.ALPHA) for c in comps if c["role"] == "secondary")


def test_the_report_lists_the_untrained_team_first_and_refuses_a_lone_seed():
    text, _ = report.report(_cells())
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[1].startswith("| untrained") and "| 0.500 | 0.200 |" in rows[1]
    with pytest.raises(SystemExit, match="1 seed"):
        report.comparisons(_cells(seeds=1) + _cells(seeds=1)[1:2])
