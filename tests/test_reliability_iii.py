"""Reliability III: the run folder is srpo's alone to delete, changed data is caught, preemption
and dead services cost nothing, user code and the retrieval server fail clearly."""

import json
import os
from pathlib import Path

import pytest

from srpo.run_dir import RunDirError
from test_reliability_runs import steps_logged, tiny, trained  # noqa: F401  (shared helpers)
from srpo.build import load_config
from srpo.train import Trainer


def attempt(run_dir, extra=(), overwrite=False):
    """A training run that may be refused; its folder is released however it ends."""
    from test_reliability_runs import varied_reward

    trainer = Trainer(load_config(None, tiny(run_dir, extra)), progress=False, reward_fn=varied_reward,
                      overwrite=overwrite)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer


# ------------------------------------------------------- 1. srpo deletes and overwrites only what it wrote

def test_overwrite_deletes_only_what_srpo_recorded_writing(tmp_path):
    home = tmp_path / "home"  # a folder full of the user's things, given as the run folder
    home.mkdir()
    (home / "wandb").mkdir()
    (home / "wandb" / "my-run.txt").write_text("the user's own W&B files")
    (home / "notes.txt").write_text("mine")
    trainer = trained(home, ["run.steps=2"])  # no W&B in this run: its wandb/ is not in the way
    assert trainer.step == 2
    owned = set(json.loads((home / ".srpo-owned.json").read_text())["created"])
    assert {"metrics.jsonl", "checkpoints", "samples.jsonl"} <= owned and "wandb" not in owned
    trained(home, ["run.steps=1"], overwrite=True)
    assert (home / "wandb" / "my-run.txt").read_text() == "the user's own W&B files"
    assert (home / "notes.txt").read_text() == "mine" and steps_logged(home) == [1]


def test_a_users_own_checkpoints_are_never_written_into_or_deleted(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "model.pt").write_text("the user's weights")
    for overwrite in (False, True):
        with pytest.raises(RunDirError, match="checkpoints/, which srpo did not write"):
            attempt(run, overwrite=overwrite)
    assert (run / "checkpoints" / "model.pt").read_text() == "the user's weights"


@pytest.mark.parametrize("name", ["metrics.jsonl", ".lock", "checkpoints"])
def test_a_planted_link_refuses_the_run_and_its_target_is_untouched(tmp_path, name):
    target = tmp_path / "precious"
    if name == "checkpoints":
        target.mkdir()
        (target / "keep.txt").write_text("precious")
    else:
        target.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(target, run / name)
    for overwrite in (False, True):
        with pytest.raises(RunDirError, match="symbolic link srpo did not make"):
            attempt(run, overwrite=overwrite)
    assert (target / "keep.txt" if name == "checkpoints" else target).read_text() == "precious"


def test_sft_claims_its_output_folder_as_train_does(tmp_path):
    from srpo.build import config_from_dict
    from srpo.sft import run_sft

    out = tmp_path / "sft"
    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps({"turns": [{"role": "solver", "input": "What is 1 + 1?", "output": "2"}]}) + "\n")

    def cfg():
        return config_from_dict({"model": {"name": "tiny-llama"}, "workflow": {"name": "single"},
                                 "task": {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 0, "n": 4}},
                                 "sft": {"data": str(data), "output_dir": str(out), "epochs": 1}})

    (out / "model").mkdir(parents=True)
    (out / "model" / "mine.bin").write_text("the user's")
    with pytest.raises(RunDirError, match="model/, which srpo did not write"):
        run_sft(cfg(), progress=False, overwrite=True)
    (out / "model" / "mine.bin").unlink()
    (out / "model").rmdir()
    run_sft(cfg(), progress=False)
    with pytest.raises(RunDirError, match="holds a previous run"):
        run_sft(cfg(), progress=False)
    (out / "notes.txt").write_text("mine")
    run_sft(cfg(), progress=False, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "model").is_dir()


# ------------------------------------------------------------ 7. SFT turns longer than the context

def test_a_runaway_sft_turn_is_skipped_or_cut_and_counted_never_trained_whole(tmp_path):
    from srpo.build import config_from_dict
    from srpo.sft import run_sft

    data = tmp_path / "t.jsonl"
    turns = [{"role": "solver", "input": "What is 1 + 1?", "output": "2"},
             {"role": "solver", "input": "Tell me everything.", "output": "x" * 10_000_000}]  # a 10 MB answer
    data.write_text(json.dumps({"turns": turns}) + "\n")
    for mode, key in (("skip", "long_turns_skipped"), ("truncate", "long_turns_truncated")):
        out = tmp_path / mode
        cfg = config_from_dict({"model": {"name": "tiny-llama"}, "workflow": {"name": "single"},
                                "task": {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 0, "n": 4}},
                                "sft": {"data": str(data), "output_dir": str(out), "epochs": 1, "long_turns": mode}})
        run_sft(cfg, progress=False)
        summary = json.loads((out / "sft.json").read_text())
        assert summary[key] == 1 and summary["examples"] == (1 if mode == "skip" else 2)


def test_bad_prompt_ids_are_named_with_file_and_line(tmp_path):
    from srpo.build import config_from_dict
    from srpo.sft import run_sft
    from srpo.tasks import DatasetError

    data = tmp_path / "t.jsonl"
    good = {"turns": [{"role": "solver", "input": "q", "output": "a"}]}
    for bad, match in ((["7", 8], "must be a non-empty list of token ids"), ([1, 10 ** 9], "outside this model's vocabulary")):
        data.write_text(json.dumps(good) + "\n" + json.dumps({"turns": [{"role": "solver", "prompt_ids": bad,
                                                                         "output": "a"}]}) + "\n")
        cfg = config_from_dict({"model": {"name": "tiny-llama"}, "workflow": {"name": "single"},
                                "task": {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 0, "n": 4}},
                                "sft": {"data": str(data), "output_dir": str(tmp_path / "o"), "epochs": 1}})
        with pytest.raises(DatasetError, match=f"t.jsonl, line 2.*{match}"):
            run_sft(cfg, progress=False, overwrite=True)
