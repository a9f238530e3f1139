"""Workflows: the one interface for fixed, mixed and routed teams, and the built-in workflows."""

from srpo.workflows.builtins import WORKFLOWS, Count, Workflow, build_workflow, register_workflow
from srpo.types import EpisodeResult, RoleSpec
from srpo.workflows.runtime import EpisodeContext, Output, Runtime, ToolResult
from srpo.workflows import openai_agent  # noqa: F401,E402 — registers the openai_agent workflow

__all__ = ["WORKFLOWS", "Count", "EpisodeContext", "EpisodeResult", "Output", "RoleSpec", "Runtime", "ToolResult",
           "Workflow", "build_workflow", "register_workflow"]
