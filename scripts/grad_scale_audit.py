"""Per arm of a study: the gradient norm before clipping and how often ``train.max_grad_norm`` clipped it.

Reads a study folder or an archived ``cells.tar.gz`` (``docs/study_data/<study>/``); for every
cell (label/seedN/metrics.jsonl) takes each step's per-policy norms, and reports per label: the
median over seeds of the run's median ``grad_norm/total``, the share of steps in which some
policy's norm exceeded the clip (runs that logged ``grad_clip/any`` use it; older runs are judged
from their norms against ``--max-grad-norm``), and the tokens per member.  Steps whose gradient
is zero (every reward in every group equal) count as unclipped steps.

    python scripts/grad_scale_audit.py docs/study_data/parts_team/cells.tar.gz --max-grad-norm 1.0
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tarfile
from pathlib import Path


def _cells_from_tar(path: Path) -> dict[str, list[list[dict]]]:
    out: dict[str, list[list[dict]]] = {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            if not member.isfile() or not member.name.endswith("/metrics.jsonl"):
                continue
            label = member.name.split("/")[0]
            text = tar.extractfile(member).read().decode()
            out.setdefault(label, []).append([json.loads(line) for line in io.StringIO(text) if line.strip()])
    return out


def _cells_from_folder(root: Path) -> dict[str, list[list[dict]]]:
    out: dict[str, list[list[dict]]] = {}
    for metrics in sorted(root.glob("*/seed*/metrics.jsonl")):
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        out.setdefault(metrics.parent.parent.name, []).append(rows)
    return out


def clipped_share(rows: list[dict], max_grad_norm: float) -> float:
    """The share of a run's steps in which the norm clip acted on some policy."""
    logged = [r["grad_clip/any"] for r in rows if isinstance(r.get("grad_clip/any"), (int, float))]
    if logged:
        return sum(logged) / len(logged)
    steps = [[v for k, v in r.items() if k.startswith("grad_norm/") and k != "grad_norm/total"] for r in rows]
    steps = [s for s in steps if s]
    return sum(max_grad_norm > 0 and any(v > max_grad_norm for v in s) for s in steps) / max(len(steps), 1)


def audit(cells: dict[str, list[list[dict]]], max_grad_norm: float) -> list[dict]:
    out = []
    for label, runs in sorted(cells.items()):
        norms = [statistics.median(r["grad_norm/total"] for r in rows if "grad_norm/total" in r) for rows in runs]
        shares = [clipped_share(rows, max_grad_norm) for rows in runs]
        tokens = [statistics.mean(r["objective/num_tokens"] / r["objective/num_members"] for r in rows
                                  if r.get("objective/num_members")) for rows in runs]
        out.append({"arm": label, "runs": len(runs), "median_grad_norm": statistics.median(norms),
                    "clip_share_mean": statistics.mean(shares), "clip_share_min": min(shares),
                    "clip_share_max": max(shares), "tokens_per_member": statistics.mean(tokens)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path, help="a study folder or an archived cells.tar.gz")
    ap.add_argument("--max-grad-norm", type=float, default=1.0,
                    help="the clip the runs trained with (read for runs that did not log grad_clip/any)")
    args = ap.parse_args()
    cells = _cells_from_tar(args.source) if args.source.is_file() else _cells_from_folder(args.source)
    if not cells:
        raise SystemExit(f"{args.source}: no <label>/seedN/metrics.jsonl found")
    print("| arm | runs | median gradient norm (median over runs) | norm clip acted: mean share of steps [min, max] | "
          "tokens / member |")
    print("|---|---:|---:|---|---:|")
    for a in audit(cells, args.max_grad_norm):
        print(f"| {a['arm']} | {a['runs']} | {a['median_grad_norm']:.3g} | {a['clip_share_mean']:.2f} "
              f"[{a['clip_share_min']:.2f}, {a['clip_share_max']:.2f}] | {a['tokens_per_member']:.1f} |")


if __name__ == "__main__":
    main()
