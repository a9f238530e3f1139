"""Study (o): the tuning rule and the declared analysis (studies/o_set_clip/study.yaml).

    python scripts/study_o.py tune runs/study-o-tuning/results.json            # print the rule's choice
    python scripts/study_o.py tune runs/study-o-tuning/results.json --write    # and write it into study.yaml
    python scripts/study_o.py analyse runs/study-o/results.json [--json comparisons.json]

``tune``: per ratio unit (``set``, ``token``), the learning rate whose median over the tuning seeds
of validation per-part accuracy is highest (ties: the smaller rate); ``--write`` replaces the two
``train.lr: TUNED`` entries of study.yaml (and only those) — run before any test cell, committed.

``analyse``: the manipulation checks first (ratio-clip fraction per cell, the norm clip's share,
which must be 0), then the declared family: the primary interaction [set-clip − set-noclip] −
[token-clip − token-noclip] and four paired edges, in per-part and all-parts accuracy, paired by
seed, Holm-adjusted over the ten; the primary is judged on its own p.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srpo import stats  # noqa: E402
from srpo.apps.study import tuning  # noqa: E402

STUDY = Path(__file__).resolve().parents[1] / "studies" / "o_set_clip" / "study.yaml"
VALIDATION, TEST = "parts-validation", "parts-test"
RATIOS, CLIPS = ("set", "token"), ("clip", "noclip")
PER_PART = "per_part"
#: The manipulation check's floor on a clip-on cell's ratio-clip fraction.
MIN_CLIP_FRAC = 0.05


def per_seed(cells: list[dict], label: str, dataset: str, metric: str) -> dict[int, float]:
    """seed → the cell's held-out ``metric`` on ``dataset`` (cells without it left out)."""
    return {c["seed"]: c["eval"]["datasets"][dataset][metric] for c in cells
            if c["label"] == label and metric in c["eval"]["datasets"].get(dataset, {})}


# -- tuning: srpo.apps.study.tuning, per ratio unit on the validation set --------------------------
def choose_rates(cells: list[dict]) -> dict[str, dict]:
    """ratio unit → the tuning rule's choice (:func:`srpo.apps.study.tuning.choose_rates`)."""
    return tuning.choose_rates(cells, RATIOS, VALIDATION, PER_PART)


# -- the declared analysis ------------------------------------------------------------------------
def manipulation_checks(cells: list[dict]) -> list[str]:
    """Markdown lines: per cell, the ratio-clip fraction (mean over seeds, per-run min) and the norm
    clip's share; each check's verdict."""
    lines = ["| cell | runs | ratio-clip fraction, mean [min run] | norm clip acted (share of steps, max run) | check |",
             "|---|---:|---|---:|---|"]
    for ratio in RATIOS:
        for clip in CLIPS:
            label = f"{ratio}-{clip}"
            ds = [c["diagnostics"] for c in cells if c["label"] == label and c.get("diagnostics")]
            if not ds:
                continue
            fracs = [d.get("clip_frac") or 0.0 for d in ds]
            norm = [d.get("grad_clip_share") for d in ds]
            norm_max = max((v for v in norm if v is not None), default=None)
            mean = sum(fracs) / len(fracs)
            ok_ratio = mean > MIN_CLIP_FRAC if clip == "clip" else max(fracs) == 0
            ok_norm = norm_max == 0
            verdict = "passes" if ok_ratio and ok_norm else "FAILS: " + ", ".join(
                w for w, bad in (("ratio clip", not ok_ratio), ("norm clip acted or not logged", not ok_norm)) if bad)
            lines.append(f"| {label} | {len(ds)} | {mean:.3f} [{min(fracs):.3f}] | "
                         f"{'–' if norm_max is None else f'{norm_max:.2f}'} | {verdict} |")
    return lines


def _diff(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    return {s: a[s] - b[s] for s in sorted(a.keys() & b.keys())}


def comparisons(cells: list[dict], k: int = 4) -> list[dict]:
    """The ten declared comparisons, Holm-adjusted together (the primary judged on its own p)."""
    out = []
    for metric in (PER_PART, f"avg@{k}"):
        v = {f"{r}-{c}": per_seed(cells, f"{r}-{c}", TEST, metric) for r in RATIOS for c in CLIPS}
        named = [
            ("interaction: [set-clip − set-noclip] − [token-clip − token-noclip]",
             _diff(_diff(v["set-clip"], v["set-noclip"]), _diff(v["token-clip"], v["token-noclip"]))),
            ("set-clip − token-clip", _diff(v["set-clip"], v["token-clip"])),
            ("set-noclip − token-noclip", _diff(v["set-noclip"], v["token-noclip"])),
            ("set-clip − set-noclip", _diff(v["set-clip"], v["set-noclip"])),
            ("token-clip − token-noclip", _diff(v["token-clip"], v["token-noclip"])),
        ]
        for i, (name, by_seed) in enumerate(named):
            primary = metric == PER_PART and i == 0
            if len(by_seed) < 2:
                out.append({"comparison": name, "metric": metric, "primary": primary, "n": len(by_seed),
                            "p_t": None, "p_sign_flip": None, "mean": None, "sd": None, "ci95": (None, None)})
                continue
            test = stats.paired(list(by_seed.values()))
            out.append({"comparison": name, "metric": metric, "primary": primary, "seeds": sorted(by_seed), **test,
                        "detectable_80": stats.detectable(test["sd"], test["n"])})
    stats.adjust(out)
    return out


def _fmt(x, sign=True):
    return "–" if x is None else (f"{x:+.3f}" if sign else f"{x:.3f}")


def analyse(cells: list[dict], k: int = 4) -> tuple[str, list[dict]]:
    lines = ["## Manipulation checks", ""] + manipulation_checks(cells) + ["", "## Cells", "",
             f"| cell | seeds | held-out per-part accuracy (SE) | all parts right, avg@{k} (SE) |", "|---|---:|---:|---:|"]
    for label in sorted({c["label"] for c in cells}, key=lambda lb: (not lb.startswith("untrained"), lb)):
        cols = []
        for metric in (PER_PART, f"avg@{k}"):
            vals = list(per_seed(cells, label, TEST, metric).values())
            m, se = stats.mean_se(vals)
            cols.append("–" if not vals else (f"{m:.3f} ({se:.3f})" if se == se else f"{m:.3f}"))
        lines.append(f"| {label} | {len(per_seed(cells, label, TEST, PER_PART))} | {cols[0]} | {cols[1]} |")
    comps = comparisons(cells, k)
    lines += ["", "## Declared comparisons", "",
              f"| comparison | metric | seeds | mean difference | 95 % t CI | p (t) | p (sign-flip) | p (t, Holm over {len(comps)}) "
              "| verdict | SD of the paired differences | 80 % power at |", "|---|---|---:|---:|---|---:|---:|---:|---|---:|---:|"]
    for c in comps:
        lo, hi = c["ci95"]
        ci = "–" if lo is None else f"[{lo:+.3f}, {hi:+.3f}]"
        lines.append(f"| {'**' + c['comparison'] + '** (primary)' if c['primary'] else c['comparison']} | {c['metric']} | "
                     f"{c['n']} | {_fmt(c['mean'])} | {ci} | {stats.fmt_p(c['p_t'])} | {stats.fmt_p(c['p_sign_flip'])} | "
                     f"{stats.fmt_p(c.get('p_t_holm'))} | {c['verdict']} | {_fmt(c['sd'], False)} | "
                     f"{_fmt(c.get('detectable_80'), False)} |")
    return "\n".join(lines), comps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tune", help="the tuning rule's choice of learning rate per ratio unit")
    t.add_argument("results", type=Path, help="the tuning study's results.json")
    t.add_argument("--write", action="store_true", help="write the chosen rates into study.yaml")
    a = sub.add_parser("analyse", help="the manipulation checks and the declared comparisons")
    a.add_argument("results", type=Path, help="the study's results.json")
    a.add_argument("-k", type=int, default=4)
    a.add_argument("--json", type=Path, help="also write the comparisons here")
    args = p.parse_args(argv)
    cells = json.loads(args.results.read_text())["cells"]
    if args.command == "tune":
        chosen = choose_rates(cells)
        print("\n".join(tuning.describe(chosen)))
        if args.write and any(c["extend"] for c in chosen.values()):
            raise SystemExit("not written: a winner is at the edge of its grid")
        if args.write:
            tuning.write_rates(STUDY, chosen)
            print(f"written into {STUDY}")
        return 0
    return print_analysis(cells, args.k, args.json)


def print_analysis(cells: list[dict], k: int, json_path: Path | None) -> int:
    """Print the checks and comparisons; the comparisons also to ``json_path`` when given."""
    text, comps = analyse(cells, k)
    print(text)
    if json_path is not None:
        json_path.write_text(json.dumps(comps, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
