"""Study (o)'s tuning rule and declared analysis (scripts/study_o.py): the rate by the median over
tuning seeds, the edge rule, the rates written into the declaration, the interaction paired by seed,
and the manipulation checks."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "study_o.py"
_spec = importlib.util.spec_from_file_location("study_o", _PATH)
study_o = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study_o)


def _cell(label, seed, dataset, per_part, avg=0.2, clip_frac=0.1, norm_share=0.0):
    return {"label": label, "seed": seed, "eval": {"datasets": {dataset: {"per_part": per_part, "avg@4": avg}}},
            "diagnostics": {"clip_frac": clip_frac, "grad_clip_share": norm_share}}


def test_tuning_takes_the_best_median_and_sends_an_edge_winner_back_to_the_grid():
    cells = []
    for seed in range(5):
        # set: 5e-6 has the best median (one bad seed does not move a median); token: 4e-5, the top edge.
        for lab, v in (("set-lr2.5e-6", 0.50), ("set-lr5e-6", 0.60 if seed else 0.0), ("set-lr1e-5", 0.55),
                       ("token-lr1e-5", 0.50), ("token-lr2e-5", 0.55), ("token-lr4e-5", 0.58)):
            cells.append(_cell(lab, 100 + seed, "parts-validation", v))
    chosen = study_o.choose_rates(cells)
    assert chosen["set"]["lr"] == 5e-6 and chosen["set"]["extend"] is None
    assert chosen["token"]["lr"] == 4e-5 and chosen["token"]["extend"] == "above"


def test_tuned_rates_replace_exactly_the_two_placeholders(tmp_path):
    study = tmp_path / "study.yaml"
    import re

    declared = _PATH.parents[1].joinpath("studies", "o_set_clip", "study.yaml").read_text()
    # The declaration as committed before its tuning: the two rates were placeholders.
    study.write_text(re.sub(r"(\{label: (?:set|token), set: \{[^}]*train\.lr: )[0-9.e+-]+", r"\g<1>TUNED", declared))
    study_o.tuning.write_rates(study, {"set": {"lr": 5e-6}, "token": {"lr": 2e-5}})
    text = study.read_text()
    assert "TUNED" not in text.split("axes:")[1]
    assert "sqrt, train.lr: 5.00e-06}" in text and "{method.name: grpo, train.lr: 2.00e-05}" in text
    with pytest.raises(ValueError, match="already tuned"):
        study_o.tuning.write_rates(study, {"set": {"lr": 5e-6}})


def test_the_primary_is_the_interaction_paired_by_seed_and_the_checks_read_both_clips():
    cells = []
    for s in range(8):
        base = 0.5 + 0.01 * ((s * 3) % 7)
        values = {"set-clip": base + 0.06 + 0.002 * s, "set-noclip": base, "token-clip": base + 0.01, "token-noclip": base}
        for label, v in values.items():
            clip = 0.2 if label.endswith("-clip") else 0.0
            cells.append(_cell(label, s, "parts-test", v, clip_frac=clip))
    comps = study_o.comparisons(cells)
    assert len(comps) == 10 and sum(c["primary"] for c in comps) == 1
    primary = next(c for c in comps if c["primary"])
    assert primary["comparison"].startswith("interaction") and primary["n"] == 8
    assert primary["mean"] == pytest.approx(0.05 + 0.002 * 3.5)  # (0.06 + 0.002 s) − 0.01, averaged over s
    assert primary["significant"]
    checks = "\n".join(study_o.manipulation_checks(cells))
    assert checks.count("| passes |") == 4
    cells.append(_cell("set-clip", 99, "parts-test", 0.5, clip_frac=0.01, norm_share=0.5))
    assert "FAILS: norm clip acted" in "\n".join(study_o.manipulation_checks(cells))
