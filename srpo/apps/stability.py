"""The stability section of ``srpo report``: is a run's update stable, by set size K?

The measures SRPO's paper reads for its event reductions, from a run's ``metrics.jsonl``: each
policy's gradient norm before clipping (its mean and coefficient of variation over steps) and
how often ``train.max_grad_norm`` clipped it; the ratio-clip fraction, overall and per set size
K; the spread of the set log-ratio per K (its variance is this squared); the k3 estimate of
KL(π_old ‖ π_θ) per action token, overall and per K; and gradient spikes — steps whose total gradient norm exceeds
:data:`SPIKE_FACTOR` times the run's median.  With one optimizer step per rollout every ratio is
exactly 1, so the ratio measures cannot move; the section says so rather than draw flat lines.
"""

from __future__ import annotations

import math
from pathlib import Path

from srpo.runs.fileio import save_figure

#: A step is a gradient spike when its total gradient norm is above this multiple of the run's median.
SPIKE_FACTOR = 3.0


def _values(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def _k_of(key: str) -> int:
    return int(key.rsplit("/k", 1)[1])


def stability_keys(keys: set) -> dict[str, list[str]]:
    """The run's stability metrics by measure, each list in order (policies by name, then the
    all-policy total when there are several; K ascending)."""
    by_k = lambda metric: sorted((k for k in keys if k.startswith(f"by_k/{metric}/k")), key=_k_of)  # noqa: E731

    def per_policy(prefix: str, total: str) -> list[str]:
        own = sorted(k for k in keys if k.startswith(prefix) and k != total)
        return own + ([total] if len(own) > 1 and total in keys else [])

    return {
        "gradient norm before clipping": per_policy("grad_norm/", "grad_norm/total"),
        "norm clip acted (share of optimizer steps)": per_policy("grad_clip/", "grad_clip/any"),
        "ratio-clip fraction": [k for k in ("objective/clip_frac",) if k in keys] + by_k("clip_frac"),
        "std of the set log-ratio": by_k("set_log_ratio_std"),
        "KL(π_old ‖ π_θ) per token": [k for k in ("objective/approx_kl",) if k in keys] + by_k("approx_kl"),
    }


def summarise(values: list[float]) -> dict[str, float]:
    """Mean, coefficient of variation over steps (SD / mean; nan for a zero mean) and first → last 5."""
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1))
    head, tail = values[:5], values[-5:]
    return {"mean": mean, "cv": sd / mean if mean else float("nan"),
            "first": sum(head) / len(head), "last": sum(tail) / len(tail)}


def gradient_spikes(rows: list[dict]) -> list[int]:
    """Steps whose ``grad_norm/total`` exceeds :data:`SPIKE_FACTOR` × the run's median."""
    norms = [(r["step"], r["grad_norm/total"]) for r in rows if isinstance(r.get("grad_norm/total"), (int, float))]
    if len(norms) < 3:
        return []
    ordered = sorted(v for _, v in norms)
    median = ordered[len(ordered) // 2] if len(ordered) % 2 else (ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2
    return [step for step, v in norms if median > 0 and v > SPIKE_FACTOR * median]


def ratios_moved(rows: list[dict]) -> bool:
    """Whether any update unit's ratio left 1 (false for every run with one optimizer step per rollout)."""
    return any(abs(v) > 1e-7 for v in _values(rows, "objective/set_log_ratio/min") + _values(rows, "objective/set_log_ratio/max")) \
        or any(v > 0 for v in _values(rows, "objective/clip_frac"))


def update_rows(rows: list[dict]) -> list[dict]:
    """The steps whose update had events to learn from (a step whose every advantage was 0 logs a
    zero gradient and no ratio: counted in the section's line, left out of its statistics)."""
    return [r for r in rows if (r.get("objective/num_events") or 0) > 0]


def stability_section(rows: list[dict]) -> list[str]:
    """report.md's "Stability by set size" lines: one table row per measure (per policy, per K),
    over the steps that updated (:func:`update_rows`)."""
    idle = len(rows) - len(update_rows(rows))
    rows = update_rows(rows)
    keys = set().union(*rows) if rows else set()
    groups = stability_keys(keys)
    if not any(groups.values()):
        return []
    lines = ["", "## Stability by set size", ""]
    if not ratios_moved(rows):
        lines += ["Every ratio stayed at 1: with one optimizer step per rollout (train.epochs × train.minibatches = 1) "
                  "π_θ = π_old when the loss is taken, so the ratio clip, the set log-ratio's spread and the KL to "
                  "π_old cannot move. Take ≥ 2 optimizer steps per rollout to see them act.", ""]
    if idle:
        lines += [f"{idle} step(s) had no event with a non-zero advantage (nothing to learn from); the statistics below "
                  f"are over the {len(rows)} that updated.", ""]
    lines += ["| measure | metric | mean over steps | CV over steps | first 5 steps | last 5 steps |",
              "|---|---|---:|---:|---:|---:|"]
    for measure, names in groups.items():
        for key in names:
            values = _values(rows, key)
            if not values:
                continue
            s = summarise(values)
            cv = f"{s['cv']:.2f}" if s["cv"] == s["cv"] else "–"
            lines.append(f"| {measure} | `{key}` | {s['mean']:.4g} | {cv} | {s['first']:.4g} | {s['last']:.4g} |")
    spikes = gradient_spikes(rows)
    lines += ["", f"Gradient spikes (total norm > {SPIKE_FACTOR:g}× the run's median): "
              + (", ".join(f"step {s}" for s in spikes) if spikes else "none") + ".", ""]
    return lines


def plot_stability(rows: list[dict], out_dir: Path) -> tuple[Path, str] | None:
    """``out_dir/stability.png``: four panels over training — gradient norm per policy, ratio-clip
    fraction per K, std of the set log-ratio per K, KL to π_old — and its caption; None when the
    ratios never moved (nothing here but flat lines) or the run logged no update."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = update_rows(rows)
    keys = set().union(*rows) if rows else set()
    groups = stability_keys(keys)
    if not groups["gradient norm before clipping"] or not ratios_moved(rows):
        return None
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.4))
    panels = (("gradient norm before clipping", groups["gradient norm before clipping"]),
              ("ratio-clip fraction", groups["ratio-clip fraction"]),
              ("std of the set log-ratio", groups["std of the set log-ratio"]),
              ("KL(π_old ‖ π_θ) per token", groups["KL(π_old ‖ π_θ) per token"]))
    for ax, (title, names) in zip(axes.flat, panels):
        for key in names:
            xs = [r["step"] for r in rows if isinstance(r.get(key), (int, float))]
            ys = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) <= 30 else None, markersize=3, label=key.removeprefix("by_k/"))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if names:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(out_dir) / "stability.png"
    save_figure(fig, path)
    plt.close(fig)
    caption = ("Stability by set size: a stable update keeps the gradient norm, the clip fraction per K, the set "
               "log-ratio's spread per K and the KL to π_old flat over training and close across K; a clip "
               "fraction or spread that grows with K says the set ratio's scale grows with the set.")
    return path, caption
