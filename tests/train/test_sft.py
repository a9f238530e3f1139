"""``srpo sft``: transcripts (scripted or from a file) → multi-role supervised warm start → RL from it."""

import json
from pathlib import Path

import pytest
import torch

from srpo.build import load_config
from srpo.config import ConfigError
from srpo.tasks.base import DatasetError

ROOT = Path(__file__).resolve().parents[2]
SEARCH_TEAM = ROOT / "configs" / "search" / "search_team" / "srpo.yaml"


def sft_overrides(tmp_path, *extra):
    return [f"run.output_dir={tmp_path / 'rl'}", f"sft.output_dir={tmp_path / 'sft'}", "model.name=tiny-llama",
            "model.autocast_bf16=false", "workflow.max_new_tokens=160", "task.train.n=30", "eval.every=0",
            "checkpoint.every=0", "log.backends=[]", "run.steps=1", "train.tasks_per_step=2",
            "train.group_size=2", *extra]


def test_scripted_search_team_transcripts_train_and_warm_start_rl(tmp_path, monkeypatch):
    from srpo.apps.sft import run_sft
    from srpo.train import Trainer

    cfg = load_config(SEARCH_TEAM, sft_overrides(tmp_path, "sft.script=srpo.tasks.scripts:search_team",
                                                 "sft.episodes=12", "sft.epochs=4", "sft.lr=0.003", "sft.batch_size=8"))
    model_dir = run_sft(cfg, progress=False)
    out = tmp_path / "sft"
    episodes = [json.loads(line) for line in (out / "transcripts.jsonl").read_text().splitlines()]
    assert episodes and all(e["reward"] >= 1.0 for e in episodes)  # only episodes whose answer was found
    roles = [t["role"] for t in episodes[0]["turns"]]
    assert roles[0] == "verifier" and "answerer" == roles[-1] and {"searcher_1", "searcher_2"} <= set(roles)
    first = episodes[0]["turns"]
    assert first[0]["output"] == "SEARCH" and first[1]["output"].startswith("<search>")
    assert first[-1]["output"].startswith("<answer>") and "Information:" in first[-1]["prompt"]
    summary = json.loads((out / "sft.json").read_text())
    assert summary["kept"] == len(episodes) and summary["loss_last"] < summary["loss_first"]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == summary["steps"] and losses[-1] < losses[0]
    assert (out / "checkpoints" / "latest").exists()  # written by RL training's checkpoint code
    # RL starts from the fine-tuned weights.
    rl = Trainer(load_config(SEARCH_TEAM, sft_overrides(tmp_path, f"model.init_from={model_dir}")), progress=False)
    from safetensors.torch import load_file

    saved = load_file(str(model_dir / "shared" / "model.safetensors"))
    params = dict(rl.policies.model.named_parameters())
    name = next(k for k in saved if "layers.0.self_attn.q_proj" in k)
    assert torch.equal(params[name], saved[name])
    policies_class = type(rl.policies)
    rl.close()
    # srpo eval of the warm start (the output folder or its model/): the base model with these
    # weights, in the SFT run's layout and workflow (model/ is not one HF folder: shared/, adapters…).
    from srpo.apps.cli import _sft_output_for_eval, main

    assert _sft_output_for_eval(str(out)) == out and _sft_output_for_eval(str(model_dir)) == out
    assert _sft_output_for_eval(str(model_dir / "shared")) is None and _sft_output_for_eval(str(tmp_path)) is None
    loaded = []
    original = policies_class.load_pretrained_weights

    def spy(self, folder):
        loaded.append(Path(folder))
        return original(self, folder)

    monkeypatch.setattr(policies_class, "load_pretrained_weights", spy)
    assert main(["eval", "--model", str(model_dir), "--data", "synthetic_kb:n=2:seed=777:corpus=synthetic_kb",
                 "-k", "1", "--max-new-tokens", "4", "--out", str(tmp_path / "eval")]) == 0
    assert loaded == [model_dir]
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["datasets"]["kb-s777"]["n"] == 2


@pytest.mark.parametrize("workflow, options, script, turns", [
    ("search_team", "{num_searchers: 2, max_turns: 2, top_k: 3}", "search_team",
     ["verifier", "searcher_1", "searcher_2", "verifier", "answerer"]),
    ("search", "{max_turns: 2, top_k: 3}", "search", ["searcher", "searcher"]),
])
def test_the_builtin_scripts_find_answers_in_their_workflows(tmp_path, workflow, options, script, turns):
    """Each shipped script plays its workflow as a competent team would: it searches first, then
    answers from the passages — most episodes earn reward 1 (the rest did not retrieve the answer)."""
    from srpo.policies.tiny import byte_tokenizer
    from srpo.apps.sft import scripted_transcripts
    from srpo.tasks import scripts

    cfg = load_config(ROOT / "configs" / "studies" / "search_base.yaml",
                      [f"workflow.name={workflow}", f"workflow.options={options}",
                       "workflow.max_new_tokens=200"])  # byte tokens: room for a whole query
    kept, stats = scripted_transcripts(cfg, getattr(scripts, script), 40, 1.0, byte_tokenizer(), progress=False)
    assert stats["mean_reward"] > 0.5 and len(kept) > 20, stats
    first = kept[0]["turns"]
    assert [t["role"] for t in first] == turns
    assert first[0]["output"] == "SEARCH" if workflow == "search_team" else first[0]["output"].startswith("<search>")
    assert first[-1]["output"].startswith("<answer>") and first[-1]["output"] != "<answer>unknown</answer>"


def test_sft_teaches_a_role_its_format(tmp_path):
    """A memorised format: after SFT the role's greedy answer is the transcript's output."""
    from srpo import build
    from srpo.types import SamplingParams
    from srpo.apps.sft import examples_from
    from srpo.train.supervised import SupervisedTrainer
    from srpo.workflows.runtime import render_prompt_ids

    cfg = load_config(SEARCH_TEAM, sft_overrides(tmp_path, "sft.data=unused", "sft.epochs=40", "sft.lr=0.01",
                                                 "sft.batch_size=4"))
    team = build.team(cfg)
    episodes = [{"turns": [{"role": "verifier", "input": f"Question: q{i}\n\nInformation gathered:\n(none yet)",
                            "output": "SEARCH"} for i in range(4)]}]
    examples = examples_from(episodes, team.role_specs, team.policies.tokenizer)
    assert examples[0].completion_ids[-1] == team.policies.tokenizer.eos_token_id  # it learns to stop too
    SupervisedTrainer(cfg, examples, team.policies, tmp_path / "sft", artefacts=(), progress=False).fit()
    from srpo.types import GenerationRequest

    spec = team.role_specs["verifier"]
    ids = render_prompt_ids(team.policies.tokenizer, spec, "Question: q9\n\nInformation gathered:\n(none yet)")
    (sample,) = team.policies.generate([GenerationRequest("verifier", ids, SamplingParams(temperature=0.0,
                                                                                         max_new_tokens=12))])
    assert sample.text.strip() == "SEARCH"


def test_a_stopped_fine_tuning_resumes_where_it_stopped_bit_identically(tmp_path):
    """SFT checkpoints with RL training's code: stopped after step 3 of 6 and resumed in a new
    process-like trainer, it ends with the weights of an uninterrupted run (one thread)."""
    from srpo import build
    from srpo.apps.sft import examples_from
    from srpo.train.supervised import SupervisedTrainer

    torch.set_num_threads(1)
    episodes = [{"turns": [{"role": "verifier", "input": f"Question: q{i}", "output": f"SEARCH {i % 3}"},
                           {"role": "answerer", "input": f"q{i}?", "output": f"<answer>{i}</answer>"}]}
                for i in range(6)]

    def trainer(folder):
        cfg = load_config(SEARCH_TEAM, sft_overrides(tmp_path, "sft.data=unused", "sft.epochs=3", "sft.lr=0.01",
                                                     "sft.batch_size=5", "checkpoint.every=3", "run.seed=3"))
        team = build.team(cfg)
        examples = examples_from(episodes, team.role_specs, team.policies.tokenizer)
        return SupervisedTrainer(cfg, examples, team.policies, tmp_path / folder, artefacts=(), progress=False)

    whole = trainer("whole")
    whole.fit()
    assert whole.step == 9  # 3 epochs × ceil(12 / 5)
    cut = trainer("cut")
    cut.target_steps = 3  # as if killed right after the step-3 checkpoint
    cut.fit()
    resumed = trainer("cut")
    assert resumed.resume() and resumed.step == 3
    resumed.fit()
    for a, b in zip(whole.policies.parameters("shared"), resumed.policies.parameters("shared")):
        assert torch.equal(a, b)
    rows = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 10))


def test_a_nan_fine_tuning_step_is_skipped_and_repeated_ones_stop_with_a_checkpoint(tmp_path):
    """A NaN loss leaves the weights as they were (the step is skipped, counted in metrics.jsonl);
    train.max_nonfinite_steps of them in a row stop the fine-tuning with a checkpoint."""
    from srpo import build
    from srpo.apps.sft import examples_from
    from srpo.train import TrainingStopped
    from srpo.train.supervised import SupervisedTrainer

    episodes = [{"turns": [{"role": "answerer", "input": f"q{i}?", "output": f"<answer>{i}</answer>"}]} for i in range(4)]
    cfg = load_config(SEARCH_TEAM, sft_overrides(tmp_path, "sft.data=unused", "sft.epochs=6", "sft.lr=0.01",
                                                 "sft.batch_size=2", "train.max_nonfinite_steps=2"))
    team = build.team(cfg)
    trainer = SupervisedTrainer(cfg, examples_from(episodes, team.role_specs, team.policies.tokenizer), team.policies,
                                tmp_path / "sft", artefacts=(), progress=False)
    logprobs = trainer.policies.logprobs

    def poisoned(*args, **kwargs):  # steps 2, 4, 5, ...: the model "emits" NaN log-probs
        out = logprobs(*args, **kwargs)
        return out * float("nan") if trainer.step + 1 in (2, 4, 5, 6) else out

    trainer.policies.logprobs = poisoned
    weights = {}

    def snapshot(row):
        weights[trainer.step] = [p.detach().clone() for p in trainer.policies.parameters("shared")]

    with pytest.raises(TrainingStopped, match="2 consecutive fine-tuning steps had NaN/Inf"):
        trainer.fit(on_step=snapshot)
    assert trainer.step == 5  # 1 good, 2 NaN (skipped), 3 good, 4 and 5 NaN: stopped
    for step in (2, 4, 5):  # a skipped step changed nothing
        assert all(torch.equal(a, b) for a, b in zip(weights[step], weights[step - 1]))
    assert not all(torch.equal(a, b) for a, b in zip(weights[3], weights[2]))
    assert all(bool(torch.isfinite(p).all()) for p in trainer.policies.parameters("shared"))
    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite_skipped"] for r in rows] == [0, 1, 0, 1, 1]
    assert (tmp_path / "sft" / "checkpoints" / "step_0000005").is_dir()  # saved before stopping


def test_transcript_turns_by_input_or_by_prompt_give_the_runtime_s_prompts(tmp_path):
    from srpo import build
    from srpo.apps.sft import examples_from
    from srpo.workflows.runtime import render_prompt_ids

    cfg = load_config(SEARCH_TEAM, sft_overrides(tmp_path, "sft.data=unused"))
    team = build.team(cfg, existing_policies=None)
    tok = team.policies.tokenizer
    spec = team.role_specs["searcher_1"]
    rendered = tok.decode(render_prompt_ids(tok, spec, "Question: who?"), skip_special_tokens=False)
    episodes = [{"turns": [{"role": "searcher_1", "input": "Question: who?", "output": "<search>who</search>"},
                           {"role": "searcher_1", "prompt": rendered, "output": "<search>who</search>"}]}]
    a, b = examples_from(episodes, team.role_specs, tok)
    assert a.prompt_ids == b.prompt_ids == render_prompt_ids(tok, spec, "Question: who?")
    assert a.completion_ids[-1] != tok.eos_token_id  # ends with the role's stop string: no EOS needed
    with pytest.raises(DatasetError, match="role 'judge' is not a role of this workflow"):
        examples_from([{"turns": [{"role": "judge", "input": "x", "output": "y"}]}], team.role_specs, tok)


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 1: not valid JSON"),
    ('{"turns": []}', "line 1: an episode needs a non-empty list 'turns'"),
    ('{"turns": [{"role": "verifier", "input": "x"}]}', "line 1, turn 0: a turn needs a non-empty 'output'"),
    ('{"turns": [{"role": "verifier", "output": "SEARCH"}]}', "a turn needs an 'input'"),
])
def test_bad_transcripts_name_file_line_and_turn(tmp_path, line, message):
    from srpo.apps.sft import read_transcripts

    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(DatasetError, match=message):
        read_transcripts(path)


def test_sft_config_errors_come_before_any_model_loads(tmp_path):
    from srpo.apps.cli import main

    base = ["sft", "--config", str(SEARCH_TEAM), "--set", f"sft.output_dir={tmp_path}"]
    assert main(base) == 2  # neither data nor script
    assert main(base + ["sft.script=srpo.tasks.scripts:nope"]) == 2
    assert main(base + ["sft.data=/nowhere.jsonl"]) == 2
    with pytest.raises(ConfigError, match="model.init_from: no such folder"):
        load_config(SEARCH_TEAM, sft_overrides(tmp_path, "model.init_from=/nowhere"))
