"""Study (l)'s coordination game (scripts/coordination_game.py): its exact metrics agree with
sampling and enumeration, its methods go through srpo's own objective, and the study reports."""

import importlib.util
import itertools
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml

from srpo import stats

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "coordination_game.py"
_spec = importlib.util.spec_from_file_location("coordination_game", _PATH)
cg = importlib.util.module_from_spec(_spec)
sys.modules["coordination_game"] = cg  # dataclasses look their module up while the class is made
_spec.loader.exec_module(cg)

SMALL = cg.GameSpec(contexts=4, group_size=4, updates=3, epochs=2, minibatches=2)


def test_start_is_calibrated_and_hit_probabilities_match_sampling():
    spec = cg.GameSpec(contexts=64)
    for k in (1, 4):
        game = cg.Game(spec, k, seed=3)
        net = cg.Policy(spec, k, "per_member", torch.Generator().manual_seed(0))
        with torch.no_grad():
            table = net.table(game.prior)
        hit = cg.hit_probabilities(table, game.targets, start=spec.vocab)
        # The calibration: joint success near start_success at every K (noise is centred, not zero).
        assert abs(cg.expected_success(hit, "joint") - spec.start_success) < 0.06
        # Monte Carlo check of the exact hit probability of context 0, member 0.
        g = torch.Generator().manual_seed(1)
        n, prev, seq = 20000, torch.full((20000,), spec.vocab), []
        for pos in range(spec.length):
            prev = torch.multinomial(table[0, 0, pos, prev].exp(), 1, generator=g).squeeze(1)
            seq.append(prev)
        freq = (torch.stack(seq, 1) == game.targets[0, 0]).all(1).float().mean()
        assert abs(float(freq) - float(hit[0, 0])) < 4 * math.sqrt(float(hit[0, 0]) * (1 - float(hit[0, 0])) / n)


def test_joint_kl_equals_enumeration_over_joint_actions():
    spec = cg.GameSpec(contexts=2, vocab=3, length=2, init_scale=0.5)
    k = 2
    game = cg.Game(spec, k, seed=0)
    old = cg.Policy(spec, k, "shared", torch.Generator().manual_seed(0))
    new = cg.Policy(spec, k, "shared", torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = old.table(game.prior), new.table(game.prior)
    V, start = spec.vocab, spec.vocab
    seqs = list(itertools.product(range(V), repeat=spec.length))
    total = 0.0
    for c in range(spec.contexts):
        def logp(t, m, s):
            ctx, mem = torch.tensor([c]), torch.tensor([m])
            return float(cg.sequence_logprobs(t, ctx, mem, torch.tensor([s]), start).sum())
        for s0, s1 in itertools.product(seqs, seqs):  # every joint action of the two members
            lp_old = logp(a, 0, s0) + logp(a, 1, s1)
            total += math.exp(lp_old) * (lp_old - logp(b, 0, s0) - logp(b, 1, s1))
    assert cg.joint_kl(a, b, start) == pytest.approx(total / spec.contexts, rel=1e-3)


def test_set_reductions_tie_exactly_at_k1_and_differ_at_k4():
    runs = {m: cg.run_one(SMALL, method=m, k=1, reward="joint", policy="shared", lr=0.1, seed=0)
            for m in ("srpo_sum", "srpo_sqrt", "srpo_mean")}
    assert runs["srpo_sum"]["curve"] == runs["srpo_sqrt"]["curve"] == runs["srpo_mean"]["curve"]
    k4 = {m: cg.run_one(SMALL, method=m, k=4, reward="joint", policy="per_member", lr=0.1, seed=0)
          for m in ("srpo_sum", "srpo_sqrt", "grpo")}
    assert k4["srpo_sum"]["start"] == k4["srpo_sqrt"]["start"] == k4["grpo"]["start"], "paired: one start"
    assert len({tuple(r["curve"]) for r in k4.values()}) == 3
    assert all(len(r["joint_kl"]) == SMALL.updates and r["joint_kl_mean"] > 0 for r in k4.values())


def test_study_runs_resumes_and_reports_with_holm_and_tost(tmp_path):
    decl = {"output_dir": str(tmp_path / "out"), "game": {**SMALL.__dict__, "updates": 2},
            "methods": ["grpo", "srpo_sqrt"], "k": [1, 2], "rewards": ["joint", "decomposable"],
            "policies": ["shared"], "lr_grid": [0.05, 0.1], "tuning_seeds": [100], "seeds": [0, 1, 2]}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(decl))
    assert cg.main(["run", "--study", str(path)]) == 0
    runs = cg.read_all(tmp_path / "out")
    assert len(runs) == 8 * 2 * 1 + 8 * 3  # 8 cells; tune: 2 lr x 1 seed each; main: 3 seeds each
    assert cg.main(["run", "--study", str(path)]) == 0
    assert len(cg.read_all(tmp_path / "out")) == len(runs), "a rerun redoes nothing"
    assert cg.main(["report", "--study", str(path)]) == 0
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    # grpo vs sqrt per (reward, K): 4; the joint - decomposable contrast per K: 2.
    assert len(result["comparisons"]) == 6
    assert all("p_t_holm" in c and "tost" in c for c in result["comparisons"])
    assert "| shared | joint | 1 |" in (tmp_path / "out" / "results.md").read_text()


def test_tost_needs_the_interval_inside_the_margin():
    tight = [0.001, -0.002, 0.0015, -0.001, 0.0005, 0.0, -0.0005, 0.001]
    assert stats.tost(tight, 0.02) < 0.001
    wide = [0.05, -0.06, 0.04, -0.05, 0.03, -0.04]  # mean ~0, not significant, yet not equivalent
    assert stats.t_test_p(wide) > 0.5 and stats.tost(wide, 0.02) > 0.05
    assert stats.tost([0.1], 0.02) is None
