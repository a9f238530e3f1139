"""What the tests share: the repository's paths, and worker scripts the tests start as processes
(torchrun ranks, ``srpo serve`` on a stand-in engine, agent programs, slow rewards)."""

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
ROOT = HELPERS.parents[1]
