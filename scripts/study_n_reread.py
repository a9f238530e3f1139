"""Study (n) re-read without norm clipping: the tuning rule (studies/n_reread/).

    python scripts/study_n_reread.py runs/study-n-reread-tuning/results.json [--write]

Per arm (srpo, grpo) the rate with the best median validation per-part accuracy over the tuning
seeds (``srpo.apps.study.tuning``); ``--write`` fills the two ``train.lr: TUNED`` of study.yaml.
The comparison itself is the study runner's primary (``srpo study --config studies/n_reread/study.yaml``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srpo.apps.study import tuning  # noqa: E402

STUDY = Path(__file__).resolve().parents[1] / "studies" / "n_reread" / "study.yaml"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="the tuning study's results.json")
    p.add_argument("--write", action="store_true", help="write the rates into study.yaml")
    args = p.parse_args(argv)
    chosen = tuning.choose_rates(json.loads(args.results.read_text())["cells"], ("srpo", "grpo"),
                                 "parts-validation", "per_part")
    print("\n".join(tuning.describe(chosen)))
    if args.write:
        if any(c["extend"] for c in chosen.values()):
            raise SystemExit("not written: a winner is at the edge of its grid")
        tuning.write_rates(STUDY, chosen)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
