"""``make gpu-bench``'s plumbing on a CPU with tiny shapes: the model folder both trainers load,
the measured fields and the MFU arithmetic."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_bench  # noqa: E402


def test_the_synthetic_tokenizer_covers_the_models_vocabulary_and_every_id_decodes():
    tok = gpu_bench.synthetic_tokenizer(70_000)  # past the 65,536 two-byte strings: three-byte ones too
    assert len(tok) == 70_000
    assert tok.decode(tok.encode("What is 12 + 7?")) == "What is 12 + 7?"
    assert all(isinstance(tok.decode([i]), str) for i in (0, 300, 65_000, 69_996))
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                              add_generation_prompt=True)


def test_mfu_counts_two_n_per_generated_and_six_n_per_trained_token():
    run = {"step_s": [9.0, 2.0, 2.0], "generation_s": [5.0, 1.5, 1.5], "update_s": [4.0, 0.5, 0.5],
           "completion_tokens": [100, 100, 100], "peak_gpu_gib": 3.0}
    s = gpu_bench.summarise(run, parameters=10**9, peak_tflops=1.0)  # the first step is a warm-up
    assert s["step_s"] == 2.0 and s["generation_tokens_per_s"] == 100 / 1.5 and s["update_tokens_per_s"] == 200
    assert abs(s["mfu"] - 8 * 10**9 * 100 / 2.0 / 1e12) < 1e-12


def test_the_cpu_form_measures_srpos_step_and_writes_its_table(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_bench.py"), "--device", "cpu", "--models", "tiny",
                           "--sides", "srpo", "--steps", "2", "--prompts", "2", "--group", "2", "--max-new", "4",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    run, summary = result["run"], result["summary"]
    assert len(run["step_s"]) == 2 and run["completion_tokens"] == [2 * 2 * 4] * 2  # random weights: full length
    assert summary["generation_s"] > 0 and summary["update_s"] > 0 and summary["mfu"] is None  # no GPU: no peak
    assert "| tiny | srpo |" in done.stdout
    assert gpu_bench.side_missing("srpo") is None
