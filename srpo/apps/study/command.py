"""``srpo study``: the command line of a study (run, summarise, restate, shard)."""

from __future__ import annotations

import logging

from srpo.config import ConfigError
from srpo.apps.study.runner import restate_results, run_study, summarize_study

log = logging.getLogger(__name__)


def add_study_parser(sub) -> None:
    p = sub.add_parser("study", help="methods × workflows × tasks × seeds: train, evaluate, tabulate (resumable)")
    p.add_argument("--config", required=True, help="a study file (see configs/studies/)")
    p.add_argument("--only", type=int, default=None, help="run only the first N cells")
    p.add_argument("--shard", default="1/1", metavar="I/N",
                   help="run only cells I, I+N, ... (N processes share one study folder; e.g. two at one thread each)")
    p.add_argument("--restate", metavar="RESULTS_JSON", default=None,
                   help="recompute the comparisons of an existing results.json (its cells) with today's statistics, "
                        "rewrite it as strict JSON and print the tables (runs nothing)")
    p.add_argument("--summarize", action="store_true",
                   help="only rewrite results.md/json/png from the cells already finished (runs nothing)")
    p.add_argument("--list", action="store_true",
                   help="print the cells the study would run, each with its seeds and overrides, and which are "
                        "finished (runs nothing)")
    p.set_defaults(func=_study)


def list_cells(path: str) -> str:
    """The study's cells, one line per cell label: its seeds, how many are finished on disk, and the
    overrides it applies (after the study's own)."""
    from pathlib import Path

    from srpo.apps.study.runner import finished_cell
    from srpo.apps.study.schema import cells, load_study

    spec = load_study(path)
    root = Path(spec["output_dir"])
    by_label: dict[str, list[dict]] = {}
    for cell in cells(spec):
        by_label.setdefault(cell["label"], []).append(cell)
    lines = [f"{path}: {sum(len(v) for v in by_label.values())} cells, {len(by_label)} labels, output {root}"]
    for label, group in by_label.items():
        done = sum(1 for c in group if (root / c["label"] / f"seed{c['seed']}" / "cell.json").is_file()
                   and finished_cell(spec, c, root) is not None)
        own = {k: v for k, v in group[0]["overrides"].items()
               if k != "run.seed" and (spec.get("overrides") or {}).get(k) != v}
        lines.append(f"  {label}: seeds {', '.join(str(c['seed']) for c in group)} ({done} finished); {own}")
    return "\n".join(lines)


def _study(args) -> int:
    if args.list:
        print(list_cells(args.config))
        return 0
    if args.restate:
        print(restate_results(args.config, args.restate))
        return 0
    try:
        index, count = (int(x) for x in args.shard.split("/"))
        if not 1 <= index <= count:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--shard {args.shard!r}: expected I/N with 1 <= I <= N, e.g. 1/2") from None
    if not args.summarize:
        from srpo.runs import preemption
        from srpo.config import RunConfig

        preemption.install(RunConfig().preempt_grace_s)  # a cell's training saves at its next step end
    out = summarize_study(args.config) if args.summarize else run_study(args.config, only=args.only,
                                                                       shard=(index, count))
    print(f"results: {out}")
    return 0
