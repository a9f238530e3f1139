"""Rollout engines: what samples the team's generations (:mod:`srpo.rollout.engine` holds the
interface and the :data:`~srpo.rollout.engine.ENGINES` registry).  Importing the package registers
the built-in engines; :mod:`srpo.rollout.vllm` imports vLLM only when an engine starts."""

from srpo.rollout import builtin, vllm  # noqa: F401  (register builtin and vllm)
from srpo.rollout.engine import ENGINES, EngineCapabilities, RolloutEngine, engine_capabilities, register_engine

__all__ = ["ENGINES", "EngineCapabilities", "RolloutEngine", "engine_capabilities", "register_engine"]
