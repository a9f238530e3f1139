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


# -- Game II (scripts/coordination_game_ii.py) -------------------------------------------------------------

_PATH_II = _PATH.with_name("coordination_game_ii.py")
_spec_ii = importlib.util.spec_from_file_location("coordination_game_ii", _PATH_II)
g2 = importlib.util.module_from_spec(_spec_ii)
sys.modules["coordination_game_ii"] = g2
_spec_ii.loader.exec_module(g2)

_DECL_II = {"game": {k: v for k, v in SMALL.__dict__.items() if k != "updates"}, "updates": 3,
            "match_shared_parameters": False}


@pytest.mark.parametrize("method, reward", [("srpo_sqrt", "joint"), ("dr_mas", "decomposable"), ("gspo", "joint")])
def test_a_game_ii_batch_is_study_l_run_by_run(method, reward):
    """Runs at different rates trained together in one batch follow study (l)'s one-run path: the
    same curves and joint KLs (float rounding apart) — each run's gradient is its own."""
    cell = g2.Cell("targets", 2, reward, "per_member", method)
    batch = g2.run_batch(_DECL_II, cell, [(0.1, 0), (0.2, 1)])
    for r in batch:
        ref = cg.run_one(SMALL, method=method, k=2, reward=reward, policy="per_member", lr=r["lr"], seed=r["seed"])
        assert max(abs(a - b) for a, b in zip(ref["curve"], r["reward_curve"])) < 1e-5
        assert r["joint_kl_mean"] == pytest.approx(ref["joint_kl_mean"], rel=1e-4)
        assert r["gain"][0] == 0 and r["reward_curve"][-1] != r["reward_curve"][0]  # it learned something


def test_game_ii_partition_is_srpos():
    from srpo.events import Event, Member, _balanced_partition

    g = torch.Generator().manual_seed(0)
    for parts in (1, 2, 3):
        ks = torch.randint(1, 6, (23,), generator=g).tolist()
        events = [Event(f"e{i}", f"e{i}", "t", "t", "x", 0, k,
                        [Member("r", "p", 0, [0, 0], [1, 1, 1], [1] * 3, [0.0] * 3) for _ in range(k)])
                  for i, k in enumerate(ks)]
        ours = g2.balanced_parts([5 * k for k in ks], parts)
        assert [[events[i] for i in p] for p in ours] == _balanced_partition(events, parts)


def test_modsum_success_and_mixed_calibration_are_exact():
    spec = cg.GameSpec(contexts=3, length=1, init_scale=0.5)
    layout = g2.Layout([3, 1, 2], group_size=2)
    game = g2.Game(spec, layout, seed=0, condition="modsum")
    net = cg.Policy(spec, 3, "per_member", torch.Generator().manual_seed(0))
    with torch.no_grad():
        table = net.table(game.prior)
    log_s, _ = g2.log_success(table, game, layout, spec.vocab)
    # Events (context, episode) in order, each its context's K rows: (1, 1) is row 7, (0, 0) rows 0-2.
    assert layout.rows_of(torch.tensor([3, 0, 4])).tolist() == [7, 0, 1, 2, 8, 9]
    V = spec.vocab
    for c, k in enumerate([3, 1, 2]):
        q = table[c, :k, 0, V].exp()
        exact = sum(math.prod(float(q[j, a[j]]) for j in range(k))
                    for a in itertools.product(range(V), repeat=k) if sum(a) % V == int(game.keys[c]))
        assert math.exp(float(log_s[c])) == pytest.approx(exact, rel=1e-5)
    # A mixed layout: each context's joint success starts near start_success whatever its K.
    spec = cg.GameSpec(contexts=64)
    ks = [1, 2, 4, 8] * 16
    layout = g2.Layout(ks, group_size=2)
    game = g2.Game(spec, layout, seed=1, condition="mixed")
    net = cg.Policy(spec, 8, "per_member", torch.Generator().manual_seed(0))
    with torch.no_grad():
        log_s, _ = g2.log_success(net.table(game.prior), game, layout, spec.vocab)
    for k in (1, 2, 4, 8):
        assert abs(float(log_s[torch.tensor(ks) == k].exp().mean()) - spec.start_success) < 0.06


def test_game_ii_study_runs_resumes_and_reports(tmp_path):
    decl = {**_DECL_II, "updates": 2, "output_dir": str(tmp_path / "out"), "lr_grid": [0.05, 0.1],
            "tuning_seeds": [100], "seeds": [0, 1, 2], "comparisons": [], "mixed_k": [1, 2, 2, 1],
            "conditions": {"targets": {"k": [2], "rewards": ["joint", "decomposable"], "policies": ["shared"],
                                       "methods": ["grpo", "srpo_sqrt", "oracle"]},
                           "mixed": {"k": [2], "rewards": ["joint"], "policies": ["per_member"],
                                     "methods": ["srpo_sum", "srpo_sqrt"]},
                           "modsum": {"k": [2], "rewards": ["joint"], "policies": ["shared"],
                                      "methods": ["grpo", "srpo_sqrt"]}}}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(decl))
    assert g2.main(["run", "--study", str(path), "--shard", "1/2"]) == 0
    assert g2.main(["run", "--study", str(path), "--shard", "2/2"]) == 0
    runs = g2.read_all(tmp_path / "out")
    assert len(runs) == len(g2.cells(decl)) * (2 + 3)  # tuning grid x seeds, then the fresh seeds
    shard = tmp_path / "out" / "runs.1of2.jsonl"
    lines = shard.read_text().splitlines()
    shard.write_text("\n".join(lines[:-2]) + "\n" + lines[-2][:40])  # a stop cut the last batch mid-line
    assert g2.main(["run", "--study", str(path), "--shard", "1/2"]) == 0
    assert len(g2.read_all(tmp_path / "out")) == len(runs)  # the cut batch ran again, nothing twice
    assert g2.main(["report", "--study", str(path)]) == 0
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    kinds = {c["kind"] for c in result["comparisons"]}
    assert kinds == {"srpo_sqrt − method", "oracle − method", "(srpo_sqrt − method): joint − decomposable"}
    assert all("p_t_holm" in c for c in result["comparisons"])
    assert any("share_of_oracle" in c for c in result["cells"])


def test_the_oracle_credits_each_members_own_hit_and_dr_mas_the_teams_reward():
    from srpo.objective.advantages import group_advantages

    layout = g2.Layout([2, 2], group_size=2)  # rows: (context, episode, member)
    hits = torch.tensor([1.0, 0, 1, 1, 0, 0, 0, 1])
    team = torch.tensor([0.0, 1, 0, 0])  # joint: both members hit
    groups = layout.ctx * 2 + layout.mem  # (context, member)
    oracle, _ = g2.advantages_of(g2.Cell("targets", 2, "joint", "per_member", "oracle"), layout, hits, team)
    dr_mas, _ = g2.advantages_of(g2.Cell("targets", 2, "joint", "per_member", "dr_mas"), layout, hits, team)
    sqrt, sizes = g2.advantages_of(g2.Cell("targets", 2, "joint", "per_member", "srpo_sqrt"), layout, hits, team)
    assert torch.equal(oracle, group_advantages(hits.double(), groups).float())
    assert torch.equal(dr_mas, group_advantages(team[layout.event].double(), groups).float())
    assert torch.equal(sqrt, group_advantages(team.double(), torch.tensor([0, 0, 1, 1])).float())
    assert sizes.tolist() == [2, 2, 2, 2]


def test_the_committed_game_declarations_load():
    root = _PATH.parents[1] / "configs" / "studies" / "controlled"
    cg.load_declaration(root / "coordination_game.yaml")
    decl = g2.load_declaration(root / "coordination_game_ii.yaml")
    assert len(g2.cells(decl)) == 204  # the count the declaration's budget states
    assert all(g2.layout_for(decl, c).kmax == c.k for c in g2.cells(decl))
    assert {len(g2.shard_cells(decl, (i, 2))) for i in (1, 2)} == {102}


def test_diagnostics_record_each_runs_own_measures_and_change_no_curve():
    """``diagnostics: true``: each run's gradient norm, clip fraction, log-ratio variance and KL per
    update (its own, though the batch is one loss), with the very curves of a batch without them."""
    cell = g2.Cell("targets", 2, "joint", "shared", "srpo_sqrt")
    plain = g2.run_batch(_DECL_II, cell, [(0.1, 0), (0.3, 1)])
    diag = g2.run_batch({**_DECL_II, "diagnostics": True}, cell, [(0.1, 0), (0.3, 1)])
    for a, b in zip(plain, diag):
        assert a["reward_curve"] == b["reward_curve"] and "diagnostics" not in a
        d = b["diagnostics"]
        assert set(d) == {"grad_norm", "clip_frac", "log_ratio_var", "kl_old"}
        assert all(len(v) == _DECL_II["updates"] for v in d.values()) and max(d["grad_norm"]) > 0
        assert all(0 <= f <= 1 for f in d["clip_frac"]) and max(d["log_ratio_var"]) > 0
    # A run alone in its batch has the same measures as inside the batch (they are its own).
    alone = g2.run_batch({**_DECL_II, "diagnostics": True}, cell, [(0.3, 1)])[0]["diagnostics"]
    assert alone["grad_norm"] == pytest.approx(diag[1]["diagnostics"]["grad_norm"], rel=1e-4)
    assert alone["clip_frac"] == pytest.approx(diag[1]["diagnostics"]["clip_frac"], abs=1e-6)


def test_one_rate_per_method_tuned_at_one_k_and_every_run_records_its_commit(tmp_path):
    decl = {**_DECL_II, "updates": 2, "output_dir": str(tmp_path / "out"), "lr_grid": [0.05, 0.1],
            "tuning_seeds": [100, 101], "seeds": [0, 1], "comparisons": [], "tune_at_k": 2, "tuning_statistic": "median",
            "conditions": {"targets": {"k": [1, 2], "rewards": ["joint"], "policies": ["shared"], "methods": ["srpo_sum"]}}}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(decl))
    assert g2.main(["run", "--study", str(path)]) == 0
    runs = g2.read_all(tmp_path / "out")
    assert {r["k"] for r in runs if r["phase"] == "tune"} == {2}  # tuned at K = 2 only
    main_rates = {r["k"]: r["lr"] for r in runs if r["phase"] == "main"}
    assert main_rates[1] == main_rates[2]  # K = 1 runs at the rate K = 2 chose
    assert all(r["commit"] and r["commit"] != "" for r in runs)


def test_the_stability_declaration_loads():
    decl = g2.load_declaration(_PATH.parents[1] / "studies" / "p_stability" / "game.yaml")
    assert len(g2.cells(decl)) == 16 and decl["tune_at_k"] == 4 and decl["diagnostics"]


def test_the_clip_ablation_runs_the_same_cells_with_and_without_the_clip_and_pairs_them():
    root = _PATH.parents[1] / "studies" / "m_clip_ablation"
    on, off = (g2.load_declaration(root / f"{n}.yaml") for n in ("clip_on", "clip_off"))
    assert g2.cells(on) == g2.cells(off) and len(g2.cells(on)) == 4
    assert on["game"]["clip_eps"] == 0.2 and off["game"]["clip_eps"] >= 1e9
    assert {k: v for k, v in on["game"].items() if k != "clip_eps"} == {k: v for k, v in off["game"].items() if k != "clip_eps"}
    spec = importlib.util.spec_from_file_location("game_clip_ablation", _PATH.with_name("game_clip_ablation.py"))
    ablation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablation)
    values = {}
    for s in range(6):  # sqrt leads by 0.1 with the clip, by 0.02 without: an interaction of 0.08
        for setting, lead in (("clip_on", 0.1), ("clip_off", 0.02)):
            for k in (8, 16):
                values.setdefault((setting, k, "grpo"), {})[s] = 0.3 + 0.01 * s
                values.setdefault((setting, k, "srpo_sqrt"), {})[s] = 0.3 + 0.01 * s + lead + 0.001 * (s % 3)
    comps = ablation.tests(values)
    assert len(comps) == 6
    inter = next(c for c in comps if c["comparison"] == "K = 16: interaction (clip on − clip off)")
    assert inter["mean"] == pytest.approx(0.08) and inter["n"] == 6
