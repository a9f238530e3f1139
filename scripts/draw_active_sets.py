"""Draw the method page's diagram: events and their active sets in fixed, mixed and routed teams.

    python scripts/draw_active_sets.py --out docs/img/active_sets.png

Each row is one kind of workflow, each column one episode of it on the same task; a box is an
event (one state transition), the dots inside it are the members of its active set S_e, and the
label under it is K_e = |S_e|.  What the figure shows is what ``srpo.events`` records: the update
unit is the box, whatever its size, and a routed team's box changes size from episode to episode.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# (row title, [episode 1 events, episode 2 events]); an event is (label, [member roles])
ROWS = [
    ("fixed: three workers answer in parallel\n(the same set sizes every episode)",
     [[("workers", ["w1", "w2", "w3"])],
      [("workers", ["w1", "w2", "w3"])]]),
    ("mixed: parallel_aggregate\n(several sizes in one episode)",
     [[("workers", ["w1", "w2", "w3"]), ("aggregate", ["agg"])],
      [("workers", ["w1", "w2", "w3"]), ("aggregate", ["agg"])]]),
    ("routed: the router chooses the workers\n(K changes from episode to episode)",
     [[("route", ["rt"]), ("workers", ["w1", "w3"]), ("aggregate", ["agg"])],
      [("route", ["rt"]), ("workers", ["w2"]), ("aggregate", ["agg"])]]),
]
# rt: the router, agg: the aggregator, w1-w3: the workers
ROLE_COLOURS = {"rt": "#8c564b", "agg": "#2ca02c", "w1": "#1f77b4", "w2": "#ff7f0e", "w3": "#9467bd"}


def draw_event(ax, x: float, y: float, label: str, members: list[str]) -> float:
    """One event at (x, y) as a box around its members; returns the box's right edge."""
    from matplotlib.patches import FancyBboxPatch

    width = 0.55 * len(members) + 0.3
    ax.add_patch(FancyBboxPatch((x, y - 0.35), width, 0.7, boxstyle="round,pad=0.05",
                                fc="#f4f4f4", ec="#444444", lw=1.2))
    for i, role in enumerate(members):
        cx = x + 0.42 + 0.55 * i
        ax.scatter([cx], [y], s=330, color=ROLE_COLOURS[role], zorder=3)
        ax.text(cx, y, role, ha="center", va="center", fontsize=6.5, color="white", zorder=4, weight="bold")
    ax.text(x + width / 2, y + 0.5, label, ha="center", va="bottom", fontsize=7.5, color="#333333")
    ax.text(x + width / 2, y - 0.5, f"K = {len(members)}", ha="center", va="top", fontsize=8)
    return x + width


def draw(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10.5, 5.6))
    ax.set_xlim(-4.2, 11.2)
    ax.set_ylim(-0.9 - 2.2 * (len(ROWS) - 1), 1.6)
    ax.axis("off")
    for col, title in enumerate(("episode 1", "episode 2")):
        ax.text(0.2 + 5.6 * col + 2.4, 1.45, title, ha="center", fontsize=10, weight="bold")
    for row, (title, episodes) in enumerate(ROWS):
        y = -2.2 * row
        ax.text(-4.1, y, title, ha="left", va="center", fontsize=8.5)
        for col, events in enumerate(episodes):
            x = 0.2 + 5.6 * col
            for i, (label, members) in enumerate(events):
                right = draw_event(ax, x, y, label, members)
                if i + 1 < len(events):
                    ax.annotate("", xy=(right + 0.45, y), xytext=(right + 0.08, y),
                                arrowprops={"arrowstyle": "->", "color": "#666666"})
                x = right + 0.55
    fig.text(0.5, 0.015, "one box = one event = one update unit: one set ratio "
             "exp(c(K)·Σ member log-ratios), one advantage, clipped once",
             ha="center", fontsize=9, style="italic")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("docs/img/active_sets.png"))
    draw(p.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
