"""One rank of a ``rollout.max_staleness: 1`` run under torchrun (tests/train/test_overlap.py).

    torchrun --nproc_per_node 2 tests/helpers/overlap_worker.py RUN_DIR STEPS [--kill-after N] [--resume]

``--kill-after N`` stops every rank in step N before its checkpoint (so the newest checkpoint,
step N − 1, holds each rank's pending batch for step N); ``--resume`` continues from it.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers package

from srpo.build import load_config  # noqa: E402
from srpo.apps.cli import _maybe_init_distributed  # noqa: E402
from srpo.train import Trainer  # noqa: E402
from helpers.runs import tiny, varied_reward  # noqa: E402


def fit_until(trainer, kill_after=None, resume=False):
    """Resume ``trainer`` if asked, then train it, stopping in step ``kill_after`` before that step's
    checkpoint (its update and the next rollout are lost); the trainer is closed either way."""
    if resume:
        assert trainer.resume()

    def stop(tr, _metrics):
        if kill_after is not None and tr.step == kill_after:
            raise KeyboardInterrupt

    try:
        trainer.fit(on_step=stop)
    except KeyboardInterrupt:
        pass
    finally:
        trainer.close()
    return trainer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("steps", type=int)
    p.add_argument("--kill-after", type=int)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    extra = [f"run.steps={a.steps}", "rollout.max_staleness=1", "run.threads=1"]
    cfg = load_config(None, tiny(a.run_dir, extra))
    _maybe_init_distributed(cfg.run.device, cfg.run.collective_timeout_s)  # the gloo group, as `srpo train`
    trainer = fit_until(Trainer(cfg, progress=False, reward_fn=varied_reward), a.kill_after, a.resume)
    trainer.backend.close()  # both ranks leave together


if __name__ == "__main__":
    main()
    from srpo.parallel.teardown import end_process

    end_process(0)  # as the srpo command ends a rank (srpo.parallel.teardown)
