"""Study (l): a controlled test of SRPO's own claim — the coordination game.

    python scripts/coordination_game.py run   --study configs/studies/controlled/coordination_game.yaml --shard 1/2
    python scripts/coordination_game.py run   --study configs/studies/controlled/coordination_game.yaml --shard 2/2
    python scripts/coordination_game.py report --study configs/studies/controlled/coordination_game.yaml

SRPO's claim is about credit: when K outputs jointly cause one transition, the update unit should
be their set.  This game is the smallest place where that can be measured with the truth known:

* C contexts; in each, K members each emit a short sequence (``length`` tokens from a ``vocab``-
  symbol alphabet).  Every (context, member) has one target sequence.
* **joint** reward: 1 only if every member hits its target.  Members sample independently, so the
  joint action's probability is the product of the members' and the set ratio Π_j ρ_j is exactly
  the joint action's ratio.
* **decomposable** control: the mean of the members' own hits (the same set, a reward that credits
  each member for its own part).
* Policies are tiny: ``shared`` — one network conditioned on (context, member, position, previous
  token); ``per_member`` — K networks of the same shape, one per member.  Both add a trainable
  term to a fixed prior whose target-token probabilities are calibrated so that the joint success
  starts at ``start_success`` whatever K (each member hits with probability start_success^(1/K)).
* Everything a method touches goes through srpo itself: episodes become :class:`srpo.events.Event`s
  of K :class:`~srpo.events.Member`s, advantages come from :func:`srpo.methods.assign_advantages`
  (one shared group advantage per event: all episodes of one context form a group; Dr. MAS splits
  the set and groups per role), mini-batches from :func:`srpo.events.split_minibatches`, tensors
  from :func:`srpo.events.collate`, and the loss from :func:`srpo.objective.policy_loss`.  Only the
  method (its loss, set reduction and grouping) differs between cells of one (K, reward, policy).

Metrics are exact, computed from the policies (no evaluation noise): the expected success after
every update (the joint success under the joint reward, the mean member success under the
decomposable one — i.e. the expected reward); the primary metric is its mean over the first
``updates`` updates.  Mechanism: the joint (set-level) KL(π_old ‖ π_new) of each update, summed over
the members' sequence distributions and averaged over contexts, and the loss's clip fraction.

``run`` tunes the learning rate per (method, K, reward, policy) on the tuning seeds, then runs the
fresh paired seeds at the tuned rate; every finished run is one line of ``runs.jsonl`` in the
study's output folder (a rerun skips what is there, so the study resumes).  ``report`` writes
``results.json`` and a markdown summary (paired differences, exact sign-flip, Holm across the
study's comparisons, TOST at the declared margin for the K = 1 ties).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srpo import stats  # noqa: E402
from srpo.events import Event, Member, collate, split_minibatches  # noqa: E402
from srpo.methods import METHODS, assign_advantages  # noqa: E402
from srpo.objective import LossInputs, LossSettings, policy_loss# noqa: E402

#: method label → (registered srpo method, set_reduction).  GRPO/GSPO/Dr. MAS report set statistics
#: with the reduction as a diagnostic only.
METHOD_SPECS = {
    "grpo": ("grpo", "sqrt"),
    "gspo": ("gspo", "sqrt"),
    "dr_mas": ("dr_mas", "sqrt"),
    "srpo_sum": ("srpo", "sum"),
    "srpo_sqrt": ("srpo", "sqrt"),
    "srpo_mean": ("srpo", "mean"),
}
REWARDS = ("joint", "decomposable")
POLICIES = ("shared", "per_member")


@dataclass(frozen=True)
class GameSpec:
    """The fixed settings of every run of the study (from the study file's ``game`` section)."""

    contexts: int = 16
    vocab: int = 4
    length: int = 3
    start_success: float = 0.25
    group_size: int = 8
    updates: int = 20
    epochs: int = 2
    minibatches: int = 2
    clip_eps: float = 0.2
    hidden: int = 16
    init_scale: float = 0.05


class Game:
    """Targets and the fixed prior of one seed.

    targets (C, K, L) long: each member's target sequence per context.
    prior   (C, K, L, V + 1, V) float: fixed logits given (context, member, position, previous
            token; index V is the start), with the target token's probability p = start^(1/(K L))
            after the previous target token and small random logits elsewhere.
    """

    def __init__(self, spec: GameSpec, k: int, seed: int):
        g = torch.Generator().manual_seed(10_000 + seed)
        C, V, L = spec.contexts, spec.vocab, spec.length
        self.spec, self.k = spec, k
        self.targets = torch.randint(0, V, (C, k, L), generator=g)
        noise = 0.3 * torch.randn(C, k, L, V + 1, V, generator=g)
        # The target token's logit so that its probability is p with the other V - 1 near-uniform:
        # p = e^b / (e^b + V - 1)  ->  b = log(p (V - 1) / (1 - p)).
        p = spec.start_success ** (1.0 / (k * L))
        bias = math.log(p * (V - 1) / (1 - p))
        prior = noise.clone()
        prev_target = torch.cat([torch.full((C, k, 1), V), self.targets[:, :, :-1]], dim=2)  # (C, K, L)
        idx = prev_target.unsqueeze(-1).unsqueeze(-1).expand(C, k, L, 1, V)
        row = prior.gather(3, idx)  # (C, K, L, 1, V) the rows on the target path
        row = row - row.mean(-1, keepdim=True)  # centre the noise so the calibration holds on average
        row = row.scatter_add(4, self.targets.view(C, k, L, 1, 1), torch.full((C, k, L, 1, 1), bias))
        self.prior = prior.scatter(3, idx, row)


class Policy(torch.nn.Module):
    """The trainable term of the logits over the whole (C, K, L, V + 1) input table.

    ``shared``: one two-layer network of embeddings of context, member, position and previous
    token.  ``per_member``: K such networks (no member embedding), batched on a leading K axis.
    """

    def __init__(self, spec: GameSpec, k: int, kind: str, generator: torch.Generator):
        super().__init__()
        if kind not in POLICIES:
            raise ValueError(f"policy {kind!r}: valid: {', '.join(POLICIES)}")
        C, V, L, H = spec.contexts, spec.vocab, spec.length, spec.hidden
        n = k if kind == "per_member" else 1
        s = spec.init_scale

        def param(*shape):
            return torch.nn.Parameter(s * torch.randn(n, *shape, generator=generator))

        self.kind, self.k, self.spec = kind, k, spec
        self.ctx, self.pos, self.prev = param(C, H), param(L, H), param(V + 1, H)
        self.member = param(k, H) if kind == "shared" else None
        self.out = param(H, V)
        self.bias = torch.nn.Parameter(torch.zeros(n, V))

    def table(self, prior: torch.Tensor) -> torch.Tensor:
        """(C, K, L, V + 1, V) log-probabilities of the next token for every input."""
        # h[n, c, l, v] for each network n; the shared one adds the member embedding.
        h = self.ctx[:, :, None, None, :] + self.pos[:, None, :, None, :] + self.prev[:, None, None, :, :]
        if self.kind == "shared":
            h = h[:, :, None] + self.member[0][None, None, :, None, None, :]  # (1, C, K, L, V+1, H)
            h = h[0]
        else:
            h = h.permute(1, 0, 2, 3, 4)  # (C, K, L, V+1, H), network k for member k
        if self.kind == "shared":
            logits = torch.tanh(h) @ self.out[0] + self.bias[0]
        else:
            logits = torch.einsum("ckluh,khv->ckluv", torch.tanh(h), self.out) + self.bias[None, :, None, None, :]
        return torch.log_softmax(prior + logits, dim=-1)


def sequence_logprobs(table: torch.Tensor, context: torch.Tensor, member: torch.Tensor,
                      tokens: torch.Tensor, start: int) -> torch.Tensor:
    """(M, L) log-prob of each token of each row's sequence.

    table (C, K, L, V + 1, V); context, member (M,) long; tokens (M, L) long.
    """
    M, L = tokens.shape
    prev = torch.cat([torch.full((M, 1), start, dtype=torch.long), tokens[:, :-1]], dim=1)  # (M, L)
    pos = torch.arange(L).expand(M, L)
    rows = table[context[:, None].expand(M, L), member[:, None].expand(M, L), pos, prev]  # (M, L, V)
    return rows.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def hit_probabilities(table: torch.Tensor, targets: torch.Tensor, start: int) -> torch.Tensor:
    """(C, K) probability that each member emits its target sequence in each context."""
    C, K, L = targets.shape
    ctx = torch.arange(C).repeat_interleave(K)
    mem = torch.arange(K).repeat(C)
    return sequence_logprobs(table, ctx, mem, targets.reshape(C * K, L), start).sum(1).exp().view(C, K)


def expected_success(hit: torch.Tensor, reward: str) -> float:
    """The expected reward over uniformly drawn contexts: joint = Π_j hit, decomposable = mean_j hit."""
    return float((hit.prod(1) if reward == "joint" else hit.mean(1)).mean())


def member_sequence_kl(old: torch.Tensor, new: torch.Tensor, start: int) -> torch.Tensor:
    """(C, K) KL(π_old ‖ π_new) of each member's whole sequence in each context.

    Σ_l E_{prev ~ π_old}[KL of the next-token distributions], the previous token's distribution
    propagated through π_old (the policy is Markov in the previous token).
    old, new: (C, K, L, V + 1, V) log-probabilities.
    """
    C, K, L, V1, V = old.shape
    step_kl = (old.exp() * (old - new)).sum(-1)  # (C, K, L, V + 1)
    state = torch.zeros(C, K, V1)
    state[..., start] = 1.0
    total = torch.zeros(C, K)
    for pos in range(L):
        total += (state * step_kl[:, :, pos]).sum(-1)
        nxt = torch.einsum("cku,ckuv->ckv", state, old[:, :, pos].exp())
        state = torch.cat([nxt, torch.zeros(C, K, 1)], dim=-1)
    return total


def joint_kl(old: torch.Tensor, new: torch.Tensor, start: int) -> float:
    """KL(π_old ‖ π_new) of the joint action (all K members' sequences), averaged over contexts:
    members are independent, so it is the sum of the members' sequence KLs."""
    return float(member_sequence_kl(old, new, start).sum(1).mean())


def run_one(spec: GameSpec, *, method: str, k: int, reward: str, policy: str, lr: float, seed: int) -> dict:
    """Train one cell at one seed; return its metrics (the curve of expected success included).

    The seed fixes the game (targets and prior), the policy's initial weights and the sampling
    stream, so every method of one (K, reward, policy) meets the same game, start and first rollout.
    """
    if reward not in REWARDS:
        raise ValueError(f"reward {reward!r}: valid: {', '.join(REWARDS)}")
    srpo_method, set_reduction = METHOD_SPECS[method]
    loss_name = METHODS[srpo_method].loss
    game = Game(spec, k, seed)
    torch.manual_seed(seed)
    net = Policy(spec, k, policy, torch.Generator().manual_seed(20_000 + seed))
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    sampler = torch.Generator().manual_seed(30_000 + seed)
    shuffler = torch.Generator().manual_seed(40_000 + seed)
    C, V, L, G = spec.contexts, spec.vocab, spec.length, spec.group_size
    start = V

    with torch.no_grad():
        table = net.table(game.prior)
    curve = [expected_success(hit_probabilities(table, game.targets, start), reward)]
    kls, clip_fracs = [], []
    for update in range(spec.updates):
        # -- rollout: every context G times, each episode one joint event of K members -------------
        ctx = torch.arange(C).repeat_interleave(G * k)  # (C G K,) rows ordered context, episode, member
        mem = torch.arange(k).repeat(C * G)
        tokens = torch.empty(C * G * k, L, dtype=torch.long)
        prev = torch.full((C * G * k,), start, dtype=torch.long)
        for pos in range(L):
            probs = table[ctx, mem, pos, prev].exp()
            prev = torch.multinomial(probs, 1, generator=sampler).squeeze(1)
            tokens[:, pos] = prev
        logp = sequence_logprobs(table, ctx, mem, tokens, start)  # (M, L) behaviour = old
        hits = (tokens == game.targets[ctx, mem]).all(1).view(C, G, k).float()
        team = hits.all(2).float() if reward == "joint" else hits.mean(2)  # (C, G)
        events = []
        tok_rows, lp_rows = tokens.tolist(), logp.tolist()
        for c, g in itertools.product(range(C), range(G)):
            base = (c * G + g) * k
            members = [Member(role=f"member_{j}", policy_id="shared" if policy == "shared" else f"member_{j}",
                              policy_version=update, prompt_ids=[c, j], completion_ids=tok_rows[base + j],
                              action_mask=[1] * L, behaviour_logprobs=lp_rows[base + j], member_index=j)
                       for j in range(k)]
            events.append(Event(f"u{update}c{c}g{g}", f"u{update}c{c}g{g}", f"c{c}", f"c{c}", "joint", 0, k,
                                members, reward=float(team[c, g])))
        events = assign_advantages(events, srpo_method)

        # -- update: epochs x mini-batches of the method's loss, one Adam step each ----------------
        old_table = table
        fracs = []
        for _ in range(spec.epochs):
            order = torch.randperm(len(events), generator=shuffler).tolist()
            parts, _ = split_minibatches([events[i] for i in order], spec.minibatches, loss_name)
            for part in parts:
                batch = collate(part, pad_token_id=0)
                c_ids, m_ids = batch.input_ids[:, 0], batch.input_ids[:, 1]
                current = sequence_logprobs(net.table(game.prior), c_ids, m_ids, batch.completion_ids, start)
                loss, metrics = policy_loss(loss_name, LossInputs(
                    logprobs=current, old_logprobs=batch.old_logprobs, mask=batch.action_mask,
                    event_index=batch.event_index, advantages=batch.advantages,
                    member_set_sizes=batch.member_set_sizes),
                    LossSettings(clip_eps=spec.clip_eps, set_reduction=set_reduction))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                fracs.append(float(metrics["clip_frac"]))
        with torch.no_grad():
            table = net.table(game.prior)
        kls.append(joint_kl(old_table, table, start))
        clip_fracs.append(sum(fracs) / len(fracs))
        curve.append(expected_success(hit_probabilities(table, game.targets, start), reward))

    return {"method": method, "k": k, "reward": reward, "policy": policy, "lr": lr, "seed": seed,
            "primary": sum(curve[1:]) / spec.updates, "final": curve[-1], "start": curve[0], "curve": curve,
            "joint_kl": kls, "joint_kl_mean": sum(kls) / len(kls), "clip_frac": clip_fracs,
            "clip_frac_mean": sum(clip_fracs) / len(clip_fracs)}


# -- the study: declaration, tuning, fresh seeds, report ------------------------------------------------

def load_declaration(path: Path) -> dict:
    d = yaml.safe_load(path.read_text())
    for key in ("output_dir", "game", "methods", "k", "rewards", "policies", "lr_grid", "tuning_seeds", "seeds"):
        if key not in d:
            raise SystemExit(f"{path}: the study file needs {key!r}")
    unknown = [m for m in d["methods"] if m not in METHOD_SPECS]
    if unknown:
        raise SystemExit(f"{path}: unknown method {unknown[0]!r}; valid: {', '.join(METHOD_SPECS)}")
    return d


def cells(decl: dict) -> list[tuple[str, int, str, str]]:
    return list(itertools.product(decl["methods"], decl["k"], decl["rewards"], decl["policies"]))


def read_runs(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill mid-write: the run is done again
            continue
    return out


def run_key(r: dict) -> tuple:
    return (r["phase"], r["method"], r["k"], r["reward"], r["policy"], float(r["lr"]), r["seed"])


def tuned_lr(decl: dict, runs: list[dict], cell: tuple) -> float | None:
    """The learning rate with the best mean primary metric over the tuning seeds (None: not all run)."""
    method, k, reward, policy = cell
    best = None
    for lr in decl["lr_grid"]:
        vals = [r["primary"] for r in runs if r["phase"] == "tune" and (r["method"], r["k"], r["reward"], r["policy"])
                == cell and float(r["lr"]) == float(lr)]
        if len(vals) < len(decl["tuning_seeds"]):
            return None
        score = sum(vals) / len(vals)
        if best is None or score > best[0]:
            best = (score, float(lr))
    return best[1]


def run_study(decl: dict, out: Path, shard: tuple[int, int]) -> None:
    spec = GameSpec(**decl["game"])
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"runs.{shard[0]}of{shard[1]}.jsonl"
    done = {run_key(r) for r in read_all(out)}
    mine = [c for i, c in enumerate(cells(decl)) if i % shard[1] == shard[0] - 1]
    t0 = time.time()
    with log.open("a") as f:
        for phase in ("tune", "main"):
            todo = []
            for cell in mine:
                if phase == "tune":
                    todo += [(cell, float(lr), s) for lr in decl["lr_grid"] for s in decl["tuning_seeds"]]
                else:
                    lr = tuned_lr(decl, read_all(out), cell)
                    todo += [(cell, lr, s) for s in decl["seeds"]]
            todo = [t for t in todo if (phase, *t[0], t[1], t[2]) not in done]
            for i, (cell, lr, seed) in enumerate(todo):
                method, k, reward, policy = cell
                r = run_one(spec, method=method, k=k, reward=reward, policy=policy, lr=lr, seed=seed)
                f.write(json.dumps({"phase": phase, **r}) + "\n")
                f.flush()
                if i % 50 == 0:
                    print(f"[{phase}] {i + 1}/{len(todo)} {method} K={k} {reward} {policy} lr={lr} seed={seed} "
                          f"primary={r['primary']:.3f} ({time.time() - t0:.0f} s)", flush=True)


def read_all(out: Path) -> list[dict]:
    """Every finished run in ``out``: the shards' ``runs.*.jsonl`` (or the archived ``runs.jsonl.gz``)."""
    files = sorted(out.glob("runs.*.jsonl")) + sorted(out.glob("runs*.jsonl.gz"))
    return [r for p in files for r in read_runs(p)]


def archive(out: Path, dest: Path) -> Path:
    """All runs in one gzip file (curves rounded to 4 decimals): what docs/study_data keeps."""
    def rounded(r):
        return {k: ([round(x, 4) for x in v] if isinstance(v, list) else round(v, 5) if isinstance(v, float) else v)
                for k, v in r.items()}

    lines = "".join(json.dumps(rounded(r)) + "\n" for r in read_all(out))
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / "runs.jsonl.gz"
    path.write_bytes(gzip.compress(lines.encode(), mtime=0))
    return path


def report(decl: dict, out: Path) -> dict:
    """Paired comparisons of the main runs; Holm across all of them; TOST at K = 1."""
    runs = [r for r in read_all(out) if r["phase"] == "main"]
    by_cell: dict[tuple, dict[int, dict]] = {}
    for r in runs:
        by_cell.setdefault((r["method"], r["k"], r["reward"], r["policy"]), {})[r["seed"]] = r
    ref = decl.get("reference", "srpo_sqrt")
    margin = float(decl.get("equivalence_margin", 0.02))
    comparisons, summaries = [], []
    for (method, k, reward, policy), seeds in sorted(by_cell.items()):
        vals = [seeds[s]["primary"] for s in sorted(seeds)]
        mean, se = stats.mean_se(vals)
        summaries.append({"method": method, "k": k, "reward": reward, "policy": policy, "n": len(vals),
                          "lr": seeds[min(seeds)]["lr"], "primary": mean, "se": se,
                          "joint_kl": sum(r["joint_kl_mean"] for r in seeds.values()) / len(seeds),
                          "clip_frac": sum(r["clip_frac_mean"] for r in seeds.values()) / len(seeds),
                          "start": seeds[min(seeds)]["start"]})
        if method == ref or (ref, k, reward, policy) not in by_cell:
            continue
        base = by_cell[(ref, k, reward, policy)]
        common = sorted(set(seeds) & set(base))
        diffs = [base[s]["primary"] - seeds[s]["primary"] for s in common]  # reference minus method
        c = {"reference": ref, "method": method, "k": k, "reward": reward, "policy": policy, **stats.paired(diffs)}
        c["tost"] = stats.tost(diffs, margin)
        comparisons.append(c)
    # The claim's contrast: the reference's edge under the joint reward minus its edge under the
    # decomposable one, paired by seed (same game and start under both rewards).
    for method in decl["methods"]:
        for k, policy in itertools.product(decl["k"], decl["policies"]):
            keys = [(m, k, rw, policy) for m in (ref, method) for rw in REWARDS]
            if method == ref or not all(key in by_cell for key in keys):
                continue
            common = sorted(set.intersection(*(set(by_cell[key]) for key in keys)))

            def edge(rw, s):
                return by_cell[(ref, k, rw, policy)][s]["primary"] - by_cell[(method, k, rw, policy)][s]["primary"]

            diffs = [edge("joint", s) - edge("decomposable", s) for s in common]
            comparisons.append({"reference": ref, "method": method, "k": k, "reward": "joint - decomposable",
                                "policy": policy, **stats.paired(diffs), "tost": stats.tost(diffs, margin)})
    stats.adjust(comparisons)
    result = {"declaration": decl, "cells": summaries, "comparisons": comparisons, "runs": len(runs)}
    return result


def claim_table(result: dict, against: tuple[str, ...] = ("grpo", "gspo")) -> list[str]:
    """The claim in one table: per (policy, K), the reference's edge over each baseline under the
    joint and the decomposable reward, and the contrast between them (Holm p)."""
    ref = result["declaration"].get("reference", "srpo_sqrt")
    comp = {(c["method"], c["k"], c["reward"], c["policy"]): c for c in result["comparisons"]}

    def cell(c):
        if c is None:
            return "–"
        ci = f" [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}]" if c.get("ci95") else ""
        mark = "*" if c.get("significant") else ""
        return f"{c['mean']:+.3f}{ci}{mark}"

    head = " | ".join(f"{ref} − {m}: joint | decomposable | joint − decomposable" for m in against)
    lines = [f"| policy | K | {head} |", "|---|---:|" + "---|---|---|" * len(against)]
    decl = result["declaration"]
    for policy, k in itertools.product(decl["policies"], decl["k"]):
        row = []
        for m in against:
            row += [cell(comp.get((m, k, r, policy))) for r in ("joint", "decomposable", "joint - decomposable")]
        lines.append(f"| {policy} | {k} | " + " | ".join(row) + " |")
    return lines + ["", "(* significant after Holm across all the study's comparisons)"]


def markdown(result: dict) -> str:
    decl = result["declaration"]
    ref = decl.get("reference", "srpo_sqrt")
    lines = claim_table(result) + [""] + [f"Primary metric: mean expected success over the first {decl['game']['updates']} updates "
             f"(exact, from the policies); {len(decl['seeds'])} fresh paired seeds per cell, learning rate "
             f"tuned per cell on {len(decl['tuning_seeds'])} other seeds.", "",
             "| policy | reward | K | " + " | ".join(decl["methods"]) + " |",
             "|---|---|---:|" + "---:|" * len(decl["methods"])]
    cell = {(c["method"], c["k"], c["reward"], c["policy"]): c for c in result["cells"]}
    for policy, reward, k in itertools.product(decl["policies"], REWARDS, decl["k"]):
        row = [f"{cell[(m, k, reward, policy)]['primary']:.3f}" if (m, k, reward, policy) in cell else "–"
               for m in decl["methods"]]
        lines.append(f"| {policy} | {reward} | {k} | " + " | ".join(row) + " |")
    lines += ["", f"Paired differences {ref} − method (positive: {ref} ahead), Holm across all "
              f"{len(result['comparisons'])} comparisons; TOST at ±{decl.get('equivalence_margin', 0.02)}:", "",
              "| policy | reward | K | method | diff | 95% CI | p (t) | p (Holm) | p (sign-flip) | TOST p | verdict |",
              "|---|---|---:|---|---:|---|---:|---:|---:|---:|---|"]
    for c in result["comparisons"]:
        ci = f"[{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}]" if c.get("ci95") else "–"
        lines.append(f"| {c['policy']} | {c['reward']} | {c['k']} | {c['method']} | {c['mean']:+.4f} | {ci} | "
                     f"{stats.fmt_p(c['p_t'])} | {stats.fmt_p(c.get('p_t_holm'))} | {stats.fmt_p(c['p_sign_flip'])} | "
                     f"{stats.fmt_p(c['tost'])} | {c['verdict']} |")
    lines += ["", "Mechanism (means over seeds and updates): joint KL(π_old ‖ π_new) per update | clip fraction", "",
              "| policy | reward | K | " + " | ".join(decl["methods"]) + " |",
              "|---|---|---:|" + "---:|" * len(decl["methods"])]
    for policy, reward, k in itertools.product(decl["policies"], REWARDS, decl["k"]):
        row = [f"{cell[(m, k, reward, policy)]['joint_kl']:.4f} / {cell[(m, k, reward, policy)]['clip_frac']:.3f}"
               if (m, k, reward, policy) in cell else "–" for m in decl["methods"]]
        lines.append(f"| {policy} | {reward} | {k} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """One panel per (policy, reward): each method's primary metric (mean ± SE over seeds) by K."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decl = result["declaration"]
    cell = {(c["method"], c["k"], c["reward"], c["policy"]): c for c in result["cells"]}
    fig, axes = plt.subplots(len(decl["policies"]), len(REWARDS), figsize=(11, 4 * len(decl["policies"])),
                             squeeze=False)
    for row, policy in enumerate(decl["policies"]):
        for col, reward in enumerate(REWARDS):
            ax = axes[row][col]
            for method in decl["methods"]:
                ks = [k for k in decl["k"] if (method, k, reward, policy) in cell]
                ys = [cell[(method, k, reward, policy)]["primary"] for k in ks]
                es = [cell[(method, k, reward, policy)]["se"] or 0 for k in ks]
                ax.errorbar(ks, ys, yerr=es, marker="o", capsize=3, label=method)
            ax.set_xscale("log", base=2)
            ax.set_xticks(decl["k"], [str(k) for k in decl["k"]])
            ax.set_title(f"{policy} policy, {reward} reward")
            ax.set_xlabel("K (members of the joint action)")
            ax.set_ylabel(f"mean expected success, updates 1–{decl['game']['updates']}")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Coordination game (study l): mean ± SE over paired seeds, learning rate tuned per cell")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["run", "report", "time"])
    p.add_argument("--study", required=True, type=Path)
    p.add_argument("--shard", default="1/1")
    p.add_argument("--out", type=Path, help="results folder for `report` (default: the study's output_dir)")
    p.add_argument("--runs", type=Path, help="`report`: read the runs here (e.g. docs/study_data/coordination_game, "
                                             "which holds them archived) instead of the study's output_dir")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("SRPO_THREADS", "1")))
    decl = load_declaration(args.study)
    out = Path(decl["output_dir"])
    if args.command == "time":  # one run of the largest cell, to size the study
        t = time.time()
        run_one(GameSpec(**decl["game"]), method="grpo", k=max(decl["k"]), reward="joint", policy="per_member",
                lr=float(decl["lr_grid"][0]), seed=0)
        print(f"one run at K={max(decl['k'])}: {time.time() - t:.2f} s")
        return 0
    if args.command == "run":
        i, n = (int(x) for x in args.shard.split("/"))
        run_study(decl, out, (i, n))
        return 0
    source = args.runs or out
    result = report(decl, source)
    dest = args.out or out
    dest.mkdir(parents=True, exist_ok=True)
    if args.runs is None and dest != out:  # the runs travel with the report
        archive(out, dest)
    write_report(result, dest, markdown, plot)
    return 0


def write_report(result: dict, dest: Path, markdown, plot) -> None:
    """``results.json``, ``results.md`` (printed too) and ``results.png`` of a study in ``dest``."""
    (dest / "results.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (dest / "results.md").write_text(text)
    plot(result, dest / "results.png")
    print(text)


if __name__ == "__main__":
    raise SystemExit(main())
