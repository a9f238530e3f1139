"""Game II's supported lead with and without the ratio clip (studies/m_clip_ablation/).

    python scripts/coordination_game_ii.py run --study studies/m_clip_ablation/clip_on.yaml
    python scripts/coordination_game_ii.py run --study studies/m_clip_ablation/clip_off.yaml
    python scripts/game_clip_ablation.py runs/study-m-clip-ablation [--out studies/m_clip_ablation]

Per K (8, 16), paired by seed on the primary metric (the share of the log-room gained, averaged over
updates): srpo_sqrt − grpo with the clip, the same without it, and the interaction (the first minus
the second) — Holm over the six; beside them each cell's tuned rate, mean primary and mean clip
fraction (0 without the clip), and the commits the runs recorded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordination_game_ii import read_all  # noqa: E402
from srpo import stats  # noqa: E402

SETTINGS = ("clip_on", "clip_off")
KS = (8, 16)


def primaries(root: Path) -> tuple[dict, dict, set]:
    """(setting, K, method) → seed → primary; → {"lr", "clip_frac"}; the commits recorded."""
    values, info, commits = {}, {}, set()
    for setting in SETTINGS:
        for r in read_all(root / setting):
            if r["phase"] != "main":
                continue
            key = (setting, r["k"], r["method"])
            values.setdefault(key, {})[r["seed"]] = r["primary"]
            info.setdefault(key, {"lr": r["lr"], "clip": []})["clip"].append(r.get("clip_frac_mean", 0.0))
            commits.add(r.get("commit", "unknown"))
    return values, info, commits


def tests(values: dict) -> list[dict]:
    out = []
    for k in KS:
        edge = {}
        for setting in SETTINGS:
            sqrt, grpo = values.get((setting, k, "srpo_sqrt"), {}), values.get((setting, k, "grpo"), {})
            edge[setting] = {s: sqrt[s] - grpo[s] for s in sqrt.keys() & grpo.keys()}
        both = edge["clip_on"].keys() & edge["clip_off"].keys()
        named = ((f"K = {k}: sqrt − grpo, clip on", edge["clip_on"]), (f"K = {k}: sqrt − grpo, clip off", edge["clip_off"]),
                 (f"K = {k}: interaction (clip on − clip off)", {s: edge["clip_on"][s] - edge["clip_off"][s] for s in both}))
        for name, diffs in named:
            if len(diffs) < 2:
                out.append({"comparison": name, "n": len(diffs), "p_t": None, "p_sign_flip": None, "mean": None,
                            "ci95": (None, None)})
                continue
            out.append({"comparison": name, **stats.paired(list(diffs.values()))})
    stats.adjust(out)
    return out


def markdown(values: dict, info: dict, comps: list[dict], commits: set) -> str:
    lines = ["| setting | K | method | seeds | tuned rate | mean primary (SE) | mean clip fraction |", "|---|---:|---|---:|---:|---:|---:|"]
    for (setting, k, method), by_seed in sorted(values.items()):
        mean, se = stats.mean_se(list(by_seed.values()))
        clip = info[(setting, k, method)]["clip"]
        lines.append(f"| {setting} | {k} | {method} | {len(by_seed)} | {info[(setting, k, method)]['lr']} | "
                     f"{mean:.3f} ({se:.3f}) | {sum(clip) / len(clip):.3f} |")
    lines += ["", f"| comparison | n | mean | 95 % CI | p (t) | p (sign-flip) | p (Holm over {len(comps)}) | verdict |",
              "|---|---:|---:|---|---:|---:|---:|---|"]
    for c in comps:
        lo, hi = c["ci95"]
        mean = "–" if c["mean"] is None else f"{c['mean']:+.3f}"
        ci = "–" if lo is None else f"[{lo:+.3f}, {hi:+.3f}]"
        lines.append(f"| {c['comparison']} | {c['n']} | {mean} | {ci} | {stats.fmt_p(c['p_t'])} | "
                     f"{stats.fmt_p(c['p_sign_flip'])} | {stats.fmt_p(c.get('p_t_holm'))} | {c['verdict']} |")
    return "\n".join(lines) + f"\n\nRuns recorded at commit(s): {', '.join(sorted(commits))}.\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", type=Path, help="the folder holding clip_on/ and clip_off/")
    p.add_argument("--out", type=Path, help="write results.md and tests.json here")
    args = p.parse_args(argv)
    values, info, commits = primaries(args.root)
    if not values:
        raise SystemExit(f"{args.root}: no main runs under clip_on/ or clip_off/")
    comps = tests(values)
    text = markdown(values, info, comps, commits)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(text)
        (args.out / "tests.json").write_text(json.dumps(comps, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
