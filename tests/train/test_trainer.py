"""The trainer on tiny models: every example config, resume, config errors."""

import glob
import json
from pathlib import Path

import pytest
import torch

from srpo.build import load_config
from srpo.config import ConfigError
from srpo.train import Trainer

ROOT = Path(__file__).resolve().parents[2]
# Run configs only (configs/<task>/<workflow>/*.yaml); study declarations live under configs/studies/.
CONFIGS = sorted(c for c in glob.glob(str(ROOT / "configs" / "*" / "*" / "*.yaml")) if "/studies/" not in c)


def varied_reward(task, answer):
    """A reward that differs across episodes of one task (tiny random models are never right)."""
    return float(sum(map(ord, answer or "")) % 5) / 4.0


def tiny_overrides(tmp_path, extra=()):
    return [f"run.output_dir={tmp_path}", "run.steps=2", "model.name=tiny-llama", "model.autocast_bf16=false",
            "workflow.max_new_tokens=6", "train.tasks_per_step=2", "train.group_size=2", "train.lr=0.01",
            "task.train.n=8", "task.eval=[]", "eval.every=0", "checkpoint.every=0", "log.backends=[]", *extra]


def snapshot(trainer):
    return {pid: [p.detach().clone() for p in trainer.policies.parameters(pid)] for pid in trainer.policies.policy_ids}


def moved(before, trainer):
    return {pid for pid, ps in before.items()
            if any(not torch.equal(a, b) for a, b in zip(ps, trainer.policies.parameters(pid)))}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: "/".join(Path(p).parts[-3:]))
def test_two_steps_of_every_example_config(path, tmp_path):
    cfg = load_config(path, tiny_overrides(tmp_path))
    trainer = Trainer(cfg, progress=False, reward_fn=varied_reward)
    before = snapshot(trainer)
    history = trainer.fit()
    assert len(history) == 2 and trainer.step == 2
    assert moved(before, trainer) == set(trainer.policies.policy_ids)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward", "loss", "objective/clip_frac", "grad_norm/total", "active_set_size/mean",
                "team_tokens", "time/rollout_s", "events/invalid"):
        assert key in rows[-1], key
    assert (tmp_path / "checkpoints" / "latest").is_file()


@pytest.mark.parametrize("workflow, options", [("parallel_aggregate", "{num_workers: 3}"), ("routed", "{num_workers: 2}")])
def test_lora_layout_steps_each_roles_adapter(workflow, options, tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path, [f"workflow.name={workflow}", f"workflow.options={options}",
                                                      "model.layout=lora", "model.lora.r=4", "train.lr=0.05"]))
    trainer = Trainer(cfg, progress=False, reward_fn=varied_reward)
    before = snapshot(trainer)
    trainer.fit()
    assert moved(before, trainer) == set(trainer.policies.policy_ids)
    assert all(v == 2 for v in trainer.policies.versions.values())


def final_params(trainer):
    return {pid: [p.detach().clone() for p in trainer.policies.parameters(pid)] for pid in trainer.policies.policy_ids}


@pytest.mark.parametrize("layout", ["shared", "lora"])
def test_resume_reaches_the_same_parameters(layout, tmp_path, deterministic_threads):
    common = ["workflow.name=parallel_aggregate", "workflow.options={num_workers: 2}", f"model.layout={layout}",
              "model.lora.r=4", "checkpoint.every=1", "run.steps=4", "train.minibatches=2"]
    straight = Trainer(load_config(None, tiny_overrides(tmp_path / "a", common)), progress=False,
                       reward_fn=varied_reward)
    straight.fit()
    first = Trainer(load_config(None, tiny_overrides(tmp_path / "b", common)), progress=False, reward_fn=varied_reward)
    first.fit(steps=2)
    del first
    resumed = Trainer(load_config(None, tiny_overrides(tmp_path / "b", common)), progress=False,
                      reward_fn=varied_reward)
    assert resumed.resume() and resumed.step == 2
    resumed.fit()
    a, b = final_params(straight), final_params(resumed)
    for pid in a:
        for x, y in zip(a[pid], b[pid]):
            assert torch.equal(x, y)
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_resume_refuses_an_incompatible_config(tmp_path):
    from srpo.runs.checkpoint import CheckpointError

    Trainer(load_config(None, tiny_overrides(tmp_path)), progress=False, reward_fn=varied_reward).fit()
    other = Trainer(load_config(None, tiny_overrides(tmp_path, ["method.name=grpo"])), progress=False)
    with pytest.raises(CheckpointError, match="method.name: checkpoint 'srpo' vs now 'grpo'"):
        other.resume()


@pytest.mark.parametrize("overrides, message", [
    (["train.group_size=1"], "train.group_size: a group-relative method needs G ≥ 2"),
    (["method.name=ppo"], "method.name: unknown method 'ppo'; valid: at_grpo, dr_mas, grpo, gspo, srpo"),
    (["train.bogus=3"], "train.bogus: unknown key; valid keys: tasks_per_step"),
    (["train.lr=fast"], "train.lr: expected a number, got 'fast'"),
    (["workflow.options={num_workers: 0}", "workflow.name=parallel_aggregate"],
     "workflow.options.num_workers: Input should be greater than or equal to 1"),
    (["workflow.name=routed", "workflow.options={num_workers: 2}", "workflow.roles={worker_5: {temperature: 0.5}}"],
     "workflow.roles.worker_5: no such role in routed"),
    (["workflow.name=search"], "task.corpus: the search workflow needs a corpus"),
    (["task.train.source=/nowhere/data.jsonl"], "task.train.source: no such file"),
    (["task.kind=qa"], "synthetic_arithmetic is a math source but task.kind is 'qa'"),
    (["model.layout=mixed"], "model.layout: 'mixed' is not valid; valid: shared, lora, separate"),
    (["method.set_reduction=max"], "method.set_reduction: 'max' is not valid; valid: sqrt, sum, mean"),
])
def test_config_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(top)
    with pytest.raises(ConfigError, match="no config file"):
        load_config(tmp_path / "missing.yaml")


def test_reusing_the_update_forward_as_q_old_equals_a_recompute_pass(tmp_path, deterministic_threads):
    """With one optimizer step per rollout, q_old = the model the update runs: the trainer reuses
    that forward instead of a separate no-grad pass; the parameters must come out identical."""
    from srpo.events import validate_events
    from srpo.methods import assign_advantages

    results = []
    for reuse in (True, False):
        cfg = load_config(None, tiny_overrides(tmp_path / str(reuse), ["workflow.name=parallel_aggregate",
                                                                       "workflow.options={num_workers: 2}"]))
        trainer = Trainer(cfg, progress=False, reward_fn=varied_reward)
        trainer.updater.reuse_forward_as_old = reuse
        trainer.rollout_generator.manual_seed(7)
        episodes = trainer.rollout(trainer.train_tasks[:2])
        events = assign_advantages(validate_events([e for ep in episodes for e in ep.events])[0], "srpo")
        if not reuse:
            trainer.recompute_old_logprobs(events)
        metrics = trainer.update(events)
        assert metrics["grad_norm/total"] > 0
        results.append([p.detach().clone() for p in trainer.policies.parameters("shared")])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_paper_scale_configs_parse():
    """The GPU/hub configs cannot run here, but their keys and types must be valid."""
    from srpo.config import Config, parse_section, read_yaml

    files = [f for f in glob.glob(str(ROOT / "configs" / "paper" / "*.yaml")) if "study" not in f]
    assert len(files) == 4
    for f in files:
        cfg = parse_section(Config, read_yaml(f))
        assert cfg.run.device == "cuda" and cfg.eval.k == 16


@pytest.mark.parametrize("loss, schedule", [("srpo", []), ("grpo", []), ("gspo", []),
                                            ("srpo", ["train.epochs=2", "train.minibatches=2"])])
def test_skipping_zero_advantage_events_leaves_the_update_unchanged(loss, schedule, tmp_path, deterministic_threads):
    """Events with advantage exactly 0 are not forwarded, yet every parameter moves as if they were."""
    from srpo.events import validate_events
    from srpo.methods import assign_advantages

    results, counts = [], []
    for skip in (True, False):
        cfg = load_config(None, tiny_overrides(tmp_path / str(skip), [
            "workflow.name=parallel_aggregate", "workflow.options={num_workers: 2}", "train.optimizer=sgd",
            f"method.name={loss}", f"train.skip_zero_advantage={str(skip).lower()}", *schedule]))
        trainer = Trainer(cfg, progress=False, reward_fn=varied_reward)
        trainer.rollout_generator.manual_seed(7)
        episodes = trainer.rollout(trainer.train_tasks[:2])
        events = assign_advantages(validate_events([e for ep in episodes for e in ep.events])[0], loss)
        for e in events:  # the first task's group learned nothing this step (say, all wrong)
            if e.task_id == events[0].task_id:
                e.advantage = 0.0
        assert any(e.advantage for e in events)
        trainer.recompute_old_logprobs(events)
        metrics = trainer.update(events)
        counts.append(metrics["update/zero_advantage_skipped"])
        results.append([p.detach().clone() for p in trainer.policies.parameters("shared")])
    assert counts == [sum(e.task_id == events[0].task_id for e in events), 0]
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_zero_advantage_events_are_forwarded_under_a_kl_penalty(tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path, ["method.kl_coef=0.1"]))
    trainer = Trainer(cfg, progress=False, reward_fn=lambda task, answer: 0.0)  # every advantage is 0
    history = trainer.fit(steps=1)
    assert history[0]["update/zero_advantage_skipped"] == 0
    cfg = load_config(None, tiny_overrides(tmp_path / "nokl"))
    history = Trainer(cfg, progress=False, reward_fn=lambda task, answer: 0.0).fit(steps=1)
    assert history[0]["update/zero_advantage_skipped"] == 4  # 2 tasks × 2 episodes, one event each


def test_mismatch_is_logged_per_role_and_tis_is_neutral_on_srpo_s_own_sampler(tmp_path):
    """srpo's sampler and its trainer agree to rounding, so the truncated-IS weights are ~1."""
    cfg = load_config(ROOT / "configs/math/parallel_aggregate/srpo.yaml", tiny_overrides(tmp_path, [
        "workflow.options={num_workers: 2}", "train.minibatches=2", "train.tis_cap=2.0",
        "train.skip_zero_advantage=false"]))
    trainer = Trainer(cfg, progress=False, reward_fn=varied_reward)
    history = trainer.fit()
    trainer.close()
    for h in history:
        assert h["mismatch/mean_abs"] < 1e-4 and h["mismatch/frac_above_0.1"] == 0.0
        assert {"role/aggregator/mismatch_mean_abs", "role/worker_1/mismatch_mean_abs"} <= set(h)
        assert h["objective/tis/weight_mean"] == pytest.approx(1.0, abs=1e-3)


def test_tis_needs_recomputed_old_logprobs():
    with pytest.raises(ConfigError, match="train.tis_cap"):
        load_config(None, ["train.tis_cap=2", "train.old_logprobs=behaviour"])
    with pytest.raises(ConfigError, match="train.tis_cap"):
        load_config(None, ["train.tis_cap=0.5"])


@pytest.mark.parametrize("parallel, layout", [("ddp", "shared"), ("fsdp", "shared"), ("ddp", "lora")])
def test_activation_checkpointing_trains_to_the_same_weights(tmp_path, parallel, layout):
    """Also with LoRA, where each policy's pass runs under its own adapter and the backward of all
    of them comes later: a layer recomputed then runs under the adapter of its forward."""
    runs = {}
    for ckpt in (False, True):
        cfg = load_config(ROOT / "configs/math/parallel_aggregate/srpo.yaml", tiny_overrides(tmp_path / f"{ckpt}", [
            "workflow.options={num_workers: 2}", "train.minibatches=2", f"train.parallel={parallel}",
            f"model.layout={layout}", f"train.activation_checkpointing={str(ckpt).lower()}",
            "train.skip_zero_advantage=false"]))
        trainer = Trainer(cfg, progress=False, reward_fn=varied_reward)
        history = trainer.fit()
        if layout == "lora":
            runs[ckpt] = (history, {n: t.detach().clone() for pid in trainer.policies.policy_ids
                                    for n, t in trainer.policies.adapter_state(pid).items()})
        elif trainer.backend.capabilities.shards_parameters:
            runs[ckpt] = (history, trainer.backend.full_state_dicts(trainer.policies)["shared"])
        else:
            runs[ckpt] = (history, {k: v.detach().clone() for k, v in trainer.policies.model_for("shared").state_dict().items()})
        trainer.close()
    (h0, w0), (h1, w1) = runs[False], runs[True]
    assert [h["loss"] for h in h0] == [h["loss"] for h in h1]
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_a_run_s_parts_split_into_tensors_and_json_and_join_back():
    from srpo.train.parts import join_state, split_state

    class Part:
        def __init__(self, state):
            self.state = state

        def state_dict(self):
            return self.state

    t = torch.arange(3)
    tensors, plain = split_state({"p": Part({"a": t, "b": 1, "c": {"x": [t]}}), "q": Part({"n": "x"})})
    assert set(tensors) == {"p"} and set(tensors["p"]) == {"a", "c"}
    assert plain == {"p": {"b": 1}, "q": {"n": "x"}}
    joined = join_state(tensors, json.loads(json.dumps(plain)))
    assert joined["q"] == {"n": "x"} and joined["p"]["b"] == 1 and joined["p"]["a"] is t
