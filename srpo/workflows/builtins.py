"""The built-in workflows (SRPO.md, "Workflows") written against the runtime's interface.

| name               | events and set sizes                                                  |
|--------------------|-----------------------------------------------------------------------|
| single             | one answer: K=1                                                       |
| solver_verifier    | per round: solver K=1, verifier K=1; stop at ACCEPT or after R rounds |
| parallel_aggregate | N workers together (K=N), then the aggregator (K=1)                   |
| routed             | router (K=1), the chosen workers (K=chosen), aggregator (K=1)         |
| parts              | one member per part of the problem, together (K = the problem's parts)|
| search             | per turn one agent step (K=1): <search>q</search> or <answer>a</answer>|
| search_team        | per turn a verifier (K=1) picks SEARCH or ANSWER; N searchers (K=N);  |
|                    | an answerer (K=1) answers from the gathered passages                   |

Prompts are defaults per task kind; every role's system prompt, template and sampling can be
overridden from the config.

A workflow is a dataclass subclass of :class:`Workflow` registered with :func:`register_workflow`
(or named by import path, ``workflow.name: mypkg.teams:Debate``).  Its dataclass fields beyond the
base ones are its *options* (``workflow.options``), validated by their type annotations —
``Annotated[int, Field(ge=1)]`` adds bounds — and ``needs_retriever = True`` makes a config
without a corpus or retrieval server an error.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields, replace
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

from srpo.config import DEFAULT_MAX_NEW_TOKENS
from srpo.registry import Registry
from srpo.tasks.base import Task
from srpo.tasks.kinds import task_kind
from srpo.tasks.search import Retriever
from srpo.workflows.parsing import (
    parse_decision,
    parse_router_choice,
    parse_search_step,
    search_call_context,
)
from srpo.types import RoleSpec, SamplingParams
from srpo.workflows.runtime import EpisodeContext, WorkflowError

QA_SYSTEM = "Answer the question with a short phrase inside <answer> and </answer>."
SEARCH_SYSTEM = (
    "Answer the question. To look something up, write <search>your query</search> and the results "
    "will appear between <information> and </information>. You may search several times. When you "
    "know the answer, write it as <answer>short answer</answer>."
)


class OptionError(ValueError):
    """A workflow option is unknown or has a bad value; ``option`` names it."""

    def __init__(self, option: str, problem: str):
        super().__init__(f"{option}: {problem}")
        self.option = option


#: A positive integer option (a count of workers, rounds, turns, passages ...).
Count = Annotated[int, Field(ge=1)]
_BASE_FIELDS = ("kind", "max_new_tokens", "temperature", "retriever")


def _system(kind: str) -> str:
    return task_kind(kind).system_prompt


def _short(text: str, limit: int = 600) -> str:
    text = (text or "").strip()
    return text if len(text) <= limit else text[:limit] + " ..."


def _answer_of(text: str, kind: str) -> str:
    found = task_kind(kind).extract_answer(text)
    return found if found is not None else _short(text, 200)


@dataclass
class Workflow:
    """Base: a workflow names its roles, their default settings, and its ``run``."""

    name = "workflow"
    needs_retriever = False  # True: a config must give task.corpus or retriever.url
    option_aliases: typing.ClassVar[dict[str, str]] = {}  # option name in a config → field name
    batch_window_s = 0.0  # see srpo.workflows.runtime: set by workflows whose programs run outside it
    max_batch_wait_s: typing.ClassVar[float | None] = None
    kind: str = "math"  # the task kind the default prompts are written for
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    #: Role → the most tokens that role may generate, whatever ``max_new_tokens`` says (a router's
    #: one-line choice); applied in :meth:`default_role_specs`, the one place budgets resolve.
    role_caps: typing.ClassVar[dict[str, int]] = {}
    temperature: float = 1.0

    @classmethod
    def option_fields(cls) -> dict[str, Any]:
        """The options a config may set: name → type annotation (the fields beyond the base ones
        and the retriever, which srpo passes in)."""
        hints = typing.get_type_hints(cls, include_extras=True)
        names = {field_: option for option, field_ in cls.option_aliases.items()}
        return {names.get(f.name, f.name): hints[f.name] for f in fields(cls) if f.name not in _BASE_FIELDS}

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """Raise :class:`OptionError` (naming the option) for an unknown option or a bad value."""
        valid = cls.option_fields()
        for key, value in options.items():
            if key not in valid:
                raise OptionError(key, f"{cls.name} has no such option; valid: {', '.join(valid) or '(none)'}")
            try:
                TypeAdapter(valid[key]).validate_python(value, strict=True)
            except ValidationError as err:
                raise OptionError(key, f"{err.errors(include_url=False)[0]['msg']} (got {value!r})") from None

    def roles(self) -> list[str]:
        raise NotImplementedError

    def sampling(self, role: str, **extra) -> SamplingParams:
        """``role``'s default sampling: the workflow's temperature and budget, capped by
        :attr:`role_caps` (``extra``: stop strings and the like)."""
        budget = min(self.max_new_tokens, self.role_caps.get(role, self.max_new_tokens))
        return SamplingParams(temperature=self.temperature, max_new_tokens=budget, **extra)

    def default_role_specs(self) -> dict[str, RoleSpec]:
        return {r: RoleSpec(r, system=_system(self.kind), sampling=self.sampling(r)) for r in self.roles()}

    async def run(self, ctx: EpisodeContext, task: Task) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class WorkflowCapabilities:
    """What a workflow class states about itself, read once when it is registered."""

    #: A config must give ``task.corpus`` or ``retriever.url`` (its roles search).
    needs_retriever: bool = False
    #: Option name → type annotation: what ``workflow.options`` may set.
    options: dict = field(default_factory=dict)


def _is_workflow(obj) -> None:
    if not (isinstance(obj, type) and issubclass(obj, Workflow)):
        raise TypeError("expected a dataclass subclass of srpo.workflows.Workflow")


def _workflow_capabilities(cls) -> dict:
    return {"needs_retriever": bool(cls.needs_retriever), "options": cls.option_fields()}


#: name → workflow class, with its :class:`WorkflowCapabilities`: ``@register_workflow(name)`` (which
#: also sets the class's ``name``), or name one by import path.
WORKFLOWS: Registry[type[Workflow]] = Registry("workflow", WorkflowCapabilities, accepts=_is_workflow,
                                               reads=_workflow_capabilities, names_classes=True)
register_workflow = WORKFLOWS.register


@register_workflow("single")
@dataclass
class Single(Workflow):
    def roles(self):
        return ["solver"]

    async def run(self, ctx, task):
        return (await ctx.ask("solver", task.question)).text


@register_workflow("roles")
@dataclass
class Roles(Workflow):
    """Named roles and no program: what ``srpo serve`` builds for a run of an agent program
    (``openai_agent``) that it was not asked to run (:mod:`srpo.runs.trust`).  Clients call each
    role as ``model=<role>``; it runs no episodes."""

    option_aliases: typing.ClassVar[dict[str, str]] = {"roles": "role_names"}
    role_names: list[str] = field(default_factory=list)

    def __post_init__(self):
        if not self.role_names:
            raise OptionError("roles", "name the roles to serve, e.g. [solver, judge]")

    def roles(self):
        return list(self.role_names)

    def default_role_specs(self):
        # as openai_agent's: the client writes the messages
        return {r: RoleSpec(r, sampling=self.sampling(r)) for r in self.roles()}

    async def run(self, ctx, task):
        raise WorkflowError("the roles workflow serves roles to clients; it runs no episodes (give --workflow)")


@register_workflow("solver_verifier")
@dataclass
class SolverVerifier(Workflow):
    rounds: Count = 2

    def roles(self):
        return ["solver", "verifier"]

    def default_role_specs(self):
        specs = super().default_role_specs()
        specs["verifier"] = replace(specs["verifier"], system=(
            "Check the proposed solution. If it is correct reply ACCEPT. Otherwise reply REJECT and "
            "say briefly what is wrong."))
        return specs

    async def run(self, ctx, task):
        content, solution = task.question, ""
        for r in range(self.rounds):
            solution = (await ctx.ask("solver", content, turn=r)).text
            verdict = await ctx.ask("verifier", f"Problem: {task.question}\n\nProposed solution:\n{_short(solution)}", turn=r)
            decision = parse_decision(verdict.text, ("ACCEPT", "REJECT"))
            if decision is None:
                ctx.count("verifier_fallbacks")  # unparseable verdict: treated as feedback
            if decision == "ACCEPT":
                break
            content = (f"{task.question}\n\nA previous attempt:\n{_short(solution)}\n\n"
                       f"Feedback on it:\n{_short(verdict.text, 300)}\n\nSolve it again.")
        return solution


def _aggregator_prompt(task: Task, outputs, kind: str) -> str:
    lines = [f"Problem: {task.question}", "", "Answers proposed by other solvers:"]
    for i, o in enumerate(outputs, 1):
        lines.append(f"({i}) {_answer_of(o.text, kind) if o and not o.failed else '(no answer)'}")
    lines += ["", "Decide which answer is correct and give it."]
    return "\n".join(lines)


@register_workflow("parallel_aggregate")
@dataclass
class ParallelAggregate(Workflow):
    num_workers: Count = 3

    def roles(self):
        return [f"worker_{i + 1}" for i in range(self.num_workers)] + ["aggregator"]

    async def run(self, ctx, task):
        outs = await ctx.ask_set([(f"worker_{i + 1}", task.question) for i in range(self.num_workers)],
                                 event_type="workers")
        return (await ctx.ask("aggregator", _aggregator_prompt(task, outs, self.kind))).text


@register_workflow("parts")
@dataclass
class Parts(Workflow):
    """Each member owns one part of a problem (``task.kind: parts``, :mod:`srpo.tasks.parts`): the
    K members asked together — one event whose active set is all K answers, K the problem's own
    (so a batch mixes set sizes) — and the team's answer is theirs in part order."""

    kind: str = "parts"
    max_parts: Count = 4  # worker_1 .. worker_{max_parts}: the roles (one adapter each under lora)

    def roles(self):
        return [f"worker_{i + 1}" for i in range(self.max_parts)]

    async def run(self, ctx, task):
        from srpo.tasks.parts import team_answer

        parts = task.meta.get("parts") or []
        if not parts or len(parts) > self.max_parts:
            raise WorkflowError(f"the parts workflow takes tasks of 1 to {self.max_parts} parts (task.kind: parts); "
                                f"{task.task_id} has {len(parts)}")
        outs = await ctx.ask_set([(f"worker_{i + 1}", question) for i, (question, _) in enumerate(parts)],
                                 event_type="parts")
        return team_answer([o.text if o is not None and not o.failed else "" for o in outs])


@register_workflow("routed")
@dataclass
class Routed(Workflow):
    num_workers: Count = 3
    role_caps: typing.ClassVar[dict[str, int]] = {"router": 32}  # one line: WORKERS: 1, 2
    fallback: typing.Literal["all", "first"] = "all"  # what an unparseable router choice means
    max_chosen: Annotated[int, Field(ge=0)] = 0  # the most workers one episode may run (0: all); extra choices dropped

    def __post_init__(self):
        if self.fallback not in ("all", "first"):
            raise ValueError(f"fallback {self.fallback!r} is not valid; valid: all, first")
        if self.max_chosen > self.num_workers:
            raise ValueError(f"max_chosen ({self.max_chosen}) is larger than num_workers ({self.num_workers})")

    def roles(self):
        return ["router"] + [f"worker_{i + 1}" for i in range(self.num_workers)] + ["aggregator"]

    def default_role_specs(self):
        specs = super().default_role_specs()
        specs["router"] = replace(specs["router"], system=(
            f"You assign a problem to solvers numbered 1 to {self.num_workers}. Harder problems need "
            f"more solvers. Reply only with the line WORKERS: followed by the numbers, e.g. WORKERS: 1, 2."))
        return specs

    async def run(self, ctx, task):
        choice_text = (await ctx.ask("router", task.question)).text
        chosen = parse_router_choice(choice_text, self.num_workers)
        if chosen is None:
            ctx.count("router_fallbacks")
            chosen = list(range(1, self.num_workers + 1)) if self.fallback == "all" else [1]
        if self.max_chosen and len(chosen) > self.max_chosen:
            ctx.count("router_truncated")
            chosen = chosen[: self.max_chosen]
        ctx.info["router_set_size"] = len(chosen)
        outs = await ctx.ask_set([(f"worker_{i}", task.question) for i in chosen], event_type="workers")
        return (await ctx.ask("aggregator", _aggregator_prompt(task, outs, self.kind))).text


def _format_passages(passages) -> str:
    return "\n".join(f"[{i + 1}] {p.render()}" for i, p in enumerate(passages)) or "(no results)"


@register_workflow("search")
@dataclass
class Search(Workflow):
    """Search-R1-style multi-turn agent: each turn is one K=1 event; the retrieved text sits in
    the next turn's prompt (so it is never in an action mask)."""

    needs_retriever = True
    kind: str = "qa"
    retriever: Retriever | None = None
    max_turns: Count = 3
    top_k: Count = 3

    def roles(self):
        return ["searcher"]

    def default_role_specs(self):
        params = self.sampling("searcher", stop=("</search>", "</answer>"))
        return {"searcher": RoleSpec("searcher", system=SEARCH_SYSTEM, sampling=params)}

    async def run(self, ctx, task):
        if self.retriever is None:
            raise ValueError("the search workflow needs a retriever")
        context = ""
        text = ""
        for turn in range(self.max_turns):
            text = (await ctx.ask("searcher", task.question, prefix=context, event_type="search", turn=turn)).text
            kind, value = parse_search_step(text)
            if kind == "answer":
                return f"<answer>{value}</answer>"
            if kind == "none" or turn == self.max_turns - 1:
                break
            result = await ctx.call_tool("retriever", self.retriever.search, value, self.top_k)
            info = _format_passages(result.value) if result.ok else f"(search failed: {result.error})"
            context += f"{search_call_context(text)}\n<information>{info}</information>\n"
        return text


@register_workflow("search_team")
@dataclass
class SearchTeam(Workflow):
    """A verifier routes each turn to searching or answering; N searchers query in parallel."""

    needs_retriever = True
    kind: str = "qa"
    retriever: Retriever | None = None
    num_searchers: Count = 1
    max_turns: Count = 3
    top_k: Count = 3
    role_caps: typing.ClassVar[dict[str, int]] = {"verifier": 16}  # one word: SEARCH or ANSWER

    def roles(self):
        return ["verifier"] + [f"searcher_{i + 1}" for i in range(self.num_searchers)] + ["answerer"]

    def default_role_specs(self):
        specs = {
            "verifier": RoleSpec("verifier", system=(
                "You decide whether the information gathered so far answers the question. Reply SEARCH "
                "if more information is needed, or ANSWER if it is enough."), sampling=self.sampling("verifier")),
            "answerer": RoleSpec("answerer", system=QA_SYSTEM, sampling=self.sampling("answerer", stop=("</answer>",))),
        }
        for i in range(self.num_searchers):
            role = f"searcher_{i + 1}"
            specs[role] = RoleSpec(role, system=(
                "Write one search query that would find information to answer the question, as "
                "<search>query</search>."), sampling=self.sampling(role, stop=("</search>",)))
        return specs

    async def run(self, ctx, task):
        if self.retriever is None:
            raise ValueError("the search_team workflow needs a retriever")
        gathered: list = []
        for turn in range(self.max_turns):
            info = _format_passages(gathered) if gathered else "(none yet)"
            state = f"Question: {task.question}\n\nInformation gathered:\n{info}"
            decision = parse_decision((await ctx.ask("verifier", state, turn=turn)).text, ("SEARCH", "ANSWER"))
            if decision is None:
                ctx.count("verifier_fallbacks")  # unparseable: search while nothing is gathered
                decision = "ANSWER" if gathered else "SEARCH"
            if decision == "ANSWER":
                break
            outs = await ctx.ask_set([(f"searcher_{i + 1}", state) for i in range(self.num_searchers)],
                                     event_type="searchers", turn=turn)
            for o in outs:
                kind, query = parse_search_step(o.text if o else "")
                if kind != "search":
                    query = _short(o.text if o else "", 200) or task.question
                result = await ctx.call_tool("retriever", self.retriever.search, query, self.top_k)
                if result.ok:
                    gathered += [p for p in result.value if p not in gathered]
        info = _format_passages(gathered) if gathered else "(none)"
        return (await ctx.ask("answerer", f"Question: {task.question}\n\nInformation:\n{info}")).text


def needs_retriever(name: str) -> bool:
    return WORKFLOWS.capabilities(name).needs_retriever


def build_workflow(name: str, **options: Any) -> Workflow:
    """A registered workflow (or one named by import path) with its options and settings
    (``kind``, ``max_new_tokens``, ``temperature``, ``retriever`` and the workflow's own)."""
    if name not in WORKFLOWS:
        raise ValueError(f"unknown workflow {name!r}; valid: {', '.join(WORKFLOWS.names())} "
                         f"(or package.module:Class)")
    cls = WORKFLOWS[name]
    cls.check_options({k: v for k, v in options.items() if k not in _BASE_FIELDS})
    return cls(**{cls.option_aliases.get(k, k): v for k, v in options.items()})
