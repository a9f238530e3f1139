"""``srpo report RUN_DIR``: PNG plots and a one-page summary of a training run."""

from __future__ import annotations

import html
import json
from pathlib import Path

from dataclasses import dataclass
from typing import Callable

from srpo.apps.stability import plot_stability, stability_section
from srpo.runs.fileio import refuse_link_destination, save_figure, write_text_atomic
from srpo.runs.metrics_log import read_metrics


def _series(rows, key):
    xs = [r["step"] for r in rows if isinstance(r.get(key), (int, float))]
    ys = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return xs, ys


def _smooth(ys, window=5):
    out = []
    for i in range(len(ys)):
        chunk = ys[max(0, i - window + 1):i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def _heldout_keys(keys) -> list[str]:
    """``eval/<set>/avg@k`` and ``pass@k`` curves (the macro average too when there are several sets)."""
    found = sorted(k for k in keys if k.startswith("eval/") and ("/avg@" in k or "/pass@" in k))
    sets = {k.split("/")[1] for k in found} - {"macro"}
    return [k for k in found if len(sets) > 1 or not k.startswith("eval/macro/")]


def _by_k(keys, metric: str) -> list[str]:
    """``by_k/<metric>/k{K}`` keys in order of K (runs before 2026-11-30 logged ``clip_frac/k{K}``)."""
    found = [k for k in keys if k.startswith(f"by_k/{metric}/k") or (metric == "clip_frac" and k.startswith("clip_frac/k"))]
    return sorted(found, key=lambda k: int(k.rsplit("/k", 1)[1]))


@dataclass(frozen=True)
class Panel:
    """One PNG of the run report: what it draws (``pick``: the run's metric keys → the series), what
    to read in it (``caption``), and how. ``drop_if_flat``: leave it out when every series holds one
    value over the run — a diagnostic that cannot move under the run's settings (the ratio clip with
    one optimizer step per rollout) says nothing; the reward and held-out curves are drawn flat or not."""

    file: str
    title: str
    caption: str
    pick: Callable[[set], list[str]]
    smooth: bool = False
    drop_if_flat: bool = True
    log_scale: bool = False


PANELS: tuple[Panel, ...] = (
    Panel("reward_accuracy.png", "Reward and accuracy (training episodes)",
          "Whether the team learns: the training reward and accuracy per step (5-step mean over the faint raw line).",
          lambda keys: ["reward", "accuracy"], smooth=True, drop_if_flat=False),
    Panel("heldout.png", "Held-out accuracy during training (eval.every)",
          "Whether what is learned transfers: accuracy on problems never trained on, at each evaluation.",
          _heldout_keys, drop_if_flat=False),
    Panel("clip_fraction_by_set_size.png", "Ratio-clip fraction by set size K",
          "How often the clip of the update unit (SRPO: the set) binds, per set size. It is 0 while π_θ = π_old "
          "(one optimizer step per rollout) and acts on the rollout's later optimizer steps. A fraction that "
          "grows with K says the ratio's scale grows with the set (c(K) is meant to stop that).",
          lambda keys: _by_k(keys, "clip_frac"), smooth=True),
    Panel("gradient_share_by_set_size.png", "Share of the loss gradient (w.r.t. log-probs) by set size K",
          "Which set sizes the update spends its gradient on; compare with the share of events of each K.",
          lambda keys: _by_k(keys, "grad_share"), smooth=True),
    Panel("log_ratio_spread_by_set_size.png", "Spread (std) of the clipped log-ratio by set size K",
          "How far the update units' log-ratios spread from 0 on the rollout's later optimizer steps, per K "
          "(0 throughout with one optimizer step per rollout).",
          lambda keys: _by_k(keys, "unit_log_ratio_std"), smooth=True),
    Panel("grad_norm.png", "Gradient norm before clipping, per policy",
          "The scale of each policy's update (mean over the rollout's optimizer steps; 0 where no event had an "
          "advantage). Above train.max_grad_norm the norm clip scales the step down (the report's stability "
          "table: the share of steps it acted).",
          lambda keys: sorted(k for k in keys if k.startswith("grad_norm/") and k != "grad_norm/total")),
    Panel("active_set_size.png", "Mean active-set size",
          "How many outputs each transition consumed; it moves in routed teams and is flat in fixed ones.",
          lambda keys: sorted(k for k in keys if k.startswith("active_set_size/") or k == "router_set_size/mean")),
    Panel("lengths_per_role.png", "Completion length per role (tokens)",
          "Whether a role's replies grow or collapse as it trains.",
          lambda keys: sorted(k for k in keys if k.startswith("role/") and k.endswith("/length"))),
    Panel("set_ratio.png", "Set ratio π_θ/π_old over the update (min / mean / max, log scale)",
          "How far the update moved the policy on the rollout's own sets; 1 throughout with one optimizer step "
          "per rollout. Sets outside [1 − ε, 1 + ε] are where the clip binds (their gradient is cut).",
          lambda keys: ["objective/set_ratio/min", "objective/set_ratio/mean", "objective/set_ratio/max"],
          log_scale=True),
)


def _is_flat(rows, series: list[str]) -> bool:
    """Whether every series holds one value over the run (to 1e-9 of its size)."""
    for key in series:
        _, ys = _series(rows, key)
        if ys and max(ys) - min(ys) > 1e-9 * max(1.0, max(abs(y) for y in ys)):
            return False
    return True


def make_plots(run_dir: Path) -> list[Path]:
    """The report's PNGs (:data:`PANELS`), written into ``run_dir/report``; see :func:`plan_plots`."""
    drawn, _ = plan_plots(run_dir)
    return [path for path, _ in drawn]


def plan_plots(run_dir: Path) -> tuple[list[tuple[Path, str]], list[str]]:
    """Draw every panel with data; returns ``([(png, caption)], [titles left out as flat])``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is this a run folder?)")
    out_dir = Path(run_dir) / "report"
    refuse_link_destination(out_dir)  # a planted report/ link would take every plot elsewhere
    out_dir.mkdir(exist_ok=True)
    keys = set().union(*rows)
    drawn, flat = [], []
    for panel in PANELS:
        series = [s for s in panel.pick(keys) if s in keys]
        if not series:
            continue
        if panel.drop_if_flat and _is_flat(rows, series):
            flat.append(panel.title)
            continue
        smooth = panel.smooth
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for key in series:
            xs, ys = _series(rows, key)
            if not xs:
                continue
            line, = ax.plot(xs, ys, alpha=0.35 if smooth and len(ys) > 5 else 1.0, marker="o" if len(ys) <= 12 else None,
                            markersize=3, label=key if not smooth or len(ys) <= 5 else None)
            if smooth and len(ys) > 5:
                ax.plot(xs, _smooth(ys), color=line.get_color(), label=f"{key} (5-step mean)")
        ax.set_title(panel.title)
        if panel.log_scale:
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / panel.file
        save_figure(fig, path)
        plt.close(fig)
        drawn.append((path, panel.caption))
    stability = plot_stability(rows, out_dir)
    if stability is not None:
        drawn.append(stability)
    return drawn, flat


def _heldout_section(run_dir: Path, rows: list[dict]) -> list[str]:
    """A table of the held-out evaluations made during training, and the best checkpoint."""
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    if not evals:
        return []
    keys = sorted({k for r in evals for k in r if k.startswith("eval/") and ("/avg@" in k or "/pass@" in k or k.endswith("/f1"))})
    lines = ["", "## Held-out evaluation during training", "",
             "| step | " + " | ".join(k.removeprefix("eval/") for k in keys) + " |",
             "|---:|" + "---:|" * len(keys)]
    for r in evals:
        lines.append(f"| {r['step']} | " + " | ".join(f"{r[k]:.3f}" if k in r else "–" for k in keys) + " |")
    best = Path(run_dir) / "checkpoints" / "best.json"
    if best.is_file():
        b = json.loads(best.read_text())
        lines += ["", f"Best: step {b['step']} ({b['metric']} = {b['value']:.3f}), checkpoint `checkpoints/{b['checkpoint']}`."]
    return lines + [""]


#: Metrics the report adds up or prints as numbers: each must be a number where a row has it.
NUMERIC_KEYS = ("step", "time/step_s", "events/invalid", "nonfinite_skipped", "reward", "accuracy",
                "objective/clip_frac", "grad_norm/total", "grad_clip/any", "active_set_size/mean", "team_tokens",
                "correct_per_million_tokens")


def check_metric_types(run_dir: Path, rows: list[dict]) -> None:
    """One clear error for the first row whose metric the report reads is not a number."""
    for i, row in enumerate(rows, 1):
        for key in NUMERIC_KEYS:
            value = row.get(key)
            if key in row and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"{Path(run_dir) / 'metrics.jsonl'}: row {i}: {key!r} is {type(value).__name__} "
                                 f"{str(value)[:40]!r}, not a number — not a metrics log srpo wrote")
        if "step" not in row:
            raise ValueError(f"{Path(run_dir) / 'metrics.jsonl'}: row {i} has no 'step' — not a metrics log srpo wrote")


def _escape(value) -> str:
    """Text copied from a folder into report.md, with HTML's special characters escaped."""
    return html.escape(str(value), quote=False)


def write_summary(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    check_metric_types(run_dir, rows)
    plots, flat = plan_plots(run_dir)
    cfg_path = sorted((run_dir / "checkpoints").glob("step_*/config.json"))
    config = json.loads(cfg_path[-1].read_text()) if cfg_path else {}
    first, last = rows[: min(5, len(rows))], rows[-min(5, len(rows)):]

    def mean(rs, key):
        vals = [r[key] for r in rs if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else float("nan")

    lines = [f"# Run report: {_escape(run_dir.name)}", ""]
    if config:  # a folder's own text: escaped (a downloaded folder's config may carry raw HTML)
        lines += [f"- model: `{_escape(config['model']['name'])}` ({_escape(config['model']['layout'])})",
                  f"- workflow: `{_escape(config['workflow']['name'])}` {_escape(config['workflow'].get('options') or '')}",
                  f"- method: `{_escape(config['method']['name'])}` (set reduction {_escape(config['method']['set_reduction'])}, "
                  f"clip ε {_escape(config['method']['clip_eps'])})",
                  f"- task: {_escape(config['task']['kind'])} — train source `{_escape(config['task']['train']['source'])}`"]
    total_time = sum(r.get("time/step_s", 0) for r in rows)
    lines += [f"- steps: {rows[-1]['step']}, training time {total_time / 60:.1f} min", "",
              "| | first 5 steps | last 5 steps |", "|---|---:|---:|"]
    for key in ("reward", "accuracy", "objective/clip_frac", "grad_norm/total", "grad_clip/any", "active_set_size/mean",
                "team_tokens", "correct_per_million_tokens", "time/step_s"):
        lines.append(f"| {key} | {mean(first, key):.4g} | {mean(last, key):.4g} |")
    lines += _heldout_section(run_dir, rows)
    lines += stability_section(rows)
    invalid = sum(r.get("events/invalid", 0) for r in rows)
    skipped = sum(r.get("nonfinite_skipped", 0) for r in rows)
    lines += ["", f"Invalid events dropped: {invalid}. Optimizer steps skipped for NaN/Inf: {skipped}.", ""]
    for name, title in (("eval_before.md", "Held-out evaluation before training"),
                        ("eval_after.md", "Held-out evaluation after training")):
        p = run_dir / name
        if p.is_file():
            lines += [f"## {title}", "", _escape(p.read_text()), ""]
    lines += ["## Plots", ""]
    for path, caption in plots:
        lines += [f"![{path.stem}](report/{path.name})", "", f"*{caption}*", ""]
    if flat:
        lines += ["Not drawn, flat over the whole run: " + "; ".join(flat) + "."]
    out = run_dir / "report.md"
    write_text_atomic(out, "\n".join(lines) + "\n")
    return out


def plot_study(root: Path, records: list[dict], k: int) -> Path | None:
    """``root/results.png``: held-out avg@k per cell (mean ± standard error over seeds, one bar
    group per dataset) and the training reward per step (mean over seeds, 3-step moving average)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from srpo.stats import mean_se

    labels = list(dict.fromkeys(r["label"] for r in records))
    datasets = list(dict.fromkeys(d for r in records for d in r["eval"]["datasets"]))
    if not labels or not datasets:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(datasets)
    for j, d in enumerate(datasets):
        means, errs = [], []
        for label in labels:
            mean, se = mean_se([r["eval"]["datasets"][d][f"avg@{k}"] for r in records
                                 if r["label"] == label and d in r["eval"]["datasets"]])
            means.append(mean)
            errs.append(se if se == se else 0.0)  # one seed: no error bar
        xs = [i + (j - (len(datasets) - 1) / 2) * width for i in range(len(labels))]
        left.bar(xs, means, width, yerr=errs, capsize=3, label=d)
    left.set_xticks(range(len(labels)))
    left.set_xticklabels([label.replace(" workflow)", ")") for label in labels], rotation=30, ha="right", fontsize=8)
    left.set_ylabel(f"held-out avg@{k}")
    left.set_title("Held-out accuracy (mean ± SE over seeds)")
    left.legend(fontsize=8)
    for label in labels:
        runs = [read_metrics(Path(root) / label / f"seed{r['seed']}") for r in records if r["label"] == label]
        runs = [rows for rows in runs if rows]
        if not runs:
            continue  # an untrained reference has no training curve
        steps = min(len(rows) for rows in runs)
        mean = [sum(rows[i].get("reward", 0.0) / len(runs) for rows in runs) for i in range(steps)]  # no overflow
        right.plot(range(1, steps + 1), _smooth(mean, 3), label=f"{label} ({len(runs)} seeds)")
    right.set_xlabel("step")
    right.set_ylabel("training reward")
    right.set_title("Training reward (mean over seeds, 3-step average)")
    right.legend(fontsize=8)
    fig.tight_layout()
    out = Path(root) / "results.png"
    save_figure(fig, out)
    plt.close(fig)
    return out


MECHANISM_PANELS = (
    ("clip_frac", "clip fraction of its update units"),
    ("weight_per_transition", "gradient weight per transition\n(share of gradient / share of transitions)"),
    ("set_log_ratio_std", "std of the set log-ratio c(K)·Σ_j ℓ_j\n(c of the run's set reduction: sqrt unless srpo_sum/mean)"),
)


def plot_mechanism(root: Path, mech: dict) -> Path | None:
    """``root/mechanism.png``: the paper's cardinality argument, measured.  Top row: per set size
    K, each method's clip fraction, gradient weight per K-transition and spread of the log-ratio it
    clips (mean ± SE over seeds of the per-run means over steps).  Bottom row: the same three over
    training for the largest K, averaged over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [lab for lab, by_k in mech.items() if by_k]
    if not labels:
        return None
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    k_max = max(int(K) for lab in labels for K in mech[lab])
    for col, (metric, title) in enumerate(MECHANISM_PANELS):
        top, bottom = axes[0][col], axes[1][col]
        for lab in labels:
            ks = [int(K) for K in mech[lab] if metric in mech[lab][K]]
            if not ks:
                continue
            means = [mech[lab][str(K)][metric]["mean"] for K in ks]
            ses = [mech[lab][str(K)][metric]["se"] for K in ks]
            top.errorbar(ks, means, yerr=[s if s == s else 0.0 for s in ses], marker="o", capsize=3, label=lab)
            series = mech[lab].get(str(k_max), {}).get("by_step", {}).get(metric, {})
            if series:
                xs = sorted(int(s) for s in series)
                bottom.plot(xs, [series[str(x)] if str(x) in series else series[x] for x in xs], marker=".", label=lab)
        top.set_xlabel("set size K")
        top.set_xticks(range(1, k_max + 1))
        top.set_title(title, fontsize=10)
        top.grid(alpha=0.3)
        bottom.set_xlabel("step")
        bottom.set_title(f"{title.splitlines()[0]}, K = {k_max}, over training", fontsize=10)
        bottom.grid(alpha=0.3)
    axes[0][1].axhline(1.0, color="grey", lw=0.8, ls="--")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    out = Path(root) / "mechanism.png"
    save_figure(fig, out)
    plt.close(fig)
    return out
