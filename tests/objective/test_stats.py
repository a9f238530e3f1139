"""srpo.stats and a study's comparisons: exact sign-flip p, Holm, power, the primary comparison."""

import itertools
import json

import pytest
import yaml

from srpo import stats
from srpo.apps.study.statistics import comparisons, comparisons_text


def test_sign_flip_is_exact_and_bounded_by_the_number_of_seeds():
    # Five positive differences: only the all-+ and all-− patterns are as extreme: p = 2/32.
    assert stats.sign_flip_p([0.1, 0.2, 0.05, 0.3, 0.1]) == pytest.approx(0.0625)
    # By hand against an enumeration written out here.
    d = [0.3, -0.1, 0.2, 0.25, -0.05, 0.1]
    observed = abs(sum(d)) / len(d)
    extreme = sum(abs(sum(s * x for s, x in zip(signs, d))) / len(d) >= observed - 1e-12
                  for signs in itertools.product((-1, 1), repeat=len(d)))
    assert stats.sign_flip_p(d) == pytest.approx(extreme / 2 ** len(d))
    assert stats.sign_flip_p([0.0, 0.0, 0.0]) == 1.0
    # Beyond the exact limit: sampled, close to the t-test on normal-looking data.
    big = [0.1 + 0.05 * ((i * 7919) % 13 - 6) / 6 for i in range(25)]
    assert 0 < stats.sign_flip_p(big) < 0.001


def test_t_test_matches_scipy_and_holm_matches_the_definition():
    from scipy import stats as st

    d = [0.12, -0.03, 0.08, 0.2, 0.01, 0.05]
    assert stats.t_test_p(d) == pytest.approx(st.ttest_1samp(d, 0.0).pvalue)
    # Holm by hand: sorted p 0.01, 0.02, 0.04, 0.3 → 4·0.01, 3·0.02, max(0.06, 2·0.04), max(0.08, 0.3).
    assert stats.holm([0.04, 0.01, 0.3, 0.02]) == pytest.approx([0.08, 0.04, 0.3, 0.06])
    assert stats.holm([0.5, float("nan"), 0.01])[0] == pytest.approx(0.5)
    assert stats.holm([0.5, float("nan"), 0.01])[2] == pytest.approx(0.02)  # NaN not counted


def test_power_and_seeds_needed():
    # A difference of 0.10 with paired SD 0.12: about 14 seeds for 80% power (textbook: n ≈ 13.3 by z).
    n = stats.seeds_needed(0.12, 0.10)
    assert 12 <= n <= 16 and stats.power(0.12, n, 0.10) >= 0.8 > stats.power(0.12, n - 1, 0.10)
    assert stats.power(0.1, 20, 0.0) == pytest.approx(0.05, abs=1e-6)  # no effect: power = alpha
    assert stats.detectable(0.12, n) == pytest.approx(0.10, abs=0.01)
    # A difference many SEs wide (study (n): SD 0.037, 20 seeds, 0.10): power 1, not scipy's nan
    # far tail; and the sign of the difference does not matter.
    assert stats.power(0.037, 20, 0.10) == pytest.approx(1.0) == stats.power(0.037, 20, -0.10)


def _record(label, seed, value, kb=None):
    datasets = {} if kb is None else {"kb": {"avg@2": kb, "pass@2": kb}, "other": {"avg@2": 0.0, "pass@2": 0.0}}
    return {"label": label, "seed": seed, "eval": {"datasets": datasets, "macro": {"avg@2": value, "pass@2": value}}}


def test_comparisons_adjust_for_their_number_and_judge_the_primary_alone():
    base = [0.50, 0.40, 0.60, 0.55, 0.45, 0.52, 0.48, 0.41]
    small = [0.04, 0.07, -0.01, 0.05, 0.03, 0.06, 0.0, 0.04]  # t p ≈ 0.004: fine alone
    records = [_record("grpo", s, b) for s, b in enumerate(base)]
    records += [_record("srpo", s, b + g) for s, (b, g) in enumerate(zip(base, small))]
    for name in ("a", "b", "c", "d", "e", "f"):   # six noise cells make twelve more tests
        records += [_record(name, s, b + (0.03 if (s + ord(name)) % 2 else -0.03)) for s, b in enumerate(base)]
    spec = {"eval": {"k": 2}, "baseline": "grpo", "primary": None}
    comps = comparisons(records, spec)
    srpo = next(c for c in comps if c["cell"] == "srpo" and c["metric"] == "avg@2")
    assert len(comps) == 14 and srpo["p_t"] < 0.05
    assert srpo["p_t_holm"] == pytest.approx(min(1.0, 14 * srpo["p_t"]))  # the smallest p: times all 14
    # Declared primary: judged on its own p, with its power reported.
    spec = {"eval": {"k": 2}, "baseline": "grpo",
            "primary": {"baseline": "grpo", "cells": ["srpo"], "metric": "avg@2", "dataset": "macro"}}
    comps = comparisons(records, spec)
    first = [c for c in comps if c["primary"]]
    assert len(first) == 1 and first[0]["p_primary"] == pytest.approx(first[0]["p_t"])
    assert first[0]["verdict"].startswith("significant (primary)") and "power" in first[0]
    assert first[0]["power"]["seeds_for_80"]["0.05"] > 0
    text = comparisons_text(comps, spec)
    assert "Primary comparison (pre-registered)" in text and "Holm-adjusted across all of them" in text
    assert "Power (srpo)" in text
    json.dumps(comps, allow_nan=False)


def test_five_seeds_say_the_exact_test_cannot_pass():
    records = [_record("grpo", s, 0.5) for s in range(5)]
    records += [_record("srpo", s, 0.6 + 0.01 * s) for s in range(5)]
    comps = comparisons(records, {"eval": {"k": 2}, "baseline": "grpo"})
    text = comparisons_text(comps, {})
    assert "no exact sign-flip test can go below p = 0.0625" in text
    assert all("rests on normality" in c["verdict"] for c in comps if c["significant"])


def test_study_primary_must_name_cells_of_the_grid(tmp_path):
    from srpo.config import ConfigError
    from srpo.apps.study.schema import load_study

    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"model": {"name": "tiny-llama"}}))
    study = {"output_dir": str(tmp_path / "o"), "base": "base.yaml", "seeds": [0],
             "axes": {"m": [{"label": "srpo", "set": {"method.name": "srpo"}}]},
             "eval": {"k": 2, "datasets": [{"source": "synthetic_arithmetic", "level": 0, "n": 0}]},
             "primary": {"baseline": "grpo", "cells": ["srpo"]}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(study))
    with pytest.raises(ConfigError, match="primary names cell 'grpo'"):
        load_study(tmp_path / "s.yaml")


def test_contrasts_compare_declared_pairs_and_join_the_holm_family(tmp_path):
    from srpo.config import ConfigError
    from srpo.apps.study.schema import load_study

    base = [0.40, 0.52, 0.47, 0.61, 0.55, 0.43, 0.58, 0.50]
    records = [_record("sqrt-1", s, b) for s, b in enumerate(base)]
    records += [_record("sum-1", s, b - 0.10 - 0.01 * (s % 3)) for s, b in enumerate(base)]
    records += [_record("sqrt-4", s, b + 0.05) for s, b in enumerate(base)]
    records += [_record("sum-4", s, b + 0.05 + (0.02 if s % 2 else -0.02)) for s, b in enumerate(base)]
    spec = {"eval": {"k": 2}, "contrasts": [{"cell": "sum-1", "against": "sqrt-1"},
                                            {"cell": "sum-4", "against": "sqrt-4"}]}
    comps = comparisons(records, spec)
    assert {(c["cell"], c["baseline"]) for c in comps} == {("sum-1", "sqrt-1"), ("sum-4", "sqrt-4")}
    one = next(c for c in comps if c["cell"] == "sum-1" and c["metric"] == "avg@2")
    four = next(c for c in comps if c["cell"] == "sum-4" and c["metric"] == "avg@2")
    assert one["mean"] == pytest.approx(-0.10 - 0.01 * sum(s % 3 for s in range(8)) / 8)
    assert four["mean"] == pytest.approx(0.0) and four["p_t"] > 0.5
    assert one["p_t_holm"] >= one["p_t"] and one["verdict"].startswith("significant")
    # A contrast naming a cell the axes do not make is refused at load.
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"model": {"name": "tiny-llama"}}))
    study = {"output_dir": str(tmp_path / "o"), "base": "base.yaml", "seeds": [0],
             "axes": {"m": [{"label": "sqrt", "set": {}}]},
             "eval": {"k": 2, "datasets": [{"source": "synthetic_arithmetic", "level": 0, "n": 0}]},
             "contrasts": [{"cell": "sum", "against": "sqrt"}]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(study))
    with pytest.raises(ConfigError, match="contrasts names cell 'sum'"):
        load_study(tmp_path / "s.yaml")


def test_a_primary_on_a_kind_s_own_metric_is_compared_on_its_dataset():
    """Study (n) declares its primary on ``per_part`` (the parts kind's share of parts right), which
    is reported per held-out set: it is compared there, beside avg@k and pass@k."""
    def record(label, seed, value):
        sets = {"parts-test": {"avg@2": value / 2, "pass@2": value / 2, "per_part": value}}
        return {"label": label, "seed": seed, "eval": {"datasets": sets, "macro": {"avg@2": value / 2, "pass@2": value / 2}}}

    records = [record("grpo", s, 0.5 + 0.01 * s) for s in range(6)]
    records += [record("srpo", s, 0.6 + 0.012 * s) for s in range(6)]
    spec = {"eval": {"k": 2}, "baseline": "grpo",
            "primary": {"baseline": "grpo", "cells": ["srpo"], "metric": "per_part", "dataset": "parts-test"}}
    comps = comparisons(records, spec)
    first = [c for c in comps if c["primary"]]
    assert len(first) == 1 and first[0]["metric"] == "per_part" and first[0]["dataset"] == "parts-test"
    assert first[0]["mean"] == pytest.approx(0.1 + 0.002 * 2.5)
    assert {(c["metric"], c["dataset"]) for c in comps} == {("avg@2", "macro"), ("pass@2", "macro"),
                                                            ("avg@2", "parts-test"), ("pass@2", "parts-test"),
                                                            ("per_part", "parts-test")}
    # Without such a primary the comparisons are those of every other study: avg@k and pass@k.
    assert {c["metric"] for c in comparisons(records, {"eval": {"k": 2}, "baseline": "grpo"})} == {"avg@2", "pass@2"}
