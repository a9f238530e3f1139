"""The vLLM engine's wake and sync checks, with the engine's process replaced by a stand-in that
computes what vLLM would return from its own copy of the weights (no vLLM needed): two-stage wake
around the sync, the probe after a wake and every N syncs, the run stopped when the engine did
not take the weights (issue: the paper's launches — item 10, trl#5312)."""

import copy

import pytest
import torch

from srpo.rollout import vllm
from srpo.rollout.engine import EngineOutOfSync


class StandInEngine:
    """What VLLMRollout drives: sync (copies weights), sleep/wake (recorded), and teacher-forced
    log-probs computed from the weights it holds — stale ones if a sync "dropped" them."""

    def __init__(self, model, calls, drop_syncs=False):
        self.model, self.calls, self.drop_syncs = copy.deepcopy(model), calls, drop_syncs
        self.asleep, self.woken = 0, set()

    def sync(self, model):
        self.calls.append("sync")
        if not self.drop_syncs:
            self.model.load_state_dict(model.state_dict())

    def sleep(self, level):
        self.calls.append(f"sleep{level}")
        self.asleep, self.woken = level, set()

    wake = vllm.VLLMEngine.wake

    @property
    def llm(self):
        calls = self.calls

        class LLM:
            def wake_up(self, tags):
                calls.append("wake:" + "+".join(tags))
        return LLM()

    def generate(self, prompts, params, generator=None, adapters=None):
        """A fixed "sample" (the prompt's first tokens, reversed) with its log-probs under the
        weights this engine holds — stale ones if a sync was dropped."""
        from srpo.policies.logprobs import completion_logprobs
        from srpo.types import Sample

        out = []
        with torch.no_grad():
            for prompt, p in zip(prompts, params):
                completion = list(reversed(prompt[:p.max_new_tokens]))
                ids = torch.tensor([list(prompt) + completion])
                lp = completion_logprobs(self.model, ids, torch.ones_like(ids), len(prompt),
                                         action_mask=torch.ones(1, len(completion)))[0]
                out.append(Sample(completion_ids=completion, text="", logprobs=lp.tolist(), finish_reason="length"))
        return out


def rollout(policies, drop_syncs=False, check_every=10, sleep_mode=False):
    calls = []
    r = vllm.VLLMRollout.__new__(vllm.VLLMRollout)
    r.policies, r.sleep_mode, r.syncs, r.sync_metrics = policies, sleep_mode, 0, {}
    r.settings = vllm.EngineSettings(check_every=check_every, max_sync_gap=0.1, sleep_mode=sleep_mode)
    r.engines = {"shared": StandInEngine(policies.model_for("shared"), calls, drop_syncs)}
    return r, calls


@pytest.fixture
def policies():
    from srpo.policies.layouts import build_policies

    torch.manual_seed(0)
    return build_policies("shared", "tiny-llama", ["a"])


def nudge(policies, scale=0.5):
    with torch.no_grad():
        for p in policies.parameters("shared"):
            p.add_(scale * torch.randn_like(p))


def test_a_faithful_engine_passes_its_probe_and_logs_the_gap(policies):
    r, calls = rollout(policies)
    r.update_weights()
    assert calls == ["sync"]
    assert r.sync_metrics["rollout/sync_gap"] < 1e-5 and r.sync_metrics["rollout/sync_gap_max"] < 1e-4
    nudge(policies)
    r.update_weights()  # sync 2: not a probe sync (every 10), no wake
    assert r.sync_metrics == {}


def test_an_engine_that_dropped_its_weights_stops_the_run_naming_the_sync(policies):
    r, _ = rollout(policies, drop_syncs=True, check_every=2)
    r.update_weights()  # sync 1: the stand-in already holds these weights
    nudge(policies)
    r.update_weights()  # sync 2 is not probed (every 2: syncs 1, 3, 5 ...)
    nudge(policies)
    with pytest.raises(EngineOutOfSync, match=r"after sync 3 the engine's log-probs of its samples of 3 probe prompts differ"):
        r.update_weights()
    assert r.sync_metrics["rollout/sync_gap"] > 0.1


def test_the_engine_wakes_in_two_stages_around_the_sync_and_is_probed_after_a_wake(policies, monkeypatch):
    freed = []
    monkeypatch.setattr(vllm, "release_cached_gpu_memory", lambda: freed.append(True))
    r, calls = rollout(policies, check_every=0, sleep_mode=True)
    r.release()
    nudge(policies)
    r.update_weights()
    assert calls == ["sleep2", "wake:weights", "sync", "wake:kv_cache"]
    assert freed == [True], "the cache is emptied before the engine wakes"
    assert "rollout/sync_gap" in r.sync_metrics, "probed after every wake, even with check_every 0"
    r.update_weights()  # awake: no wake, no probe
    assert calls[-1] == "sync" and r.sync_metrics == {}


def test_sleep_mode_refuses_expandable_segments():
    from srpo.config import ConfigError

    vllm.refuse_expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"})
    with pytest.raises(ConfigError, match="expandable_segments"):
        vllm.refuse_expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    with pytest.raises(ConfigError, match="PYTORCH_ALLOC_CONF"):
        vllm.refuse_expandable_segments({"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6, expandable_segments: true"})


def test_the_trainer_saves_and_stops_when_the_engine_is_out_of_sync(tmp_path, monkeypatch):
    """The step completes and is logged, the trainer's (sound) weights are checkpointed, and the run
    stops with the engine's message — before any rollout from the bad engine."""
    from srpo import build
    from srpo.runs.metrics_log import read_metrics
    from srpo.rollout.builtin import BuiltinEngine
    from srpo.train import Trainer, TrainingStopped
    from helpers.runs import tiny, varied_reward

    class Drifting(BuiltinEngine):
        syncs = 0

        def update_weights(self):
            self.syncs += 1
            self.sync_metrics = {"rollout/sync_gap": 0.01 if self.syncs < 2 else 0.3}
            if self.syncs >= 2:
                raise EngineOutOfSync("rollout: after sync 2 the engine's log-probs ... differ")

    monkeypatch.setattr(build, "engine", lambda cfg, policies: Drifting(policies))
    trainer = Trainer(build.load_config(None, tiny(tmp_path, ["run.steps=4", "checkpoint.every=0"])), progress=False,
                      reward_fn=varied_reward)
    try:
        with pytest.raises(TrainingStopped, match="after sync 2.*after step 2; the trainer's weights are in"):
            trainer.fit()
    finally:
        trainer.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and [r["rollout/sync_gap"] for r in rows] == [0.01, 0.3]
    assert (tmp_path / "checkpoints" / "step_0000002").is_dir()
