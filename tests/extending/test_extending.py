"""Extending srpo from outside the package (docs/extending.md), evaluation during training,
the registries, the configuration layer and metrics that declare their reduction."""

import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from srpo.build import load_config
from srpo.config import ConfigError
from srpo.train import Trainer

ROOT = Path(__file__).resolve().parents[2]


def varied_reward(task, answer):
    """A reward that differs across episodes of one task (tiny random models are never right)."""
    return float(sum(map(ord, answer or "")) % 5) / 4.0


def tiny(tmp_path, *extra):
    return [f"run.output_dir={tmp_path / 'run'}", "run.steps=1", "model.name=tiny-llama", "workflow.max_new_tokens=6",
            "train.tasks_per_step=2", "train.group_size=2", "train.lr=0.01", "task.train.n=8", "task.eval=[]",
            "checkpoint.every=0", "log.backends=[]", *extra]


# ------------------------------------------------------------------ the docs/extending.md recipes, run as written

def readme_package(tmp_path: Path, name: str = "mypkg") -> Path:
    """Write every docs/extending.md block that starts with ``# mypkg/<file>.py`` into ``tmp_path/mypkg`` and
    put it on sys.path: the recipes are tested exactly as the page shows them."""
    text = (ROOT / "docs" / "extending.md").read_text()
    blocks = re.findall(r"```python\n# mypkg/(\w+\.py)\n(.*?)```", text, flags=re.S)
    assert {f for f, _ in blocks} >= {"losses.py", "teams.py", "kinds.py", "decoders.py", "parts.py", "parsers.py"}, \
        "a recipe left docs/extending.md"
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for fname, code in blocks:
        (pkg / fname).write_text(code.replace("mypkg", name))
    sys.path.insert(0, str(tmp_path))
    return pkg


def _forget(package: str) -> None:
    """Drop what a recipe package registered, so later tests see the built-in registries."""
    from srpo.gateway.parsers import REASONING_PARSERS, TOOL_PARSERS
    from srpo.methods import METHODS
    from srpo.objective import LOSSES, LossInputs
    from srpo.parallel import BACKENDS
    from srpo.policies.fast_decode import FAST_DECODERS
    from srpo.rollout import ENGINES
    from srpo.runs.trackers import TRACKERS
    from srpo.tasks.kinds import TASK_KINDS, TaskKind
    from srpo.workflows import WORKFLOWS

    def origin(obj):  # instances report their class's module; their functions tell where they were made
        if isinstance(obj, TaskKind):
            return obj.load_file.__module__
        made = getattr(obj, "parse", None) or getattr(obj, "split", None)  # a tool or reasoning parser
        return getattr(made, "__module__", "") if made is not None else getattr(obj, "__module__", "")

    for registry in (LOSSES, METHODS, WORKFLOWS, TASK_KINDS, FAST_DECODERS, ENGINES, BACKENDS, TRACKERS,
                     TOOL_PARSERS, REASONING_PARSERS):
        for name, obj in list(registry._objects.items()):
            if name.startswith(package) or str(origin(obj)).startswith(package):
                registry.unregister(name)


@pytest.fixture
def mypkg(tmp_path, request):
    name = f"mypkg_{request.node.name.split('[')[0].removeprefix('test_')[:20]}"
    readme_package(tmp_path, name)
    yield name
    _forget(name)
    sys.path.remove(str(tmp_path))
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


def moved(before, trainer):
    return any(not torch.equal(a, b) for a, b in zip(before, trainer.policies.parameters("shared")))


def test_recipe_a_loss_trains_by_import_path(mypkg, tmp_path):
    cfg = load_config(None, tiny(tmp_path, f"method.loss={mypkg}.losses:set_pg",
                                 "workflow.name=parallel_aggregate", "workflow.options={num_workers: 2}"))
    trainer = Trainer(cfg, progress=False, reward_fn=varied_reward)
    before = [p.detach().clone() for p in trainer.policies.parameters("shared")]
    metrics = trainer.fit()[-1]
    assert trainer.method.loss == f"{mypkg}.losses:set_pg"
    assert metrics["objective/num_events"] > 0 and "objective/set_ratio/mean" in metrics
    assert "objective/clip_frac" not in metrics  # the user's loss reported what it declared, nothing else
    assert moved(before, trainer)
    from srpo.objective import LossInputs, update_unit

    assert update_unit("set_pg") == "event"


class _Scripted:
    """A rollout engine that answers every request with one fixed text (tokenised as the model would)."""

    def __init__(self, tokenizer, text):
        self.tokenizer, self.text = tokenizer, text

    def generate(self, requests, generator=None):
        from srpo.types import Sample

        ids = self.tokenizer(self.text, add_special_tokens=False)["input_ids"]
        return [Sample(ids, self.text, [0.0] * len(ids), "eos") for _ in requests]


def test_recipe_a_tool_and_a_reasoning_parser_read_a_roles_replies(mypkg, tmp_path):
    openai = pytest.importorskip("openai")
    from srpo import build
    from srpo.gateway.backends import ServeBackend
    from srpo.gateway.server import Gateway

    roles = f"workflow.roles={{solver: {{tool_parser: {mypkg}.parsers:PYTHONIC, reasoning_parser: nope}}}}"
    with pytest.raises(ConfigError, match="workflow.roles.solver.reasoning_parser: unknown reasoning parser 'nope'; "
                                          "valid: answer_line, think"):  # importing the tool parser registered both
        load_config(None, tiny(tmp_path, roles))
    cfg = load_config(None, tiny(tmp_path, roles.replace("nope", f"{mypkg}.parsers:ANSWER_LINE")))
    specs = build.role_specs(cfg, build.workflow(cfg))
    policies = build.policies(cfg, ["solver"])
    reply = 'Reasoning: Paris is a city.\nAnswer: Let me check. [weather(city="Paris"), time(zone="CET")]'
    backend = ServeBackend(_Scripted(policies.tokenizer, reply), policies, specs)
    gw = Gateway()
    try:
        client = openai.OpenAI(base_url=gw.url(gw.open(backend)), api_key="x", max_retries=0)
        tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
        clock = {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}}
        message = client.chat.completions.create(model="solver", messages=[{"role": "user", "content": "Weather?"}],
                                                 tools=[tool, clock]).choices[0].message
        assert message.content == "Let me check." and message.model_extra["reasoning_content"] == "Paris is a city."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            ("weather", {"city": "Paris"}), ("time", {"zone": "CET"})]
        only_weather = client.chat.completions.create(model="solver", messages=[{"role": "user", "content": "?"}],
                                                      tools=[tool]).choices[0].message
        assert [c.function.name for c in only_weather.tool_calls] == ["weather"]  # time was not offered: not passed on
        forced = client.chat.completions.create(model="solver", messages=[{"role": "user", "content": "?"}],
                                                tools=[tool], tool_choice="required")
        assert forced.choices[0].finish_reason == "tool_calls"  # the parser's start was written for the model
        streamed = [c.choices[0].delta for c in client.chat.completions.create(
            model="solver", messages=[{"role": "user", "content": "Weather?"}], stream=True)]
        assert "".join(d.content or "" for d in streamed) == reply.partition("\nAnswer: ")[2]  # no tools: text
    finally:
        gw.stop()
        backend.close()


def test_recipe_a_workflow_trains_by_import_path(mypkg, tmp_path):
    cfg = load_config(None, tiny(tmp_path, f"workflow.name={mypkg}.teams:Debate", "workflow.options={debaters: 3}"))
    trainer = Trainer(cfg, progress=False, reward_fn=varied_reward)
    assert trainer.workflow.roles() == ["debater_1", "debater_2", "debater_3", "judge"]
    trainer.fit()
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples[0]["set_sizes"] == [3, 1]
    # Its options are checked by their annotations, before any model loads.
    with pytest.raises(ConfigError, match="workflow.options.debaters: Input should be greater than or equal to 1"):
        load_config(None, tiny(tmp_path, f"workflow.name={mypkg}.teams:Debate", "workflow.options={debaters: 0}"))
    with pytest.raises(ConfigError, match="workflow.options.judges: debate has no such option; valid: debaters"):
        load_config(None, tiny(tmp_path, f"workflow.name={mypkg}.teams:Debate", "workflow.options={judges: 2}"))


def test_recipe_a_task_kind_trains_and_evaluates(mypkg, tmp_path):
    data = tmp_path / "parity.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"Is {i} even?", "answer": "yes" if i % 2 == 0 else "no"})
                              for i in range(6)) + "\n")
    cfg = load_config(None, tiny(tmp_path, f"task.kind={mypkg}.kinds:PARITY",
                                 "task.train={source: synthetic_parity, n: 8}",
                                 f"task.eval=[{{source: {data}, n: 0, name: parity-file}}]",
                                 "eval.every=1", "eval.k=2"))
    trainer = Trainer(cfg, progress=False)  # the kind's own exact reward
    metrics = trainer.fit()[-1]
    assert trainer.train_tasks[0].question.startswith("Is ") and trainer.train_tasks[0].kind == "parity"
    assert "eval/parity-file/avg@2" in metrics and 0.0 <= metrics["eval/parity-file/avg@2"] <= 1.0
    from srpo.tasks.kinds import TASK_KINDS, task_kind

    kind = task_kind(f"{mypkg}.kinds:PARITY")
    assert kind.grade(trainer.train_tasks[0], "I think yes.") == float(trainer.train_tasks[0].answers[0] == "yes")
    assert kind.system_prompt in trainer.role_specs["solver"].system
    with pytest.raises(ConfigError, match="task.train.source: synthetic_arithmetic is a math source"):
        load_config(None, tiny(tmp_path, f"task.kind={mypkg}.kinds:PARITY"))
    _forget(mypkg)
    assert "parity" not in TASK_KINDS and "synthetic_parity" not in str(TASK_KINDS.names())


def test_recipe_a_fast_decoder_for_another_architecture(mypkg):
    """Mistral has the Llama layout: registered from outside, the lean step gives HF's logits."""
    import importlib

    from transformers import DynamicCache, MistralConfig, MistralForCausalLM

    from srpo.policies.fast_decode import FAST_DECODERS, fast_decoder_for
    from srpo.policies.logprobs import cache_keyword, position_ids_from_mask

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           sliding_window=None)
    model = MistralForCausalLM(config).eval()
    assert fast_decoder_for(model) is None  # no decoder for mistral yet: sampling takes the HF step
    module = importlib.import_module(f"{mypkg}.decoders")
    try:
        decoder = fast_decoder_for(model)
        assert isinstance(decoder, module.MistralDecoder)
        windowed = MistralForCausalLM(MistralConfig(**{**config.to_dict(), "sliding_window": 16})).eval()
        assert fast_decoder_for(windowed) is None  # its supports() declines
        P, rows = 7, 3
        ids = torch.randint(0, 97, (rows, P + 1))
        attn = torch.ones(rows, P + 1, dtype=torch.long)
        attn[0, :2] = 0  # left padding in one row
        with torch.no_grad():
            full = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits[:, -1]
            cache = DynamicCache()
            model(input_ids=ids[:, :P], attention_mask=attn[:, :P], position_ids=position_ids_from_mask(attn[:, :P]),
                  use_cache=True, **{cache_keyword(model): cache})
            state = decoder.start(cache, torch.arange(rows), capacity=P + 4)
            step = decoder.step(state, ids[:, P], attn[:, :P].sum(-1), attn.bool())
        torch.testing.assert_close(step, full, atol=1e-4, rtol=1e-4)
    finally:
        _forget(mypkg)


# ------------------------------------------------------------------ evaluation during training

def test_eval_every_logs_heldout_curves_keeps_the_best_checkpoint_and_reports(tmp_path):
    from srpo.apps.report import write_summary

    cfg = load_config(None, tiny(tmp_path, "run.steps=3", "eval.every=2", "eval.k=2", "eval.n=3",
                                 "task.eval=[{source: synthetic_arithmetic, level: 0, n: 5, seed: 9, name: held}]",
                                 "checkpoint.keep=1", "log.backends=[tensorboard]"))
    trainer = Trainer(cfg, progress=False, reward_fn=varied_reward)
    trainer.fit()
    trainer.close()
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r["step"] for r in rows if "eval/held/avg@2" in r]
    assert evaluated == [2, 3]  # every 2 steps, and after the last
    for r in rows:
        if "eval/held/avg@2" in r:
            assert {"eval/held/pass@2", "eval/macro/avg@2", "eval/macro/pass@2"} <= set(r)
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best["step"] in (2, 3) and best["metric"] == "eval/macro/avg@2"
    assert (run / "checkpoints" / best["checkpoint"] / "manifest.json").is_file()  # kept despite keep=1
    assert (run / "checkpoints" / "step_0000003").is_dir()
    # TensorBoard has the held-out curve.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/held/avg@2")] == [2, 3]
    report = write_summary(run).read_text()
    assert "## Held-out evaluation during training" in report and (run / "report" / "heldout.png").is_file()
    assert f"checkpoint `checkpoints/{best['checkpoint']}`" in report
    # The best evaluation survives a resume.
    trainer2 = Trainer(load_config(None, tiny(tmp_path, "run.steps=3", "eval.every=2", "eval.k=2", "eval.n=3",
                                              "task.eval=[{source: synthetic_arithmetic, level: 0, n: 5, seed: 9, name: held}]",
                                              "checkpoint.keep=1")), progress=False)
    assert trainer2.resume() and trainer2.best == best
    trainer2.close()


def test_eval_every_without_heldout_sets_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="eval.every: evaluation during training needs held-out sets in task.eval"):
        load_config(None, tiny(tmp_path, "eval.every=2"))


def test_paper_configs_name_their_evaluation_sets_and_evaluate_during_training():
    from srpo.config import Config, parse_section, read_yaml

    for f in glob.glob(str(ROOT / "configs" / "paper" / "*.yaml")):
        if "study" in f:
            continue
        cfg = parse_section(Config, read_yaml(f))
        assert cfg.task.eval and cfg.eval.every > 0, f


# ------------------------------------------------------------------ configuration

def test_every_config_in_configs_validates(tmp_path, monkeypatch):
    from srpo.config import Config, parse_section, read_yaml
    from srpo.apps.study.schema import load_study

    # search_warmstart.yaml starts from the warm starts `srpo sft` writes first (paths from the root).
    monkeypatch.chdir(tmp_path)
    for name in ("warm-search_team", "warm-search", "warm-search-matched", "sft-search_team", "sft-search"):
        (tmp_path / "runs" / name / "model").mkdir(parents=True)

    runs = [f for f in glob.glob(str(ROOT / "configs" / "**" / "*.yaml"), recursive=True)
            if "/studies/" not in f and "study_" not in Path(f).name]
    for f in runs:
        if "/paper/" in f:  # GPU/hub models and hub datasets: their fields must still parse
            parse_section(Config, read_yaml(f))
            # ... also as docs/scaling.md launches them on 8 GPUs: FSDP with the vLLM engine they select,
            # their LoRA layout, and full fine-tuning with float32 master weights (its --set line).
            for extra in ({}, {"layout": "shared", "dtype": "float32", "autocast_bf16": True}):
                data = read_yaml(f)
                data.setdefault("train", {}).update(parallel="fsdp", activation_checkpointing=True)
                data.setdefault("model", {}).update(extra)
                data.setdefault("rollout", {})["sleep_during_update"] = True
                data.setdefault("run", {})["device"] = "cuda"
                assert parse_section(Config, data).rollout.engine == "vllm"
        else:
            load_config(f)
    # Every study file anywhere in configs/ (a study names a base and axes), the paper's included;
    # the paper's cells select the vLLM engine, installed in its own environment (.venv-vllm).
    studies = [f for f in glob.glob(str(ROOT / "configs" / "**" / "*.yaml"), recursive=True)
               if {"base", "axes"} <= set(read_yaml(f) or {})]
    assert len(studies) >= 14 and any("/paper/" in f for f in studies)
    from srpo import build
    from srpo.apps.study.schema import cells, references

    checked = 0
    for s in studies:
        with monkeypatch.context() as m:
            if "/paper/" in s:
                m.setattr(build, "_check_installed", lambda cfg: None)
            spec = load_study(s)  # every cell and reference validated
        checked += len(cells(spec)) + len(references(spec))
    assert checked > 100


def test_every_config_field_is_documented():
    from pydantic import BaseModel

    from srpo import config

    missing = []
    for name in dir(config):
        cls = getattr(config, name)
        if isinstance(cls, type) and issubclass(cls, BaseModel) and cls.__module__ == config.__name__:
            missing += [f"{cls.__name__}.{f}" for f, info in cls.model_fields.items() if not info.description]
    assert not missing, missing


@pytest.mark.parametrize("text, message", [
    ("eval: {k: 2, kk: 3, datasets: [{source: synthetic_arithmetic, n: 5}]}", "eval.kk: unknown key"),
    ("eval: {k: 2, datasets: [{source: synthetic_arithmetic, n: five}]}", "eval.datasets[0].n: expected an integer"),
    ("eval: {k: 2, datasets: []}\naxes: {m: [{label: a, set: {method.nmae: srpo}}]}", "cell a (seed 0): method.nmae: unknown key"),
    ("eval: {k: 2, datasets: []}\naxes: {m: [{lable: a}]}", "axes.m[0].label: missing (a required key)"),
])
def test_study_file_is_typed_and_every_cell_validated(tmp_path, text, message):
    from srpo.apps.study.schema import load_study

    base = tmp_path / "base.yaml"
    base.write_text("run: {steps: 1}\nmodel: {name: tiny-llama}\n")
    study = tmp_path / "study.yaml"
    body = f"output_dir: {tmp_path / 'out'}\nbase: base.yaml\nseeds: [0]\n{text}\n"
    if "axes" not in text:
        body += "axes: {m: [{label: a, set: {method.name: srpo}}]}\n"
    study.write_text(body)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_study(study)


def test_one_override_syntax_several_per_flag(tmp_path):
    from srpo.apps.cli import build_parser
    from srpo.config import apply_overrides

    args = build_parser().parse_args(["train", "--config", "x.yaml", "--set", "train.lr=1.0e-5", "run.steps=3",
                                      "--set", "workflow.options={num_workers: 2}"])
    assert args.set == ["train.lr=1.0e-5", "run.steps=3", "workflow.options={num_workers: 2}"]
    as_strings = apply_overrides({}, args.set)
    as_values = apply_overrides({}, {"train.lr": 1e-5, "run.steps": 3, "workflow.options": {"num_workers": 2}})
    assert as_strings == as_values
    with pytest.raises(ConfigError, match="expected key=value"):
        apply_overrides({}, ["train.lr"])


def test_recipe_an_engine_a_backend_and_a_tracker_train_by_import_path(mypkg, tmp_path):
    """Parts registered from outside the package: the run samples through the toy engine, reduces
    gradients through the toy backend and logs through the toy tracker; the config checks ask
    their capabilities (the toy engine holds no weights of its own, so it cannot overlap a sharded
    backend)."""
    parts = [f"rollout.engine={mypkg}.parts:CountingEngine", f"train.parallel={mypkg}.parts:CountingBackend",
             f"log.backends=[{mypkg}.parts:RowsFile]"]
    cfg = load_config(None, tiny(tmp_path, "run.steps=2", *parts))
    trainer = Trainer(cfg, progress=False, reward_fn=varied_reward)
    before = [p.detach().clone() for p in trainer.policies.parameters("shared")]
    trainer.fit()
    trainer.close()
    import importlib

    calls = importlib.import_module(f"{mypkg}.parts").CALLS
    kinds = [c[0] for c in calls]
    assert kinds.count("reduce_gradients") == 2 and kinds.count("update_weights") == 2 and kinds[-1] == "close"
    assert sum(c[1] for c in calls if c[0] == "generate") == 2 * 2 * 2  # tasks × group × steps
    assert moved(before, trainer)
    rows = [json.loads(line) for line in (tmp_path / "run" / "rows.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "loss" in rows[0]
    from srpo.train.state import run_artefacts

    assert "rows.jsonl" in run_artefacts(cfg)
    with pytest.raises(ConfigError, match="needs an engine that holds its own copy of the weights"):
        load_config(None, tiny(tmp_path, f"rollout.engine={mypkg}.parts:CountingEngine", "train.parallel=fsdp",
                               "rollout.max_staleness=1"))
    with pytest.raises(ConfigError, match="rollout.engine: 'srpo.methods:Method' cannot be used as a rollout engine"):
        load_config(None, tiny(tmp_path, "rollout.engine=srpo.methods:Method"))
    with pytest.raises(ConfigError, match="train.parallel: unknown parallel backend 'tp'; valid: .*ddp, fsdp"):
        load_config(None, tiny(tmp_path, "train.parallel=tp"))
    with pytest.raises(ConfigError, match="train.fsdp_share_prompts: a sharded backend's setting"):
        load_config(None, tiny(tmp_path, "train.fsdp_share_prompts=true"))  # ddp, by what it declares


def test_config_checks_ask_an_engine_s_capabilities():
    """An engine declaring it serves no LoRA and runs on CUDA only is refused on a lora layout and
    on the CPU — by what it declares, not by its name."""
    from srpo.rollout.engine import ENGINES, register_engine

    @register_engine("cuda_only_full_models", supports_lora=False, devices=("cuda",))
    class CudaOnly:
        @classmethod
        def from_config(cls, cfg, policies):
            raise AssertionError("never built: the config is refused first")

    try:
        with pytest.raises(ConfigError, match="rollout.engine: cuda_only_full_models runs on cuda, not on run.device: cpu"):
            load_config(None, ["rollout.engine=cuda_only_full_models"])
        with pytest.raises(ConfigError, match="does not serve LoRA adapters"):
            load_config(None, ["rollout.engine=cuda_only_full_models", "run.device=cuda", "model.layout=lora"])
    finally:
        ENGINES.unregister("cuda_only_full_models")


def test_registries_list_names_and_reject_unknown_ones_with_the_valid_ones():
    from srpo.methods import METHODS
    from srpo.objective import LOSSES, LossInputs, update_unit
    from srpo.registry import RegistryError
    from srpo.tasks.kinds import TASK_KINDS
    from srpo.workflows import WORKFLOWS

    assert {update_unit(n) for n in ("srpo", "grpo", "gspo")} == {"event", "token", "member"}
    assert METHODS["dr_mas"].per_member and METHODS["dr_mas"].loss in LOSSES
    assert WORKFLOWS.capabilities("search_team").needs_retriever and not WORKFLOWS.capabilities("routed").needs_retriever
    assert set(WORKFLOWS.capabilities("routed").options) == {"num_workers", "fallback", "max_chosen"}
    assert TASK_KINDS["qa"].eval_metrics and not TASK_KINDS["math"].eval_metrics
    with pytest.raises(RegistryError, match="unknown workflow 'debat'; valid: openai_agent, parallel_aggregate, parts, roles, routed"):
        WORKFLOWS.resolve("debat")
    with pytest.raises(RegistryError, match="cannot be used as a workflow: expected a dataclass subclass"):
        WORKFLOWS.resolve("srpo.methods:Method")
    with pytest.raises(RegistryError, match="has no attribute 'Nope'"):
        TASK_KINDS.resolve("srpo.tasks.kinds:Nope")
    # A reward by import path: any fn(task, text) -> float.
    from srpo import build
    from srpo.tasks.rewards import task_reward

    assert build.reward(load_config(None, ["task.reward=srpo.tasks.rewards:task_reward"])) is task_reward
    with pytest.raises(ConfigError, match="task.reward: 'f2' is not a math reward; valid: exact"):
        load_config(None, ["task.reward=f2"])


def test_every_registry_is_in_the_table_and_registered_into_one_way():
    """Each Registry of the package is defined beside its ``register_<kind>``, which is the
    registry's own ``register`` (one signature for every kind), and srpo/registry.py's table
    lists it with that module."""
    import importlib
    import pkgutil

    import srpo
    from srpo import registry as registry_module
    from srpo.registry import Registry

    homes = {}  # registry name -> the module that defines it with its register_<kind>
    for info in pkgutil.walk_packages(srpo.__path__, "srpo."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional extra (vllm, verl, ...) not installed here
            continue
        for attr, value in vars(module).items():
            if isinstance(value, Registry) and any(getattr(f, "__self__", None) is value
                                                   for k, f in vars(module).items() if k.startswith("register_")):
                homes[attr] = info.name
    assert len(homes) == 10, sorted(homes.items())
    for attr, home in homes.items():
        row = next((line for line in registry_module.__doc__.splitlines() if line.startswith(f"``{attr}``")), "")
        assert f":mod:`{home}`" in row, f"{attr} ({home}) is not in srpo/registry.py's table"


# ------------------------------------------------------------------ metrics declare their reduction

def test_metrics_combine_as_declared():
    from srpo.objective.metrics import MetricAccumulator, Metrics

    acc = MetricAccumulator()
    a, b = Metrics(), Metrics()
    a.ratio("clip", 1, 4)      # 1 of 4 units clipped
    b.ratio("clip", 3, 4)      # 3 of 4: pooled 4/8, as the mean of 0.25 and 0.75 — ...
    a.ratio("frac", 1, 1)
    b.ratio("frac", 0, 9)      # ... but 1/10 here, not the mean of fractions (0.5)
    a.sum("events", 3)
    b.sum("events", 4)
    a.min("lo", torch.tensor([2.0, 5.0]))
    b.min("lo", torch.tensor([1.0]))
    a.max("hi", torch.tensor([2.0]))
    b.max("hi", torch.tensor([], dtype=torch.float32))  # nothing recorded for an empty batch
    a.spread("sd", torch.tensor([1.0, 3.0]))
    b.spread("sd", torch.tensor([5.0]))
    a.share("k5", 3.0, "mass", 4.0)
    a.share("k1", 1.0, "mass", 4.0)
    b.share("k1", 2.0, "mass", 2.0)  # K=5 absent here: its share still divides by every call's mass
    a.per_step("loss", 0.5)
    b.per_step("loss", 0.25)
    for m in (a, b):
        acc.add(m)
    acc.end_optimizer_step()
    out = acc.result()
    assert out["clip"] == 0.5 and out["frac"] == pytest.approx(0.1) and out["events"] == 7
    assert out["lo"] == 1.0 and out["hi"] == 2.0
    assert out["sd"] == pytest.approx(torch.tensor([1.0, 3.0, 5.0]).std(unbiased=False).item())
    assert out["k5"] + out["k1"] == pytest.approx(1.0) and out["k5"] == pytest.approx(0.5)
    assert out["loss"] == pytest.approx(0.75)  # two micro-batches of one optimizer step: summed


def test_the_logged_mean_reward_is_finite_for_any_finite_rewards():
    """Rewards of ±1e308 are finite; their sum is not.  The step's mean reward is pooled as a
    convex combination of means, over episodes, micro-batches and calls."""
    from srpo.objective.metrics import MetricAccumulator, Metrics
    from srpo.train.diagnostics import episode_metrics
    from srpo.types import EpisodeResult, Task

    task = Task("t", "q", ("1",), "math")
    episodes = [EpisodeResult(f"e{i}", task, "1", r, []) for i, r in enumerate([1e308, 1e308, -1e308, 1e308])]
    out = episode_metrics(episodes, [], 0, {"tokens": 0, "correct": 0, "episodes": 0})
    assert out["reward"] == pytest.approx(0.5e308)
    a, b = Metrics(), Metrics()
    a.mean("r", [1e308, 1e308, 1e308])
    b.mean("r", torch.tensor([1e308], dtype=torch.float64))
    pooled = MetricAccumulator()
    for m in (a, b):
        pooled.add(m)
    assert pooled.result()["r"] == pytest.approx(1e308)
    small = Metrics()
    small.mean("r", [0.25, 0.5, 1.0])
    assert small["r"].item() == pytest.approx(1.75 / 3, abs=1e-15)


def test_gradient_share_by_k_splits_the_logprob_gradient():
    from srpo.objective import LossInputs, policy_loss
    from srpo.objective.metrics import gradient_share_by_k

    g = torch.Generator().manual_seed(0)
    sizes = torch.tensor([1, 3, 1, 3])
    event_index = torch.repeat_interleave(torch.arange(4), sizes)
    M, T = int(sizes.sum()), 5
    lp = torch.randn(M, T, generator=g, requires_grad=True)
    old = lp.detach() + 0.01 * torch.randn(M, T, generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    for name in ("srpo", "grpo"):
        loss, _ = policy_loss(name, LossInputs(
            logprobs=lp, old_logprobs=old, mask=torch.ones(M, T), event_index=event_index, advantages=adv))
        shares = gradient_share_by_k(loss, lp, sizes[event_index])
        (grad,) = torch.autograd.grad(loss, lp)
        mass = grad.abs().sum(1)
        k3 = mass[sizes[event_index] == 3].sum() / mass.sum()
        assert shares["by_k/grad_share/k3"].item() == pytest.approx(k3.item(), rel=1e-5)
        assert (shares["by_k/grad_share/k1"] + shares["by_k/grad_share/k3"]).item() == pytest.approx(1.0)


def test_member_level_methods_report_by_the_transition_k(tmp_path):
    """Dr. MAS splits a K=2 event into members; its by-K diagnostics still say K=2."""
    cfg = load_config(None, tiny(tmp_path, "method.name=dr_mas", "workflow.name=parallel_aggregate",
                                 "workflow.options={num_workers: 2}", "train.minibatches=2"))
    trainer = Trainer(cfg, progress=False, reward_fn=varied_reward)
    metrics = trainer.fit()[-1]
    assert "by_k/clip_frac/k2" in metrics and "by_k/grad_share/k2" in metrics
    assert metrics["by_k/grad_share/k1"] + metrics["by_k/grad_share/k2"] == pytest.approx(1.0)


def test_lora_dropout_acts_in_the_update_forward_only(tmp_path):
    """model.lora.dropout was once a no-op (models always in eval mode)."""
    from srpo.events import collate, validate_events
    from srpo.methods import assign_advantages

    def forwards(dropout):
        cfg = load_config(None, tiny(tmp_path / f"d{dropout}", "model.layout=lora", "model.lora.r=4",
                                     f"model.lora.dropout={dropout}", "workflow.name=parallel_aggregate",
                                     "workflow.options={num_workers: 2}"))
        trainer = Trainer(cfg, progress=False, reward_fn=varied_reward)
        with torch.no_grad():  # LoRA B starts at zero: give the adapters a path that dropout can cut
            for name, p in trainer.policies.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
        episodes = trainer.rollout(trainer.next_tasks())
        events = assign_advantages(validate_events([e for ep in episodes for e in ep.events])[0], "srpo")
        batch = collate(events, trainer.policies.tokenizer.pad_token_id)
        grad = [trainer.updater.logprobs(batch, grad=True).detach() for _ in range(2)]
        nograd = [trainer.updater.logprobs(batch, grad=False) for _ in range(2)]
        single_step = trainer.updater.on_policy_single_step
        trainer.close()
        return grad, nograd, single_step

    grad, nograd, single_step = forwards(0.5)
    assert not torch.equal(grad[0], grad[1])  # dropout acts in the update's forward ...
    assert torch.equal(nograd[0], nograd[1])  # ... and nowhere else (q_old, sampling)
    assert not single_step  # the update's forward is not q_old, so it is not reused as q_old
    grad, _, single_step = forwards(0.0)
    assert torch.equal(grad[0], grad[1]) and single_step


def test_config_show_lists_every_field_with_type_default_and_doc(capsys):
    """`srpo config show`: one entry per schema field (every one documented), bounds shown; with
    --config, the file's values next to the defaults."""
    from srpo.apps.cli import main
    from srpo.config import Config, describe_fields

    fields = list(describe_fields())
    assert len(fields) > 100 and all(doc for _, _, _, doc in fields)
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert "method.clip_eps_high: float | None (≥ 0) = null" in out
    assert "train.lr: float (> 0) = 1e-05" in out and 'train.parallel: str = "ddp"' in out
    config = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "math", "parallel_aggregate", "srpo.yaml")
    assert main(["config", "show", "--config", config]) == 0
    assert '(this config: "parallel_aggregate")' in capsys.readouterr().out
    assert {key for key, *_ in fields} >= {f"train.{name}" for name in Config.model_fields["train"].annotation.model_fields}


def test_the_configuration_page_is_generated_from_the_schema():
    """docs/configuration.md is what `srpo config show --markdown` prints today (`make docs` writes it)."""
    from srpo.apps.cli import config_markdown

    assert (ROOT / "docs" / "configuration.md").read_text() == config_markdown(), \
        "docs/configuration.md is stale: run `make docs` (or srpo config show --markdown > docs/configuration.md)"


#: The layers of the package, lowest first: a module may import its own package and the layers
#: below its own — never a layer above, nor another package of its own layer.  docs/architecture.md
#: draws the same table (checked below).
LAYERS = [
    ("foundations", ["srpo.registry", "srpo.config"]),
    ("run infrastructure", ["srpo.runs", "srpo.stats"]),
    ("objective", ["srpo.objective"]),
    ("events", ["srpo.events", "srpo.integrations"]),
    ("tasks", ["srpo.tasks"]),
    ("shared types", ["srpo.types"]),
    ("models, methods and data", ["srpo.policies", "srpo.methods", "srpo.data"]),
    ("engines and backends", ["srpo.rollout", "srpo.parallel"]),
    ("gateway", ["srpo.gateway"]),
    ("workflows", ["srpo.workflows"]),
    ("evaluation", ["srpo.evaluation"]),
    ("assembly", ["srpo.build"]),
    ("training", ["srpo.train"]),
    ("applications", ["srpo.apps"]),
    ("entry point", ["srpo.__main__"]),
]


def _import_graph():
    """Module → the srpo modules it imports (``from srpo.x import y`` and ``import srpo.x``)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "srpo"
    modules = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}
    deps: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("srpo"):
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("srpo")]
            else:
                continue
            deps[name] |= {t for t in targets if t in modules and t != name}
    return root, deps


def _assert_acyclic(deps: dict[str, set[str]], what: str) -> None:
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(deps[node]):
            if state.get(nxt) == 1:
                raise AssertionError(f"{what} import circle: {' -> '.join(path + [node, nxt])}")
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for name in sorted(deps):
        if name not in state:
            visit(name, [])


def _package_of(module: str) -> str:
    """``srpo.gateway.tools`` → ``srpo.gateway``; a top-level module is its own unit."""
    return ".".join(module.split(".")[:2])


def test_the_shared_types_import_no_torch():
    """srpo.types (the sampler's messages, role settings, episode results) loads without torch, so
    any layer — or a user's tool — can name them cheaply."""
    code = "import sys, srpo.types; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_config_is_a_leaf_and_there_are_no_import_circles():
    """srpo/config.py imports nothing of srpo; neither the modules nor the packages import in a
    circle; every import goes down the layers of LAYERS, which docs/architecture.md draws."""
    import ast

    root, deps = _import_graph()
    tree = ast.parse((root / "config.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("srpo")]
    # A package's __init__ re-exporting its own modules is not a cycle between modules.
    modules = {name: {d for d in ds if not (name.startswith(d + ".") or d.startswith(name + "."))}
               for name, ds in deps.items()}
    _assert_acyclic(modules, "module")
    packages: dict[str, set[str]] = {}
    for name, ds in modules.items():
        packages.setdefault(_package_of(name), set())
        packages[_package_of(name)] |= {_package_of(d) for d in ds if d != "srpo"} - {_package_of(name)}
    packages.pop("srpo", None)  # srpo/__init__.py: the version only
    _assert_acyclic(packages, "package")
    layer = {pkg: i for i, (_, pkgs) in enumerate(LAYERS) for pkg in pkgs}
    assert set(packages) == set(layer), f"packages not in LAYERS: {set(packages) ^ set(layer)}"
    upward = [f"{a} (layer {LAYERS[layer[a]][0]}) imports {b} (layer {LAYERS[layer[b]][0]})"
              for a, bs in packages.items() for b in bs if layer[b] >= layer[a]]
    assert not upward, "imports that do not go down the layers:\n" + "\n".join(sorted(upward))
    # The architecture page draws the same table.
    doc = (root.parent / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([^|]+?) \| ([^|]+?) \|", doc, re.M)
    assert [(name, sorted(p.strip("` ") for p in pkgs.split(","))) for _, name, pkgs in rows] == \
        [(name, sorted(pkgs)) for name, pkgs in LAYERS]


def test_the_objective_imports_what_its_page_says():
    """docs/objective.md: besides torch, srpo.objective imports only srpo.registry and srpo.config."""
    _, deps = _import_graph()
    outside = {d for m, ds in deps.items() if m.startswith("srpo.objective") for d in ds
               if not d.startswith("srpo.objective")}
    assert outside <= {"srpo.registry", "srpo.config"}, outside


def test_eval_at_start_logs_the_before_row_as_step_zero(tmp_path):
    cfg = load_config(None, tiny(tmp_path, "run.steps=2", "eval.every=2", "eval.at_start=true", "eval.k=1", "eval.n=2",
                                 "task.eval=[{source: synthetic_arithmetic, level: 0, n: 3, seed: 9, name: held}]",
                                 "checkpoint.every=0"))
    trainer = Trainer(cfg, progress=False, reward_fn=varied_reward)
    trainer.fit()
    trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/held/avg@1" in r] == [0, 2]
    assert rows[0]["step"] == 0 and "reward" not in rows[0]  # the evaluation alone: no training step was taken
