"""Study (m), Game II: is SRPO's edge in the coordination game about credit?

    python scripts/coordination_game_ii.py time   --study configs/studies/controlled/coordination_game_ii.yaml
    python scripts/coordination_game_ii.py run    --study configs/studies/controlled/coordination_game_ii.yaml --shard 1/2
    python scripts/coordination_game_ii.py run    --study configs/studies/controlled/coordination_game_ii.yaml --shard 2/2
    python scripts/coordination_game_ii.py report --study configs/studies/controlled/coordination_game_ii.yaml

Study (l)'s game (``scripts/coordination_game.py``) with what its re-analysis found missing (the
study file declares the metric, comparisons, margins and predictions):

* **a scale-free primary metric**: the share of the log-room gained,
  g = (log S_t − log S_0) / (−log S_0) per context, averaged over contexts, where S is the exact
  probability that the team succeeds.  The start S_0 ≈ 0.25 at every K and under both rewards, and
  the room (log 1 − log S_0) with it, so a gain means the same at K = 2 and at K = 16;
* **an oracle** (``oracle``): perfect credit — each member's own hit is its reward, grouped per
  (context, member), GRPO's loss on one-member events; every method reads as a share of it;
* **mixed set sizes in one batch** (condition ``mixed``): contexts of different K trained together,
  where c(K) (sqrt, sum, mean) weighs them differently;
* **a true coordination variant** (condition ``modsum``): each member emits one of V symbols and the
  team succeeds when they add up to the context's key modulo V — a member's best symbol depends on
  every other member's (no own hit exists: given the others, a member is right exactly when the
  team is, so the oracle's credit is the joint reward itself and no oracle runs there);
* **a shared policy with as many parameters** as the K per-member networks together.

How runs are computed: every run of one cell (the tuning grid × tuning seeds, or the fresh seeds
at the tuned rate) is one batched program.  Each run has its own game, networks, Adam state (at its
own rate), sampling and shuffling streams — the streams study (l) uses for that seed.  One
:func:`srpo.objective.policy_loss` call per mini-batch covers every run: each run's advantages are
divided by its own mini-batch's unit count and the loss is given a normaliser of 1 (the clipped
surrogate is linear in the advantage), so the loss is the sum of the runs' own losses and each run's
gradient is its own.  Advantages come from :func:`srpo.objective.advantages.group_advantages` with
the grouping of the method's :class:`srpo.methods.Method`; mini-batches follow
:func:`srpo.events.split_minibatches`' partition.  ``tests/apps/test_coordination_game.py`` checks a
batch against study (l)'s one-run path (the same curves) and the partition against srpo's.

Work is sharded by cell and resumable: each finished batch appends its runs to
``runs.<i>of<n>.jsonl`` in the study's output folder; a rerun skips every batch whose runs are all
there (a batch cut by a stop runs again).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from coordination_game import (METHOD_SPECS, GameSpec, Policy, member_sequence_kl, read_runs,  # noqa: E402
                               sequence_logprobs, write_report)
from srpo import stats  # noqa: E402
from srpo.methods import METHODS  # noqa: E402
from srpo.objective import LossInputs, LossSettings, policy_loss  # noqa: E402
from srpo.objective.advantages import group_advantages  # noqa: E402
from srpo.objective.losses import update_unit  # noqa: E402

CONDITIONS = ("targets", "mixed", "modsum")
REWARDS = ("joint", "decomposable")
ALL_METHODS = (*METHOD_SPECS, "oracle")


@dataclass(frozen=True)
class Cell:
    """One cell of the study: everything but the learning rate and the seed."""

    condition: str
    k: int  # the members per context (targets, modsum); the largest K (mixed)
    reward: str
    policy: str
    method: str

    def label(self) -> str:
        return f"{self.condition} K={self.k} {self.reward} {self.policy} {self.method}"


# -- the game of one seed: who acts where, targets, prior ------------------------------------------------

class Layout:
    """Which members act in which context, and the rows of one rollout.

    ks (C,) long: each context's K; present (C, Kmax) bool.  A rollout has G episodes per context,
    each one event of its context's K members; rows are ordered (context, episode, member), as in
    study (l): ctx, mem, event (N,) long; event_context (E,) long, event_size (E,) long and
    event_start (E,) long (its first row).
    """

    def __init__(self, ks: list[int], group_size: int):
        self.ks = torch.tensor(ks, dtype=torch.long)
        self.kmax = max(ks)
        C, G = len(ks), group_size
        self.present = torch.arange(self.kmax)[None, :] < self.ks[:, None]
        self.event_context = torch.arange(C).repeat_interleave(G)  # (E,)
        self.event_size = self.ks[self.event_context]
        self.event_start = torch.cumsum(self.event_size, 0) - self.event_size
        self.event = torch.arange(C * G).repeat_interleave(self.event_size)  # (N,)
        self.ctx = self.event_context[self.event]
        self.mem = torch.arange(len(self.event)) - self.event_start[self.event]

    def rows_of(self, events: torch.Tensor) -> torch.Tensor:
        """The rows of ``events`` (in that order, each event's members in order)."""
        sizes = self.event_size[events]
        first = torch.repeat_interleave(self.event_start[events], sizes)
        within = torch.arange(int(sizes.sum())) - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
        return first + within


def layout_for(decl: dict, cell: Cell) -> Layout:
    C, G = decl["game"]["contexts"], decl["game"]["group_size"]
    if cell.condition == "mixed":
        ks = list(decl["mixed_k"])
        if len(ks) != C or max(ks) != cell.k:
            raise SystemExit(f"mixed_k must list one K per context ({C}) with largest {cell.k}")
        return Layout(ks, G)
    return Layout([cell.k] * C, G)


class Game:
    """Targets and the fixed prior of one seed (study (l)'s, with a K per context).

    targets (C, Kmax, L) long; prior (C, Kmax, L, V + 1, V).  ``targets``/``mixed``: the target
    token's probability after the previous target token is start^(1/(K_c L)), so the joint success
    starts near ``start_success`` in every context; with one K everywhere this is study (l)'s game
    of that seed exactly.  ``modsum`` (L = 1): the prior is the noise alone and ``keys`` (C,) is
    each context's key.
    """

    def __init__(self, spec: GameSpec, layout: Layout, seed: int, condition: str):
        g = torch.Generator().manual_seed(10_000 + seed)
        C, V, L, K = spec.contexts, spec.vocab, spec.length, layout.kmax
        self.condition = condition
        self.targets = torch.randint(0, V, (C, K, L), generator=g)
        noise = 0.3 * torch.randn(C, K, L, V + 1, V, generator=g)
        self.keys = self.targets[:, 0, 0]
        if condition == "modsum":
            self.prior = noise
            return
        bias = []
        for k in layout.ks.tolist():  # in double, as study (l) computes its one value
            p = spec.start_success ** (1.0 / (k * L))
            bias.append(math.log(p * (V - 1) / (1 - p)))
        prior = noise.clone()
        prev_target = torch.cat([torch.full((C, K, 1), V), self.targets[:, :, :-1]], dim=2)  # (C, K, L)
        idx = prev_target.unsqueeze(-1).unsqueeze(-1).expand(C, K, L, 1, V)
        row = prior.gather(3, idx)
        row = row - row.mean(-1, keepdim=True)
        add = torch.tensor(bias, dtype=torch.float32).view(C, 1, 1, 1, 1).expand(C, K, L, 1, 1).contiguous()
        row = row.scatter_add(4, self.targets.view(C, K, L, 1, 1), add)
        self.prior = prior.scatter(3, idx, row)


def log_success(table: torch.Tensor, game: Game, layout: Layout, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(C,) log-probability that the team succeeds in each context, and (C, Kmax) each member's
    log hit probability (0 where absent; ``modsum``: zeros — no own hit).  table (C, Kmax, L, V+1, V)."""
    C, K = layout.present.shape
    if game.condition == "modsum":
        V = table.shape[-1]
        q = table[:, :, 0, start].double().exp()  # (C, K, V); float64: a near-certain wrong sum stays > 0
        identity = torch.nn.functional.one_hot(torch.zeros(C, K, dtype=torch.long), V).to(q.dtype)
        q = torch.where(layout.present[..., None], q, identity)  # an absent member adds 0
        shift = torch.nn.functional.one_hot((torch.arange(V)[:, None] + torch.arange(V)[None, :]) % V, V).to(q.dtype)
        dist = identity[:, 0]  # (C, V): the sum so far, modulo V
        for j in range(K):
            dist = torch.einsum("ca,cb,abz->cz", dist, q[:, j], shift)
        return dist.gather(1, game.keys[:, None]).squeeze(1).log().float(), torch.zeros(C, K)
    L = game.targets.shape[2]
    ctx = torch.arange(C).repeat_interleave(K)
    mem = torch.arange(K).repeat(C)
    member = sequence_logprobs(table, ctx, mem, game.targets.reshape(C * K, L), start).sum(1).view(C, K)
    member = torch.where(layout.present, member, torch.zeros_like(member))
    return member.sum(1), member


def balanced_parts(costs: list[int], parts: int) -> list[list[int]]:
    """The positions of each mini-batch: srpo's event-atomic greedy partition by cost (largest
    first, ties by position), each part in input order (``srpo.events._balanced_partition``)."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    load, assign = [0] * parts, [[] for _ in range(parts)]
    for i in order:
        p = min(range(parts), key=lambda q: (load[q], q))
        assign[p].append(i)
        load[p] += costs[i]
    return [sorted(a) for a in assign]


# -- one batch of runs ------------------------------------------------------------------------------------

@dataclass
class Run:
    """One run of a batch: its rate, seed, game, networks and streams."""

    lr: float
    seed: int
    game: Game
    net: Policy
    sampler: torch.Generator
    shuffler: torch.Generator
    log_s0: torch.Tensor  # (C,) log success at the start


def matched_hidden(spec: GameSpec, k: int) -> int:
    """The shared network's width with as many parameters as K per-member networks of width H."""
    C, L, V, H = spec.contexts, spec.length, spec.vocab, spec.hidden
    per_member = (C + L + V + 1 + V) * H + V
    return max(1, round((k * per_member - V) / (C + L + V + 1 + k + V)))


def policy_spec(spec: GameSpec, cell: Cell, match_shared: bool) -> GameSpec:
    if cell.policy == "shared" and match_shared:
        return replace(spec, hidden=matched_hidden(spec, cell.k))
    return spec


def _method(cell: Cell):
    """(loss name, set reduction, one-member events?, group by member?, reward kind)."""
    if cell.method == "oracle":
        return "grpo", "sqrt", True, True, "own"
    name, reduction = METHOD_SPECS[cell.method]
    m = METHODS[name]
    if not set(m.group_by) <= {"task", "role", "event_type", "turn"}:
        raise SystemExit(f"method {cell.method}: grouping {m.group_by} has no meaning in this game")
    return m.loss, reduction, m.per_member, "role" in m.group_by, cell.reward


def start_runs(spec: GameSpec, pspec: GameSpec, cell: Cell, layout: Layout, lrs_seeds) -> list[Run]:
    runs = []
    for lr, seed in lrs_seeds:
        game = Game(spec, layout, seed, cell.condition)
        torch.manual_seed(seed)
        net = Policy(pspec, layout.kmax, cell.policy, torch.Generator().manual_seed(20_000 + seed))
        with torch.no_grad():
            log_s0, _ = log_success(net.table(game.prior), game, layout, spec.vocab)
        runs.append(Run(lr, seed, game, net, torch.Generator().manual_seed(30_000 + seed),
                        torch.Generator().manual_seed(40_000 + seed), log_s0))
    return runs


def rollout(run: Run, table: torch.Tensor, layout: Layout, spec: GameSpec, reward: str):
    """Sample every row; return tokens (N, L), behaviour log-probs (N, L), own hits (N,) and the
    team's reward per event (E,) — as study (l) samples (same stream, same order)."""
    start, N = spec.vocab, len(layout.ctx)
    tokens = torch.empty(N, spec.length, dtype=torch.long)
    prev = torch.full((N,), start, dtype=torch.long)
    for pos in range(spec.length):
        probs = table[layout.ctx, layout.mem, pos, prev].exp()
        prev = torch.multinomial(probs, 1, generator=run.sampler).squeeze(1)
        tokens[:, pos] = prev
    logp = sequence_logprobs(table, layout.ctx, layout.mem, tokens, start)
    E = len(layout.event_context)
    if run.game.condition == "modsum":
        total = torch.zeros(E, dtype=torch.long).index_add_(0, layout.event, tokens[:, 0])
        team = ((total % spec.vocab) == run.game.keys[layout.event_context]).float()
        return tokens, logp, team[layout.event], team
    hits = (tokens == run.game.targets[layout.ctx, layout.mem]).all(1).float()
    got = torch.zeros(E).index_add_(0, layout.event, hits)
    team = (got == layout.event_size).float() if reward == "joint" else got / layout.event_size
    return tokens, logp, hits, team


def advantages_of(cell: Cell, layout: Layout, hits: torch.Tensor, team: torch.Tensor):
    """(units of one rollout: events or one-member events) → advantages (float32), the rows of
    each, and each one's partition cost."""
    _, _, split, by_member, kind = _method(cell)
    if split:
        rewards = hits if kind == "own" else team[layout.event]
        groups = layout.ctx * layout.kmax + layout.mem if by_member else layout.ctx
        adv = group_advantages(rewards.double(), groups).float()
        return adv, None
    adv = group_advantages(team.double(), layout.event_context).float()
    return adv, layout.event_size


def run_batch(decl: dict, cell: Cell, lrs_seeds: list[tuple[float, int]], diagnose: bool | None = None) -> list[dict]:
    """Train every (rate, seed) of one cell together; one result per run (curves included).
    ``diagnose`` (default: the study's ``diagnostics``): record each run's own measures per update."""
    base = GameSpec(**decl["game"])
    spec = replace(base, length=1) if cell.condition == "modsum" else base
    layout = layout_for(decl, cell)
    pspec = policy_spec(spec, cell, bool(decl.get("match_shared_parameters", True)))
    loss_name, reduction, split, _, _ = _method(cell)
    unit = update_unit(loss_name)
    runs = start_runs(spec, pspec, cell, layout, lrs_seeds)
    opt = torch.optim.Adam([{"params": list(r.net.parameters()), "lr": r.lr} for r in runs])
    settings = LossSettings(clip_eps=spec.clip_eps, set_reduction=reduction)
    start, L, P = spec.vocab, spec.length, spec.minibatches
    updates = int(decl["updates"])
    with torch.no_grad():
        tables = [r.net.table(r.game.prior) for r in runs]
    records = [_Record(r, layout) for r in runs]
    for rec, table in zip(records, tables):
        rec.add(table, layout, start, cell.reward)
    clip = []
    diagnose = bool(decl.get("diagnostics", False)) if diagnose is None else diagnose
    for _ in range(updates):
        batches = []
        for run, table in zip(runs, tables):
            tokens, logp, hits, team = rollout(run, table, layout, spec, cell.reward)
            adv, costs = advantages_of(cell, layout, hits, team)
            batches.append((tokens, logp, adv, costs))
        old_tables, fracs, steps = tables, [], []
        for _ in range(spec.epochs):
            parts = [_minibatches(run, b[2], b[3], P, layout, split) for run, b in zip(runs, batches)]
            for p in range(P):
                frac, per_run = _step(opt, runs, batches, [pr[p] for pr in parts], layout, loss_name, unit, settings,
                                      start, L, diagnose)
                fracs.append(frac)
                steps.append(per_run)
        if diagnose:  # each run's measures, averaged over this update's optimizer steps
            for i, rec in enumerate(records):
                rec.add_diagnostics([step[i] for step in steps])
        with torch.no_grad():
            tables = [r.net.table(r.game.prior) for r in runs]
        for rec, old, new in zip(records, old_tables, tables):
            rec.kl.append(float((member_sequence_kl(old, new, start) * layout.present).sum(1).mean()))
            rec.add(new, layout, start, cell.reward)
        clip.append(sum(fracs) / len(fracs))
    return [rec.result(cell, decl, clip) for rec in records]


def _minibatches(run: Run, adv, costs, parts: int, layout: Layout, split: bool):
    """This run's mini-batches of one epoch: (its rows, each row's unit index in the part, the
    part's advantages), from a fresh shuffle of its units."""
    n = len(adv)
    order = torch.randperm(n, generator=run.shuffler)
    unit_costs = [1] * n if split else (costs[order] * 1).tolist()
    out = []
    for positions in balanced_parts(unit_costs, parts):
        units = order[torch.tensor(positions, dtype=torch.long)]
        if split:
            rows, index = units, torch.arange(len(units))
        else:
            rows = layout.rows_of(units)
            index = torch.repeat_interleave(torch.arange(len(units)), layout.event_size[units])
        out.append((rows, index, adv[units]))
    return out


def _step(opt, runs, batches, parts, layout, loss_name, unit, settings, start, L, diagnose=False):
    """One Adam step of every run on its own mini-batch; the runs' clip fraction (pooled), and with
    ``diagnose`` each run's own measures of this step (:func:`_run_diagnostics`), else None."""
    logprobs, old, index, advs, sizes, offset = [], [], [], [], [], 0
    for run, (tokens, logp, _, _), (rows, idx, adv) in zip(runs, batches, parts):
        table = run.net.table(run.game.prior)
        logprobs.append(sequence_logprobs(table, layout.ctx[rows], layout.mem[rows], tokens[rows], start))
        old.append(logp[rows])
        count = {"event": len(adv), "member": len(rows), "token": len(rows) * L}[unit]
        advs.append(adv / count)  # the loss is linear in the advantage: this run's mean over its units
        index.append(idx + offset)
        sizes.append(layout.ks[layout.ctx[rows]])
        offset += len(adv)
    lp = torch.cat(logprobs)
    loss, metrics = policy_loss(loss_name, LossInputs(
        logprobs=lp, old_logprobs=torch.cat(old), mask=torch.ones_like(lp), event_index=torch.cat(index),
        advantages=torch.cat(advs), normalizer=1, member_set_sizes=torch.cat(sizes)), settings)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    per_run = _run_diagnostics(runs, parts, logprobs, old, index, advs, sizes, loss_name, settings) if diagnose else None
    opt.step()
    return float(metrics["clip_frac"]), per_run


def _run_diagnostics(runs, parts, logprobs, old, index, advs, sizes, loss_name, settings) -> list[dict]:
    """Per run, this optimizer step's gradient norm (its own network's, before the step: the loss is
    the sum of the runs' losses, so each network's gradient is its run's), its clip fraction, the
    variance of the log-ratio of its update units (the set log-ratio for srpo) and the k3 KL to
    π_old per token — the loss's own metrics on the run's slice alone (no gradient)."""
    out = []
    with torch.no_grad():
        for run, (rows, _, adv), lp, ol, idx, ad, k in zip(runs, parts, logprobs, old, index, advs, sizes):
            norm = torch.sqrt(sum((p.grad.detach() ** 2).sum() for p in run.net.parameters() if p.grad is not None))
            first = int(idx.min()) if len(idx) else 0
            _, m = policy_loss(loss_name, LossInputs(
                logprobs=lp.detach(), old_logprobs=ol, mask=torch.ones_like(lp), event_index=idx - first,
                advantages=ad, normalizer=1, member_set_sizes=k), settings)
            spreads = [float(v) for key, v in m.items() if key.startswith("by_k/unit_log_ratio_std/")]
            out.append({"grad_norm": float(norm), "clip_frac": float(m["clip_frac"]),
                        "log_ratio_var": sum(x * x for x in spreads) / len(spreads) if spreads else 0.0,
                        "kl_old": float(m["approx_kl"])})
    return out


class _Record:
    """One run's curves: the share of the log-room gained, the expected reward and the members'
    mean hit probability, after every update (and at the start)."""

    def __init__(self, run: Run, layout: Layout):
        self.run, self.gain, self.reward, self.hit, self.kl = run, [], [], [], []
        self.by_k: dict[int, list[float]] = {k: [] for k in sorted(set(layout.ks.tolist()))}
        self.diagnostics: dict[str, list[float]] = {}  # measure → one value per update (diagnostics: true)

    def add_diagnostics(self, steps: list[dict]) -> None:
        """One update's measures: the mean over its optimizer steps."""
        for key in steps[0]:
            self.diagnostics.setdefault(key, []).append(sum(s[key] for s in steps) / len(steps))

    def add(self, table, layout: Layout, start: int, reward: str) -> None:
        log_s, member = log_success(table, self.run.game, layout, start)
        gain = (log_s - self.run.log_s0) / (-self.run.log_s0)  # (C,)
        self.gain.append(float(gain.mean()))
        for k, values in self.by_k.items():
            values.append(float(gain[layout.ks == k].mean()))
        hit = member.exp() * layout.present
        mean_hit = hit.sum(1) / layout.ks
        self.hit.append(float(mean_hit.mean()) if self.run.game.condition != "modsum" else None)
        self.reward.append(float(log_s.exp().mean()) if reward == "joint" else float(mean_hit.mean()))

    def result(self, cell: Cell, decl: dict, clip: list[float]) -> dict:
        last = int(decl.get("final_window", 10))
        curve = self.gain
        return {"condition": cell.condition, "k": cell.k, "reward": cell.reward, "policy": cell.policy,
                "method": cell.method, "lr": self.run.lr, "seed": self.run.seed,
                "primary": sum(curve[1:]) / (len(curve) - 1), "final": sum(curve[-last:]) / last,
                "start_success": float(self.run.log_s0.exp().mean()), "gain": curve, "reward_curve": self.reward,
                "member_hit": self.hit, "joint_kl_mean": sum(self.kl) / len(self.kl),
                "final_by_k": {str(k): sum(v[-last:]) / last for k, v in self.by_k.items()},
                "clip_frac_mean": sum(clip) / len(clip),
                **({"diagnostics": self.diagnostics, "joint_kl": self.kl} if self.diagnostics else {})}


# -- the study: declaration, cells, tuning, fresh seeds ---------------------------------------------------

def load_declaration(path: Path) -> dict:
    d = yaml.safe_load(path.read_text())
    for key in ("output_dir", "game", "updates", "conditions", "lr_grid", "tuning_seeds", "seeds", "comparisons"):
        if key not in d:
            raise SystemExit(f"{path}: the study file needs {key!r}")
    for name, c in d["conditions"].items():
        if name not in CONDITIONS:
            raise SystemExit(f"{path}: unknown condition {name!r}; valid: {', '.join(CONDITIONS)}")
        bad = [m for m in c["methods"] if m not in ALL_METHODS]
        if bad:
            raise SystemExit(f"{path}: condition {name}: unknown method {bad[0]!r}; valid: {', '.join(ALL_METHODS)}")
    return d


def cells(decl: dict) -> list[Cell]:
    """Every cell; the oracle ignores the team's reward, so it runs once per (condition, K, policy)
    (as ``joint``) and is compared under both rewards."""
    out = []
    for condition, c in decl["conditions"].items():
        for k in c["k"]:
            for reward in c["rewards"]:
                for policy in c["policies"]:
                    for method in c["methods"]:
                        if method == "oracle" and reward != "joint":
                            continue
                        out.append(Cell(condition, int(k), reward, policy, method))
    return out


def cost(cell: Cell, decl: dict) -> float:
    """A relative cost of one cell (member rows per rollout), to deal cells evenly to shards."""
    ks = decl["mixed_k"] if cell.condition == "mixed" else [cell.k] * decl["game"]["contexts"]
    return sum(ks) + 4.0


def shard_cells(decl: dict, shard: tuple[int, int]) -> list[Cell]:
    """Cells dealt to shards largest first (round robin), so shards take about equal time."""
    ranked = sorted(cells(decl), key=lambda c: (-cost(c, decl), c.label()))
    return [c for i, c in enumerate(ranked) if i % shard[1] == shard[0] - 1]


def read_all(out: Path) -> list[dict]:
    """Every finished run in ``out`` (the shards' files, or the archive), once each: a batch cut by
    a stop and run again wrote some runs twice, the same."""
    files = sorted(out.glob("runs.*.jsonl")) + sorted(out.glob("runs*.jsonl.gz"))
    return list({key_of(r): r for p in files for r in read_runs(p)}.values())


def key_of(r: dict) -> tuple:
    return (r["phase"], r["condition"], r["k"], r["reward"], r["policy"], r["method"], float(r["lr"]), r["seed"])


def cell_of(r: dict) -> Cell:
    return Cell(r["condition"], r["k"], r["reward"], r["policy"], r["method"])


def tuned_lr(decl: dict, runs: list[dict], cell: Cell) -> float:
    """The rate with the best mean (or median: ``tuning_statistic``) primary metric over the tuning seeds."""
    scores = {}
    for lr in decl["lr_grid"]:
        vals = [r["primary"] for r in runs if r["phase"] == "tune" and cell_of(r) == cell and float(r["lr"]) == float(lr)]
        if len(vals) != len(decl["tuning_seeds"]):
            raise RuntimeError(f"{cell.label()}: tuning incomplete at lr={lr}")
        # The mean over tuning seeds (study (m)), or the median where the study says so (one run that
        # collapses then does not decide the rate).
        mean = statistics.median(vals) if decl.get("tuning_statistic") == "median" else sum(vals) / len(vals)
        scores[float(lr)] = mean if math.isfinite(mean) else -math.inf  # a diverged rate is never chosen
    return max(scores, key=lambda lr: (scores[lr], -lr))  # ties: the smaller rate


def source_commit() -> str:
    """The commit the running code is at (``unknown`` outside a git checkout), recorded in every run;
    a tree with uncommitted changes is marked ``+dirty``."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def tuning_cell(decl: dict, cell: Cell) -> Cell:
    """The cell whose tuning sets ``cell``'s rate: itself, or with ``tune_at_k`` the same cell at that
    K (one rate per method at every K: how a reduction behaves as K grows at one rate)."""
    return replace(cell, k=int(decl["tune_at_k"])) if "tune_at_k" in decl else cell


def run_study(decl: dict, out: Path, shard: tuple[int, int]) -> None:
    """Every tuning batch of this shard's cells, then every main batch (a main batch at a rate tuned
    in another cell — ``tune_at_k`` — needs that cell's tuning on disk, from any shard)."""
    out.mkdir(parents=True, exist_ok=True)
    commit = source_commit()
    log = out / f"runs.{shard[0]}of{shard[1]}.jsonl"
    runs = read_all(out)
    done = {key_of(r) for r in runs}
    mine = shard_cells(decl, shard)
    t0 = time.time()
    with log.open("a") as f:
        for phase in ("tune", "main"):
            if phase == "main":  # other shards' tuning, finished meanwhile
                runs = list({key_of(r): r for r in [*read_all(out), *runs]}.values())
            for i, cell in enumerate(mine):
                if phase == "tune":
                    if tuning_cell(decl, cell) != cell:
                        continue
                    todo = [(float(lr), s) for lr in decl["lr_grid"] for s in decl["tuning_seeds"]]
                else:
                    try:
                        lr = tuned_lr(decl, runs, tuning_cell(decl, cell))
                    except RuntimeError as err:
                        raise SystemExit(f"{cell.label()}: {err} - run the shard that tunes it first") from None
                    todo = [(lr, s) for s in decl["seeds"]]
                keys = [(phase, cell.condition, cell.k, cell.reward, cell.policy, cell.method, lr, s) for lr, s in todo]
                if all(k in done for k in keys):
                    continue
                # The per-run measures are read from the main runs only (tuning picks a rate).
                results = run_batch(decl, cell, todo, diagnose=phase == "main" and bool(decl.get("diagnostics")))
                for r in results:
                    r = {"phase": phase, **r, "commit": commit}
                    if phase == "tune":  # pooled over rates: no one run's figure
                        r.pop("clip_frac_mean")
                    runs.append(r)
                    f.write(json.dumps(r) + "\n")
                f.flush()  # the batch is on disk as a whole before the next starts
                print(f"[{i + 1}/{len(mine)}] {phase} {cell.label()}: {len(results)} runs "
                      f"({time.time() - t0:.0f} s)", flush=True)


# -- the report ------------------------------------------------------------------------------------------

METRICS = ("primary", "final")


def by_cell(runs: list[dict]) -> dict[Cell, dict[int, dict]]:
    out: dict[Cell, dict[int, dict]] = {}
    for r in runs:
        if r["phase"] == "main":
            out.setdefault(cell_of(r), {})[r["seed"]] = r
    return out


def _oracle(cell: Cell) -> Cell:
    return replace(cell, reward="joint", method="oracle")


def comparisons(decl: dict, table: dict[Cell, dict[int, dict]]) -> list[dict]:
    """Every declared paired comparison on both metrics (positive: the first named ahead):
    reference − method in each cell; oracle − method (the gap to perfect credit); the contrast of the
    reference's edge under the joint and the decomposable reward; all Holm-adjusted together, and
    TOST at the margin for each."""
    ref, margin = decl.get("reference", "srpo_sqrt"), float(decl.get("equivalence_margin", 0.02))
    out = []

    def add(kind, cell, a, b, diffs_of, metric):
        common = sorted(set.intersection(*(set(table[c]) for c in (a, b))))
        diffs = [diffs_of(s) for s in common]
        out.append({"kind": kind, "metric": metric, "condition": cell.condition, "k": cell.k, "reward": cell.reward,
                    "policy": cell.policy, "method": cell.method, **stats.paired(diffs),
                    "tost": stats.tost(diffs, margin)})

    for cell in sorted(table, key=Cell.label):
        for metric in METRICS:
            r = replace(cell, method=ref)
            if cell.method not in (ref, "oracle") and r in table:
                add(f"{ref} − method", cell, r, cell, lambda s, a=r, b=cell, m=metric: table[a][s][m] - table[b][s][m],
                    metric)
            o = _oracle(cell)
            if cell.method != "oracle" and o in table:
                add("oracle − method", cell, o, cell, lambda s, a=o, b=cell, m=metric: table[a][s][m] - table[b][s][m],
                    metric)
            d = replace(cell, reward="decomposable")
            rj, rd = replace(cell, method=ref), replace(d, method=ref)
            if cell.reward == "joint" and cell.method not in (ref, "oracle") and all(c in table for c in (d, rj, rd)):
                def contrast(s, m=metric, cell=cell, d=d, rj=rj, rd=rd):
                    return (table[rj][s][m] - table[cell][s][m]) - (table[rd][s][m] - table[d][s][m])
                common = sorted(set.intersection(*(set(table[c]) for c in (cell, d, rj, rd))))
                diffs = [contrast(s) for s in common]
                out.append({"kind": f"({ref} − method): joint − decomposable", "metric": metric,
                            "condition": cell.condition, "k": cell.k, "reward": "joint − decomposable",
                            "policy": cell.policy, "method": cell.method, **stats.paired(diffs),
                            "tost": stats.tost(diffs, margin)})
    stats.adjust(out)
    return out


def summaries(decl: dict, table: dict[Cell, dict[int, dict]]) -> list[dict]:
    grid = [float(x) for x in decl["lr_grid"]]
    out = []
    for cell in sorted(table, key=Cell.label):
        seeds = table[cell]
        row = {"condition": cell.condition, "k": cell.k, "reward": cell.reward, "policy": cell.policy,
               "method": cell.method, "n": len(seeds), "lr": seeds[min(seeds)]["lr"]}
        row["lr_at_edge"] = row["lr"] in (grid[0], grid[-1])
        for metric in METRICS:
            row[metric], row[f"{metric}_se"] = stats.mean_se([r[metric] for r in seeds.values()])
        o = table.get(_oracle(cell))
        if o and cell.method != "oracle":  # a share of perfect credit: the ratio of the means
            row["share_of_oracle"] = row["primary"] / (sum(r["primary"] for r in o.values()) / len(o))
        row["joint_kl"] = sum(r["joint_kl_mean"] for r in seeds.values()) / len(seeds)
        row["clip_frac"] = sum(r.get("clip_frac_mean", 0.0) for r in seeds.values()) / len(seeds)
        row["start_success"] = sum(r["start_success"] for r in seeds.values()) / len(seeds)
        # Descriptive, not declared: how many runs ended below their start (the log scale makes one
        # collapsed run weigh on a mean), and the median that such runs do not move.
        row["below_start"] = sum(r["final"] < 0 for r in seeds.values())
        row["primary_median"] = statistics.median(r["primary"] for r in seeds.values())
        out.append(row)
    return out


def report(decl: dict, source: Path) -> dict:
    runs = read_all(source)
    table = by_cell(runs)
    result = {"declaration": decl, "cells": summaries(decl, table), "comparisons": comparisons(decl, table),
              "runs": sum(len(v) for v in table.values()), "tuning_runs": sum(r["phase"] == "tune" for r in runs)}
    result["predictions"] = predictions(result)
    return result


def _find(comparisons_: list[dict], kind: str, metric: str, condition: str, reward: str, policy: str, k: int,
          method: str) -> dict | None:
    for c in comparisons_:
        if (c["kind"], c["metric"], c["condition"], c["reward"], c["policy"], c["k"], c["method"]) == (
                kind, metric, condition, reward, policy, k, method):
            return c
    return None


def _sig(c: dict | None, sign: int) -> bool:
    return c is not None and c["significant"] and c["mean"] * sign > 0


def predictions(result: dict) -> list[dict]:
    """The declared predictions P1–P5, each as a count of the comparisons that bear it out (Holm,
    primary metric; the rules that turn the study file's words into counts are written here, in
    the report, and apply to both metrics alike)."""
    comps, ks = result["comparisons"], (2, 4, 8, 16)
    out = []
    for metric in ("primary", "final"):
        def f(kind, cond, reward, policy, k, method):
            return _find(comps, kind, metric, cond, reward, policy, k, method)

        pairs = [(p, m) for p in ("per_member", "shared") for m in ("grpo", "gspo")]
        # A study file may declare fewer cells (the test's): what it did not run is not counted.
        edge = [(p, m, k, c) for p, m in pairs for k in ks
                for c in [f("srpo_sqrt − method", "targets", "joint", p, k, m)] if c is not None]
        ahead = sum(_sig(c, +1) for *_, c in edge)
        behind = sum(_sig(c, -1) for *_, c in edge)
        growing = sum(len(run) > 1 and all(a[3]["mean"] < b[3]["mean"] for a, b in zip(run, run[1:]))
                      for run in ([e for e in edge if e[:2] == pair] for pair in pairs))
        c3 = [c for p, m in pairs for k in ks
              for c in [f("(srpo_sqrt − method): joint − decomposable", "targets", "joint − decomposable", p, k, m)]
              if c is not None]
        modsum = [c for p in ("per_member", "shared") for m in ("grpo", "dr_mas") for k in ks
                  for c in [f("srpo_sqrt − method", "modsum", "joint", p, k, m)] if c is not None]
        mixed = [c for p in ("per_member", "shared") for m in ("srpo_sum", "srpo_mean")
                 for c in [f("srpo_sqrt − method", "mixed", "joint", p, 16, m)] if c is not None]
        ties = [c for c in comps if c["metric"] == metric and c["k"] == 1 and c["kind"] == "srpo_sqrt − method"]
        exact = [c for c in ties if c["method"] in ("srpo_sum", "srpo_mean")]
        others = [c for c in ties if c["method"] not in ("srpo_sum", "srpo_mean")]
        above = [c for c in comps if c["metric"] == metric and c["kind"] == "oracle − method" and _sig(c, -1)]
        out += [
            {"metric": metric, "prediction": "P1 credit: sqrt ahead of grpo/gspo (targets, joint), K = 2–16, both policies",
             "holds": f"{ahead} of {len(edge)} ahead, {behind} behind (Holm); the edge grows with K in {growing} of "
                      f"{len(pairs)} series"},
            {"metric": metric, "prediction": "P1 credit: the contrast C3 positive (vs grpo/gspo)",
             "holds": f"{sum(_sig(c, +1) for c in c3)} of {len(c3)} positive, {sum(_sig(c, -1) for c in c3)} negative"},
            {"metric": metric, "prediction": "P1 credit: sqrt ahead of grpo and dr_mas in modsum",
             "holds": f"{sum(_sig(c, +1) for c in modsum)} of {len(modsum)} ahead, {sum(_sig(c, -1) for c in modsum)} behind"},
            {"metric": metric, "prediction": "P2 step size: C3 within ±margin (TOST) at every K",
             "holds": f"{sum(c['tost'] < 0.05 for c in c3)} of {len(c3)} equivalent"},
            {"metric": metric, "prediction": "P3 reduction: sqrt ahead of sum and mean in mixed, joint",
             "holds": f"{sum(_sig(c, +1) for c in mixed)} of {len(mixed)} ahead, {sum(_sig(c, -1) for c in mixed)} behind"},
            {"metric": metric, "prediction": "P4 ties at K = 1: sum = sqrt = mean exactly; grpo, gspo, dr_mas within ±margin",
             "holds": f"{sum(c['mean'] == 0 and c['sd'] == 0 for c in exact)} of {len(exact)} exact; "
                      f"{sum(c['tost'] < 0.05 for c in others)} of {len(others)} equivalent"},
            {"metric": metric, "prediction": "P5 nothing above the oracle beyond noise",
             "holds": f"{len(above)} comparisons above it (Holm): "
                      + (", ".join(f"{c['method']} {c['condition']} {c['reward']} {c['policy']} K={c['k']} "
                                   f"{-c['mean']:+.3f}" for c in above) or "none")},
        ]
    return out


def markdown(result: dict) -> str:
    decl = result["declaration"]
    lines = [f"Primary: the share of the log-room gained, mean over updates 1–{decl['updates']}; co-primary "
             f"(final): its mean over the last {decl.get('final_window', 10)} updates.  {len(decl['seeds'])} fresh "
             f"paired seeds per cell at the rate tuned on {len(decl['tuning_seeds'])} other seeds.", "",
             "Declared predictions, counted by the rules in `predictions()` (Holm-significant comparisons):", "",
             "| metric | prediction | what the comparisons show |", "|---|---|---|"]
    lines += [f"| {p['metric']} | {p['prediction']} | {p['holds']} |" for p in result.get("predictions", [])]
    lines += ["", "Per cell (descriptive beside the declared metrics: the median primary, and how many of "
              "the runs ended below their start — on a log scale one collapsed run weighs on a mean):", "",
              "| condition | reward | policy | K | method | rate | primary ± SE | final ± SE | share of oracle | "
              "joint KL | clip | median primary | ended below start |",
              "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in result["cells"]:
        edge = " (edge)" if c["lr_at_edge"] else ""
        share = f"{c['share_of_oracle']:.2f}" if "share_of_oracle" in c else "–"
        lines.append(f"| {c['condition']} | {c['reward']} | {c['policy']} | {c['k']} | {c['method']} | {c['lr']:g}{edge} | "
                     f"{c['primary']:.3f} ± {c['primary_se']:.3f} | {c['final']:.3f} ± {c['final_se']:.3f} | {share} | "
                     f"{c['joint_kl']:.4f} | {c['clip_frac']:.3f} | {c['primary_median']:.3f} | "
                     f"{c['below_start']}/{c['n']} |")
    lines += ["", f"Paired comparisons, Holm across all {len(result['comparisons'])}; TOST at "
              f"±{decl.get('equivalence_margin', 0.02)}:", "",
              "| comparison | metric | condition | reward | policy | K | method | diff | 95% CI | p (Holm) | TOST p | verdict |",
              "|---|---|---|---|---|---:|---|---:|---|---:|---:|---|"]
    for c in result["comparisons"]:
        ci = f"[{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}]" if c.get("ci95") else "–"
        lines.append(f"| {c['kind']} | {c['metric']} | {c['condition']} | {c['reward']} | {c['policy']} | {c['k']} | "
                     f"{c['method']} | {c['mean']:+.4f} | {ci} | {stats.fmt_p(c.get('p_t_holm'))} | "
                     f"{stats.fmt_p(c['tost'])} | {c['verdict']} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """One panel per (condition, reward, policy): each method's primary metric (mean ± SE) by K."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells_ = result["cells"]
    panels = sorted({(c["condition"], c["reward"], c["policy"]) for c in cells_})
    cols = 4
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    for ax, (condition, reward, policy) in zip(axes.flat, panels):
        mine = [c for c in cells_ if (c["condition"], c["reward"], c["policy"]) == (condition, reward, policy)
                or (c["method"] == "oracle" and (c["condition"], c["policy"]) == (condition, policy))]
        for method in sorted({c["method"] for c in mine}):
            pts = sorted((c["k"], c["primary"], c["primary_se"] or 0) for c in mine if c["method"] == method)
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=2,
                        label=method, linestyle="--" if method == "oracle" else "-")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{condition}, {reward}, {policy}", fontsize=9)
        ax.set_xlabel("K")
        ax.set_ylabel("share of log-room gained")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["run", "report", "time", "cells", "archive"])
    p.add_argument("--study", required=True, type=Path)
    p.add_argument("--shard", default="1/1")
    p.add_argument("--out", type=Path, help="`report`: where to write (default: the study's output_dir)")
    p.add_argument("--runs", type=Path, help="`report`: read the runs here instead of the study's output_dir")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("SRPO_THREADS", "1")))
    decl = load_declaration(args.study)
    out = Path(decl["output_dir"])
    if args.command == "cells":
        for cell in cells(decl):
            print(cell.label())
        print(f"{len(cells(decl))} cells; {len(decl['lr_grid']) * len(decl['tuning_seeds'])} tuning and "
              f"{len(decl['seeds'])} main runs each")
        return 0
    if args.command == "time":  # the tuning batch of the costliest cell, to size the study (results not kept)
        cell = max(cells(decl), key=lambda c: (cost(c, decl), c.policy == "per_member", c.method == "dr_mas"))
        t = time.time()
        run_batch({**decl, "updates": 5}, cell, [(float(lr), s) for lr in decl["lr_grid"] for s in decl["tuning_seeds"]])
        print(f"{cell.label()}: 5 updates of its tuning batch in {time.time() - t:.1f} s")
        return 0
    if args.command == "run":
        i, n = (int(x) for x in args.shard.split("/"))
        run_study(decl, out, (i, n))
        return 0
    if args.command == "archive":  # every run's own metrics, without its curves: what `report` reads
        dest = args.out or out
        dest.mkdir(parents=True, exist_ok=True)
        kept = [{k: v for k, v in r.items() if not isinstance(v, list)} for r in read_all(args.runs or out)]
        with gzip.open(dest / "runs.jsonl.gz", "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        print(f"{len(kept)} runs → {dest / 'runs.jsonl.gz'}")
        return 0
    result = report(decl, args.runs or out)
    dest = args.out or out
    dest.mkdir(parents=True, exist_ok=True)
    write_report(result, dest, markdown, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
