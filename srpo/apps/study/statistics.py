"""A study's statistics as text and tables: the results table (mean ± standard error over seeds),
paired comparisons against a baseline (exact sign-flip p, Holm), the mechanism diagnostics by set size,
and the check that cells of a comparison were evaluated on the same problems."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from srpo import stats
from srpo.runs.metrics_log import read_metrics
from srpo.stats import mean_se

log = logging.getLogger(__name__)


#: What an evaluated dataset reports besides its metrics (srpo.evaluation).
NOT_METRICS = {"n", "team_tokens", "correct_per_million_tokens", "examples"}


def kind_metrics(dataset_results: list[dict]) -> list[str]:
    """The task kind's own metrics in a dataset's results (``f1``, ``per_part``), in a fixed order."""
    names = {name for d in dataset_results for name, value in d.items()
             if name not in NOT_METRICS and not name.startswith(("avg@", "pass@")) and not name.endswith("_stderr")
             and isinstance(value, (int, float))}
    return sorted(names)


def summarize(records: list[dict], k: int) -> tuple[str, dict]:
    labels = list(dict.fromkeys(r["label"] for r in records))
    datasets = list(dict.fromkeys(d for r in records for d in r["eval"]["datasets"]))
    # A task kind's own metrics come too (QA: mean token F1; parts: per_part) — accuracy stays its grade.
    metrics_of = {d: (f"avg@{k}", f"pass@{k}") + tuple(kind_metrics([r["eval"]["datasets"].get(d, {}) for r in records]))
                  for d in datasets}
    table = {}
    lines = ["| cell | seeds | " + " | ".join(f"{d} {m}" for d in datasets for m in metrics_of[d])
             + f" | macro avg@{k} | macro pass@{k} |",
             "|---|---:|" + "---:|" * (sum(len(m) for m in metrics_of.values()) + 2)]
    for label in labels:
        rs = [r for r in records if r["label"] == label]
        row = {"seeds": [r["seed"] for r in rs]}
        cells_text = []
        for d in datasets:
            for metric in metrics_of[d]:
                m, se = mean_se([r["eval"]["datasets"][d][metric] for r in rs
                                  if metric in r["eval"]["datasets"].get(d, {})])
                row[f"{d}/{metric}"] = (m, se)
                cells_text.append(f"{m:.3f} ± {se:.3f}" if se == se else f"{m:.3f}")
        for metric in (f"avg@{k}", f"pass@{k}"):
            m, se = mean_se([r["eval"]["macro"][metric] for r in rs])
            row[f"macro/{metric}"] = (m, se)
            cells_text.append(f"{m:.3f} ± {se:.3f}" if se == se else f"{m:.3f}")
        table[label] = row
        lines.append(f"| {label} | {len(rs)} | " + " | ".join(cells_text) + " |")
    lines += update_clips_by_arm(records, labels)
    lines += ["", "| cell | train reward first→last 5 steps | clip frac | clip frac by K | grad norm range (CV) | norm clip share | "
              "active-set size first→last | router set size first→last | invalid events | correct / M team tokens | minutes |",
              "|---|---|---:|---|---|---:|---|---|---:|---:|---:|"]
    for label in labels:
        for r in [r for r in records if r["label"] == label]:
            d = r["diagnostics"]
            g = d.get("grad_norm", {})
            byk = ", ".join(f"{kk}: {v:.3f}" for kk, v in d.get("clip_frac_by_k", {}).items() if v is not None)

            def f(x, fmt="{:.2f}"):
                return fmt.format(x) if isinstance(x, (int, float)) else "–"

            lines.append(
                f"| {label} s{r['seed']} | {f(d.get('train_reward_first'))} → {f(d.get('train_reward_last'))} | "
                f"{f(d.get('clip_frac'), '{:.3f}')} | {byk or '–'} | {f(g.get('min'))}–{f(g.get('max'))} ({f(g.get('cv'))}) | "
                f"{f(d.get('grad_clip_share'))} | "
                f"{f(d.get('active_set_size_first'))} → {f(d.get('active_set_size_last'))} | "
                f"{f(d.get('router_set_size_first'))} → {f(d.get('router_set_size_last'))} | {d.get('invalid_events', '–')} | "
                f"{f(d.get('correct_per_million_team_tokens'), '{:.0f}')} | {f(r.get('minutes'), '{:.1f}')} |")
    return "\n".join(lines) + "\n", table


def update_clips_by_arm(records: list[dict], labels: list[str]) -> list[str]:
    """Per cell label (an arm), mean ± SE over seeds of the ratio-clip fraction, the share of
    optimizer steps the gradient-norm clip acted in, and the mean gradient norm before clipping: the
    two clips side by side (an arm norm-clipped in most steps beside one never clipped compares the
    norm clip, not the objectives)."""
    lines = ["", "| arm | seeds | ratio-clip fraction | norm-clip share of optimizer steps | gradient norm before clipping |",
             "|---|---:|---:|---:|---:|"]
    any_row = False
    for label in labels:
        ds = [r["diagnostics"] for r in records if r["label"] == label and r.get("diagnostics")]
        if not ds:
            continue  # an untrained reference
        any_row = True
        cols = []
        for values in ([d.get("clip_frac") for d in ds], [d.get("grad_clip_share") for d in ds],
                       [(d.get("grad_norm") or {}).get("mean") for d in ds]):
            vals = [v for v in values if isinstance(v, (int, float))]
            m, se = mean_se(vals) if vals else (None, None)
            cols.append("–" if m is None else (f"{m:.3g} ± {se:.2g}" if se == se else f"{m:.3g}"))
        lines.append(f"| {label} | {len(ds)} | " + " | ".join(cols) + " |")
    return lines if any_row else []


def paired_differences(records: list[dict], baseline: str, metric: str,
                       dataset: str | None = None) -> dict[str, dict[str, Any]]:
    """Per cell label: the seed-by-seed difference of ``metric`` (of ``eval.macro``, or of one
    ``dataset``) from the ``baseline`` cell on the seeds both finished — mean, SE, 95% t interval,
    t-test p and exact sign-flip p (:func:`srpo.stats.paired`), *unadjusted*: ``significant`` here
    means p < 0.05 for this test alone; a study's words come from :func:`comparisons`, which
    corrects for the number of comparisons.  Pairing (the same seed for both) removes the variance
    the cells share: task order, first rollout, evaluation draws."""
    def value(r):
        return r["eval"]["datasets"][dataset][metric] if dataset else r["eval"]["macro"][metric]

    base = {r["seed"]: value(r) for r in records if r["label"] == baseline}
    out = {}
    for label in dict.fromkeys(r["label"] for r in records):
        if label == baseline or label.startswith("untrained"):
            continue
        mine = sorted((r["seed"], value(r)) for r in records if r["label"] == label and r["seed"] in base)
        if not mine:
            continue
        test = stats.paired([v - base[seed] for seed, v in mine])
        out[label] = {**test, "seeds": [seed for seed, _ in mine],
                      "significant": bool(test["p_t"] is not None and test["p_t"] < stats.ALPHA)}
    return out


def comparisons(records: list[dict], spec: dict) -> list[dict[str, Any]]:
    """Every paired comparison the study reports — each cell against the baseline (and the primary
    comparison's baseline), then the declared ``contrasts``, for avg@k and pass@k, on the macro average and on each dataset when
    there are several — with Holm-adjusted p-values across all of them (:func:`srpo.stats.adjust`).
    The pre-registered primary comparison (``primary``) is marked and judged on its own: Holm only
    among the primary cells, when it names several."""
    k = spec["eval"].get("k", 4)
    primary = spec.get("primary") or {}
    datasets = list(dict.fromkeys(d for r in records for d in r["eval"]["datasets"]))
    scopes = [None] + (datasets if len(datasets) > 1 else [])
    # A primary on a task kind's own metric (per_part, f1) is compared on its dataset, where the
    # metric lives (macro holds avg@k and pass@k only); it joins the study's comparisons.
    own = primary.get("metric") if primary.get("metric") not in (None, "", f"avg@{k}", f"pass@{k}") else None

    def metrics_for(scope):
        return (f"avg@{k}", f"pass@{k}") + ((own,) if own and scope == primary.get("dataset") else ())

    if own and primary.get("dataset") not in scopes:
        scopes.append(primary.get("dataset"))
    baselines = [b for b in dict.fromkeys((spec.get("baseline"), primary.get("baseline"))) if b]
    out: list[dict[str, Any]] = []
    for baseline in baselines:
        if not any(r["label"] == baseline for r in records):
            continue
        for scope in scopes:
            for metric in metrics_for(scope):
                for label, test in paired_differences(records, baseline, metric, scope).items():
                    is_primary = bool(primary) and baseline == primary["baseline"] and label in primary["cells"] \
                        and metric == primary.get("metric", f"avg@{k}") and (scope or "macro") == primary.get("dataset", "macro")
                    out.append({"cell": label, "baseline": baseline, "metric": metric, "dataset": scope or "macro",
                                "primary": is_primary, **{k_: v for k_, v in test.items() if k_ != "significant"}})
    done = {(c["cell"], c["baseline"]) for c in out}
    for contrast in spec.get("contrasts") or []:
        if (contrast["cell"], contrast["against"]) in done:
            continue
        for scope in scopes:
            for metric in metrics_for(scope):
                test = paired_differences(records, contrast["against"], metric, scope).get(contrast["cell"])
                if test is not None:
                    out.append({"cell": contrast["cell"], "baseline": contrast["against"], "metric": metric,
                                "dataset": scope or "macro", "primary": False,
                                **{k_: v for k_, v in test.items() if k_ != "significant"}})
    firsts = [c for c in out if c["primary"]]
    for c, p in zip(firsts, stats.holm([c["p_t"] if c["p_t"] is not None else float("nan") for c in firsts])):
        c["p_primary"] = p if p == p else None
        if c["sd"]:
            c["power"] = {"sd": c["sd"], "n": c["n"],
                          "power_at": {str(e): stats.power(c["sd"], c["n"], e) for e in (0.05, 0.10)},
                          "detectable_80": stats.detectable(c["sd"], c["n"]),
                          "seeds_for_80": {str(e): stats.seeds_needed(c["sd"], e) for e in (0.05, 0.10)}}
    stats.adjust(out)
    return out


def comparisons_text(comps: list[dict[str, Any]], spec: dict) -> str:
    """The primary result (with its power), then every comparison with Holm-adjusted p-values."""
    lines = []
    primary = [c for c in comps if c["primary"]]
    if primary:
        p = spec["primary"]
        lines += [f"## Primary comparison (pre-registered): {p.get('metric')} on {p.get('dataset', 'macro')}, "
                  f"{', '.join(p['cells'])} against `{p['baseline']}`", "",
                  "| cell | seeds | mean difference | 95% t CI | + / − seeds | p (t) | p (exact sign-flip) | verdict |",
                  "|---|---:|---:|---|---|---:|---:|---|"]
        for c in primary:
            ci = f"[{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}]" if c["ci95"] else "–"
            lines.append(f"| {c['cell']} | {c['n']} | {c['mean']:+.3f} | {ci} | {c.get('positive', '–')} / "
                         f"{c.get('negative', '–')} | {stats.fmt_p(c.get('p_primary', c['p_t']))} | "
                         f"{stats.fmt_p(c['p_sign_flip'])} | {c['verdict']} |")
        for c in primary:
            pw = c.get("power")
            if pw:
                lines += ["", f"Power ({c['cell']}): the paired differences' SD is {pw['sd']:.3f} over {pw['n']} seeds; "
                          f"a true difference of 0.05 would be found with probability {pw['power_at']['0.05']:.2f}, "
                          f"0.10 with {pw['power_at']['0.1']:.2f}; the smallest difference found 80% of the time is "
                          f"{pw['detectable_80']:.3f}; 80% power needs {pw['seeds_for_80']['0.05']} seeds for 0.05 and "
                          f"{pw['seeds_for_80']['0.1']} for 0.10."]
        lines.append("")
    others = [c for c in comps if not c["primary"]]
    if others:
        lines += [f"## Paired comparisons ({len(comps)} in this study; p-values Holm-adjusted across all of them)", "",
                  "| cell | against | metric | dataset | seeds | mean difference | SE | 95% t CI | p (t) | p (t, Holm) | "
                  "p (sign-flip) | p (sign-flip, Holm) | verdict |",
                  "|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
        for c in others:
            ci = f"[{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}]" if c["ci95"] else "–"
            se = f"{c['se']:.3f}" if c["se"] is not None else "–"
            lines.append(f"| {c['cell']} | {c['baseline']} | {c['metric']} | {c['dataset']} | {c['n']} | "
                         f"{c['mean']:+.3f} | {se} | {ci} | {stats.fmt_p(c['p_t'])} | {stats.fmt_p(c['p_t_holm'])} | "
                         f"{stats.fmt_p(c['p_sign_flip'])} | {stats.fmt_p(c['p_sign_flip_holm'])} | {c['verdict']} |")
        n_min = min((c["n"] for c in comps if c["n"]), default=0)
        if n_min and n_min <= 5:
            lines += ["", f"With {n_min} seeds no exact sign-flip test can go below p = {2 / 2 ** n_min:.4f}: a "
                      f"significant t-test at that size rests on the differences being normal."]
    return "\n".join(lines) + "\n"


BY_K = ("clip_frac", "grad_share", "set_log_ratio_std", "unit_log_ratio_std", "events")


def mechanism(root: Path, records: list[dict]) -> dict[str, Any]:
    """Per cell label and set size K, from every seed's metrics.jsonl: the mean over steps of the
    clip fraction, the gradient share, the spreads of the set and clipped log-ratios, and the
    gradient share per transition relative to an average transition (``weight_per_transition``:
    share of the gradient / share of the transitions; 1 = every transition weighs the same).
    Mean ± SE over seeds; also the per-step means over seeds (``by_step``)."""
    from srpo.methods import METHODS

    out: dict[str, Any] = {}
    for label in dict.fromkeys(r["label"] for r in records if not r["label"].startswith("untrained")):
        seeds = [r for r in records if r["label"] == label]
        per_seed: dict[int, dict[str, dict[int, list[float]]]] = {}  # K → metric → seed → per-step values
        steps: dict[int, dict[str, dict[int, list[float]]]] = {}
        name = seeds[0]["overrides"].get("method.name") or \
            seeds[0].get("recipe", {}).get("base_config", {}).get("method", {}).get("name", "srpo")
        split = METHODS[name].per_member  # its events are members: a K-transition counts K times
        for r in seeds:
            rows = read_metrics(root / label / f"seed{r['seed']}")
            for row in rows:
                ks = sorted({int(k.rsplit("/k", 1)[1]) for k in row if k.startswith("by_k/events/k")})
                transitions = {K: row[f"by_k/events/k{K}"] / (K if split else 1) for K in ks}
                total = sum(transitions.values()) or 1.0
                for K in ks:
                    values = {m: row.get(f"by_k/{m}/k{K}") for m in BY_K}
                    if values["grad_share"] is not None and transitions[K]:
                        values["weight_per_transition"] = values["grad_share"] / (transitions[K] / total)
                    for m, v in values.items():
                        if v is None:
                            continue
                        per_seed.setdefault(K, {}).setdefault(m, {}).setdefault(r["seed"], []).append(v)
                        steps.setdefault(K, {}).setdefault(m, {}).setdefault(row["step"], []).append(v)
        cell: dict[str, Any] = {}
        for K, series in per_seed.items():
            stats = {}
            for m in (*BY_K, "weight_per_transition"):
                seed_means = [sum(v) / len(v) for v in series.get(m, {}).values() if v]
                if seed_means:
                    mean, se = mean_se(seed_means)
                    stats[m] = {"mean": mean, "se": se, "seeds": len(seed_means)}
            stats["by_step"] = {m: {s: sum(v) / len(v) for s, v in sorted(by.items())} for m, by in steps[K].items()}
            cell[str(K)] = stats
        out[label] = dict(sorted(cell.items(), key=lambda kv: int(kv[0])))
    return out


def pairing_check(root: Path, records: list[dict]) -> dict[str, Any]:
    """Whether one seed gave every cell of one workflow the same first rollout: the step-1
    training reward of every trained cell, per seed (equal within a workflow when paired)."""
    out: dict[str, dict[str, float]] = {}
    for r in records:
        if r["label"].startswith("untrained"):
            continue
        rows = read_metrics(root / r["label"] / f"seed{r['seed']}")
        if rows:
            out.setdefault(str(r["seed"]), {})[r["label"]] = rows[0].get("reward")
    return out


def nan_to_none(obj: Any) -> Any:
    """``obj`` with every non-finite float as None: a one-seed SE or an empty mean is NaN here, and
    NaN is not JSON (jq, JavaScript and strict parsers refuse the file)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [nan_to_none(v) for v in obj]
    return obj
