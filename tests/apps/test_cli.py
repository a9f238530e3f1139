"""The command line: train, eval, report and models on tiny models."""

import json

import pytest

from srpo.apps.cli import main


def test_train_eval_report_roundtrip(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", "--config", "configs/math/parallel_aggregate/srpo.yaml",
                 "--set", f"run.output_dir={run}", "--set", "run.steps=2", "--set", "model.name=tiny-llama",
                 "--set", "model.autocast_bf16=false", "--set", "workflow.max_new_tokens=6",
                 "--set", "train.group_size=2", "--set", "log.backends=[]", "--set", "task.train.n=4",
                 # A tiny random model earns reward 0 everywhere: every advantage is 0, and skipped
                 # events would leave no ratio/clip diagnostics for the report to plot.
                 "--set", "train.skip_zero_advantage=false"])
    assert code == 0
    out = capsys.readouterr().out
    assert "memory: this run needs at least" in out.split("memory: peak")[0]  # said before the steps, then the peak
    assert (run / "checkpoints" / "latest").is_file()
    code = main(["eval", "--model", str(run / "checkpoints"), "--workflow", "parallel_aggregate",
                 "--options", '{"num_workers": 2}', "--data", "synthetic_arithmetic:level=1:n=3:seed=5",
                 "-k", "2", "--max-new-tokens", "4", "--out", str(tmp_path / "eval")])
    assert code == 0
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    ds = result["datasets"]["arith-L1-s5"]
    assert ds["n"] == 3 and 0 <= ds["avg@2"] <= ds["pass@2"] <= 1
    assert "| **macro** |" in (tmp_path / "eval" / "eval.md").read_text()
    # Without --workflow a checkpoint runs in the workflow (and options) it was trained in.
    assert main(["eval", "--model", str(run), "--data", "synthetic_arithmetic:level=1:n=2:seed=5", "-k", "1",
                 "--max-new-tokens", "4", "--out", str(tmp_path / "eval2")]) == 0
    assert "parallel_aggregate" in (tmp_path / "eval2" / "eval.md").read_text().splitlines()[0]
    assert main(["report", str(run)]) == 0
    report = (run / "report.md").read_text()
    assert "![reward_accuracy](report/reward_accuracy.png)" in report
    assert (run / "report" / "reward_accuracy.png").stat().st_size > 1000
    # One optimizer step a rollout: every ratio is 1, so the clip-fraction panel is flat - left out, and said.
    assert not (run / "report" / "clip_fraction_by_set_size.png").exists()
    flat = next(line for line in report.splitlines() if line.startswith("Not drawn, flat over the whole run:"))
    assert "Ratio-clip fraction by set size K" in flat and "Every ratio stayed at 1" in report


def test_eval_of_a_registered_model_on_a_file(tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "What is 2 + 2?", "answer": "#### 4"}\n')
    assert main(["eval", "--model", "tiny-qwen2", "--data", str(data), "-k", "2", "--max-new-tokens", "3"]) == 0


def test_config_error_exits_2_with_the_message(tmp_path, capsys):
    code = main(["train", "--config", "configs/math/single/srpo.yaml", "--set", "train.group_size=1"])
    assert code == 2
    assert "train.group_size" in capsys.readouterr().err


def test_models_list(capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "tiny-llama" in out


def test_ctrl_c_before_the_command_runs_prints_one_line_and_no_traceback(monkeypatch, capsys):
    """A Ctrl-C that lands while srpo is still importing or parsing (before ``main`` can catch it)
    ends with "interrupted" and 130, like one during the command."""
    import signal

    from srpo.apps import cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "main", interrupted)
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as done:
            cli.entry()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert done.value.code == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_version_names_the_release_and_the_commit(capsys):
    from pathlib import Path

    import srpo

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"srpo {srpo.__version__}")
    assert "(commit " in line or not (Path(srpo.__file__).resolve().parents[1] / ".git").exists()


def test_a_study_file_given_to_train_or_config_show_names_srpo_study(capsys):
    for command in (["config", "show", "--config", "studies/o_set_clip/tuning.yaml"],
                    ["train", "--config", "configs/studies/parts_team.yaml"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "is a study file, not a run config: run it with srpo study --config" in err


def test_study_list_prints_the_cells_without_running_them(capsys):
    assert main(["study", "--config", "studies/n_reread/tuning.yaml", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("studies/n_reread/tuning.yaml: 30 cells, 6 labels")
    assert len(out) == 7 and "srpo-lr5e-5: seeds 100, 101, 102, 103, 104" in out[1]


def test_paper_configs_inspect_on_a_machine_without_their_engine(capsys):
    from pathlib import Path

    """`srpo config show` validates a paper config here (no vLLM, no GPU): the engine's package
    check is skipped, by name, not failed."""
    import importlib.util
    import glob

    for path in sorted(glob.glob("configs/paper/*.yaml")):
        if "study" in Path(path).name:
            continue
        assert main(["config", "show", "--config", path]) == 0, path
        err = capsys.readouterr().err
        if importlib.util.find_spec("vllm") is None:
            assert "skipped here, checked when it runs: rollout.engine: vllm needs vllm" in err
