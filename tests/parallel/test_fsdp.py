"""FSDP2 (train.parallel: fsdp) on CPU: the same update as one process, checkpoints that reshard,
a two-node launch on 127.0.0.1."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.fsdp_worker import resume_overrides
from helpers import HELPERS
from helpers.runs import free_port

ROOT = Path(__file__).resolve().parents[2]
WORKER = HELPERS / "fsdp_worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
TORCHRUN = Path(sys.executable).with_name("torchrun")

pytestmark = [pytest.mark.slow, pytest.mark.torchrun,
              pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")]




def torchrun(n: int, *args, **kw):
    return subprocess.run([str(TORCHRUN), "--nproc_per_node", str(n), "--master_port", str(free_port()), *args],
                          env=ENV, capture_output=True, text=True, timeout=600, **kw)


def check(done):
    if done.returncode != 0:  # the whole of it, in the report's captured output (an assert message is cut)
        print(f"exit {done.returncode}\n--- stdout\n{done.stdout[-5000:]}\n--- stderr\n{done.stderr[-20000:]}")
    assert done.returncode == 0, (done.stdout[-1500:], done.stderr[-3000:])
    return done


@pytest.mark.parametrize("passes", [(), ("train.length_groups=3", "train.fsdp_share_prompts=true")],
                         ids=["default-groups", "3-groups-shared-prompts"])
def test_two_fsdp_processes_update_like_one_plain_process(tmp_path, passes):
    """FSDP's passes make a fixed number of backbone calls (length groups each rank cuts from its
    own rows, a prompt pass when prompts are shared): one and two FSDP processes make the update
    of one plain process, up to rounding."""
    plain, one, two = tmp_path / "plain.pt", tmp_path / "fsdp1.pt", tmp_path / "fsdp2.pt"
    check(subprocess.run([sys.executable, str(WORKER), "update", str(plain), str(tmp_path / "r0"), "ddp"], env=ENV,
                         capture_output=True, text=True, timeout=600))
    if not passes:
        check(subprocess.run([sys.executable, str(WORKER), "update", str(one), str(tmp_path / "r1"), "fsdp"], env=ENV,
                             capture_output=True, text=True, timeout=600))
    check(torchrun(2, str(WORKER), "update", str(two), str(tmp_path / "r2"), "fsdp", *passes))
    a, c = torch.load(plain), torch.load(two)
    from srpo.policies import load_model

    initial = load_model("tiny-llama")[0].state_dict()
    assert any(not torch.equal(a[k], initial[k]) for k in a), "the update must change the parameters"
    assert a.keys() == c.keys()
    for k in a:
        assert torch.allclose(a[k], c[k], atol=1e-6, rtol=1e-5), k  # two: sums in another order
    if not passes:
        b = torch.load(one)
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6, rtol=1e-5) for k in a)


def test_fsdp_with_a_policy_per_role_and_ranks_holding_different_policies(tmp_path):
    """separate layout under FSDP, rank 0 holding only the solver's events and rank 1 only the
    verifier's: each rank's idle pass for the policy it lacks must come in the same order as the
    other rank's real pass (idle passes first would pair one policy's all-gathers with the other's
    — mixed weights or a hang).  Same update as one plain process on every event."""
    plain, two = tmp_path / "plain.pt", tmp_path / "fsdp2.pt"
    check(subprocess.run([sys.executable, str(WORKER), "update_by_policy", str(plain), str(tmp_path / "r0"), "ddp"],
                         env=ENV, capture_output=True, text=True, timeout=600))
    check(torchrun(2, str(WORKER), "update_by_policy", str(two), str(tmp_path / "r2"), "fsdp"))
    a, c = torch.load(plain), torch.load(two)
    assert sorted(a) == sorted(c) == ["solver", "verifier"]
    from srpo.policies import load_model

    initial = load_model("tiny-llama")[0].state_dict()
    for pid in a:
        assert any(not torch.equal(a[pid][k], initial[k]) for k in a[pid]), f"{pid} must be updated"
        for k in a[pid]:
            assert torch.allclose(a[pid][k], c[pid][k], atol=1e-6, rtol=1e-5), (pid, k)


@pytest.mark.parametrize("kl", [False, True], ids=["no-kl", "kl-reference-adapters-off"])
def test_fsdp_with_lora_adapters_updates_like_one_plain_process(tmp_path, kl):
    """model.layout: lora under FSDP (the frozen base and every role's adapter sharded in one PEFT
    model, each policy's pass through the shared root with its adapter active): two ranks make the
    same update as one plain process — with a KL term too, whose reference (the base, adapters off)
    is a collective pass of the same root."""
    extra = ["model.layout=lora", *(["method.kl_coef=0.5"] if kl else [])]
    plain, two = tmp_path / "plain.pt", tmp_path / "fsdp2.pt"
    check(subprocess.run([sys.executable, str(WORKER), "update", str(plain), str(tmp_path / "r0"), "ddp", *extra],
                         env=ENV, capture_output=True, text=True, timeout=600))
    # With the KL reference also shared prompts and 3 length groups: the adapters-off pass goes
    # through the same root, so it makes the same fixed calls.
    passes = ["train.length_groups=3", "train.fsdp_share_prompts=true"] if kl else []
    check(torchrun(2, str(WORKER), "update", str(two), str(tmp_path / "r2"), "fsdp", *extra, *passes))
    a, c = torch.load(plain), torch.load(two)
    assert sorted(a) == sorted(c) and len(a) == 4 * 7 * 2 * 2  # 4 roles × 7 target modules × A, B × 2 layers
    trained_b = [k for k in a if ".lora_B." in k and a[k].abs().max() > 0]
    assert len(trained_b) == len(a) // 2, "every adapter's B (zero at the start) must be updated"
    for k in a:
        assert torch.allclose(a[k], c[k], atol=1e-6, rtol=1e-5), k


def test_fsdp_lora_with_ranks_holding_different_adapters(tmp_path):
    """lora under FSDP, rank 0 holding only the solver's events and rank 1 only the verifier's:
    each rank runs the other adapter's pass idle, in the same order (each pass reduce-scatters
    that adapter's gradients only).  Same update as one plain process on every event."""
    plain, two = tmp_path / "plain.pt", tmp_path / "fsdp2.pt"
    check(subprocess.run([sys.executable, str(WORKER), "update_by_policy", str(plain), str(tmp_path / "r0"), "ddp",
                          "lora"], env=ENV, capture_output=True, text=True, timeout=600))
    check(torchrun(2, str(WORKER), "update_by_policy", str(two), str(tmp_path / "r2"), "fsdp", "lora"))
    a, c = torch.load(plain), torch.load(two)
    assert sorted(a) == sorted(c) and {k.split(".lora_")[1].split(".")[1] for k in a} == {"solver", "verifier"}
    assert all(a[k].abs().max() > 0 for k in a if ".lora_B." in k)
    for k in a:
        assert torch.allclose(a[k], c[k], atol=1e-6, rtol=1e-5), k


def test_an_fsdp_lora_run_resumed_from_its_checkpoint_ends_where_an_uninterrupted_one_does(tmp_path):
    """The sharded state of lora under FSDP is the adapters and their optimizers (the frozen base
    left out): 2 steps, then --resume to 3, ends with the adapters of a straight 3-step run."""
    from safetensors.torch import load_file

    lora = ["--set", "model.layout=lora"]
    check(torchrun(2, *srpo_train(tmp_path / "straight", 3, lora)))
    check(torchrun(2, *srpo_train(tmp_path / "split", 2, lora)))
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(tmp_path / "split" / "checkpoints" / "step_0000002" / "dcp")).read_metadata()
    weights = [k for k in saved.state_dict_metadata if k.startswith("adapters.model.")]
    assert weights and all(".lora_" in k for k in weights), [k for k in weights if ".lora_" not in k][:3]  # no base tensor
    check(torchrun(2, *srpo_train(tmp_path / "split", 3, [*lora, "--resume"])))
    adapters = lambda run: {f.parent.name: load_file(str(f)) for f in  # noqa: E731
                            (run / "checkpoints" / "step_0000003" / "model" / "adapters").rglob("adapter_model.safetensors")}
    straight, split = adapters(tmp_path / "straight"), adapters(tmp_path / "split")
    assert straight.keys() == split.keys() and len(straight) == 3  # aggregator, worker_1, worker_2
    for pid in straight:
        for k in straight[pid]:
            assert torch.equal(straight[pid][k], split[pid][k]), (pid, k)


def srpo_train(run, steps, extra=()):
    return ["-m", "srpo.apps.cli", "train", "--config", str(ROOT / "configs/math/parallel_aggregate/srpo.yaml"),
            *[x for o in resume_overrides(str(run), steps) for x in ("--set", o)], *extra]


def test_a_checkpoint_of_two_processes_resumes_in_one_and_in_two(tmp_path):
    run = tmp_path / "run"
    check(torchrun(2, *srpo_train(run, 2)))
    import json

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:  # counters describe the global step (2 tasks × 2 episodes over both ranks), not rank 0's share
        assert r["episodes"] == 4 and r["events/valid"] == 8, r  # 2 events (workers K=2, aggregator) per episode
        assert r["objective/num_events"] == 8 and r["role/aggregator/length"] > 0
    saved = run / "checkpoints" / "step_0000002"
    assert (saved / "dcp").is_dir() and (saved / "model" / "shared" / "model.safetensors").is_file()
    from safetensors.torch import load_file

    hf = load_file(str(saved / "model" / "shared" / "model.safetensors"))
    dumps = {}
    for n in (1, 2):
        copy = tmp_path / f"copy{n}"
        shutil.copytree(run, copy)
        (copy / ".lock").unlink()
        out = tmp_path / f"resumed{n}.pt"
        if n == 1:
            check(subprocess.run([sys.executable, str(WORKER), "resume", str(out), str(copy)], env=ENV,
                                 capture_output=True, text=True, timeout=600))
        else:
            check(torchrun(2, str(WORKER), "resume", str(out), str(copy)))
        dumps[n] = torch.load(out)
        assert dumps[n]["step"] == 2
        for k, v in hf.items():  # the sharded state holds exactly the saved weights
            assert torch.equal(dumps[n]["weights"][k], v), (n, k)
    one, two = dumps[1]["optim"], dumps[2]["optim"]
    assert one.keys() == two.keys() and one
    for name in one:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(one[name][key], two[name][key]), (name, key)
    # And each continues to the next step.
    for n, launch in ((1, lambda *a: subprocess.run([sys.executable, *a], env=ENV, capture_output=True, text=True,
                                                    timeout=600)),
                      (2, lambda *a: torchrun(2, *a))):
        check(launch(*srpo_train(tmp_path / f"copy{n}", 3, ["--resume"])))
        steps = [int(line.split(",")[0].split(":")[1]) for line in (tmp_path / f"copy{n}" / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3], (n, steps)


def test_a_two_node_launch_on_loopback_trains_a_step(tmp_path):
    port = free_port()
    run = tmp_path / "run"
    nodes = [subprocess.Popen([str(TORCHRUN), "--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
                               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "srpo-test", *srpo_train(run, 1)],
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in nodes]
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, err[-3000:]
    assert (run / "checkpoints" / "step_0000001" / "dcp").is_dir()
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1


def test_fsdp_with_a_kl_reference_updates_like_one_plain_process(tmp_path):
    plain, two, without = tmp_path / "plain.pt", tmp_path / "fsdp2.pt", tmp_path / "nokl.pt"
    kl = "method.kl_coef=0.5"
    check(subprocess.run([sys.executable, str(WORKER), "update", str(plain), str(tmp_path / "r0"), "ddp", kl], env=ENV,
                         capture_output=True, text=True, timeout=600))
    check(torchrun(2, str(WORKER), "update", str(two), str(tmp_path / "r2"), "fsdp", kl))
    check(subprocess.run([sys.executable, str(WORKER), "update", str(without), str(tmp_path / "r3"), "ddp"], env=ENV,
                         capture_output=True, text=True, timeout=600))
    a, b, c = torch.load(plain), torch.load(two), torch.load(without)
    assert max((a[k] - c[k]).abs().max().item() for k in a) > 1e-3, "the KL term must change the update"
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=1e-5), k


TEMPERATURE_PROBE = """
import torch, copy
from srpo.policies import load_model
from srpo.parallel.fsdp import shard
torch.manual_seed(0)
root = shard(load_model("tiny-llama")[0], "cpu", bf16_compute=True)  # the CUDA bf16 policy, applied on CPU
g = torch.Generator().manual_seed(0)
ids = torch.randint(3, 200, (4, 24), generator=g)
with torch.no_grad():
    per_row = root(ids, torch.ones_like(ids), 8, action_mask=torch.ones(4, 16), temperature=torch.full((4,), 0.7))
    scalar = root(ids, torch.ones_like(ids), 8, action_mask=torch.ones(4, 16), temperature=0.7)
    rounded = root(ids, torch.ones_like(ids), 8, action_mask=torch.ones(4, 16), temperature=0.69921875)
print(float((per_row - scalar).abs().max()), float((rounded - scalar).abs().max()))
"""


def test_fsdp_bf16_keeps_the_sampling_temperature_in_float32():
    """Under FSDP's bf16 policy the root used to cast its float inputs — the per-row temperature
    0.7 became 0.6992, so the trainer's log-probs were of another distribution than the
    sampler's.  Per-row temperatures (a tensor, cast if cast at all) must give exactly what the
    plain float 0.7 (never cast) gives, while 0.6992 visibly differs."""
    done = subprocess.run([sys.executable, "-c", TEMPERATURE_PROBE], env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    per_row_gap, rounded_gap = map(float, done.stdout.split()[-2:])
    assert rounded_gap > 1e-5, "the probe must be able to see bf16's rounding of the temperature"
    assert per_row_gap == 0.0


def test_sft_under_two_ddp_and_two_fsdp_processes_trains_like_one_process(tmp_path):
    """srpo sft on RL training's backends: each rank takes its share of every batch (here 2 and 1
    examples), the loss is the global batch's mean token loss, gradients are reduced — the weights
    after two steps match one process's."""
    one, ddp, fsdp = tmp_path / "one.pt", tmp_path / "ddp.pt", tmp_path / "fsdp.pt"
    check(subprocess.run([sys.executable, str(WORKER), "sft", str(one), str(tmp_path / "r0"), "ddp"], env=ENV,
                         capture_output=True, text=True, timeout=600))
    check(torchrun(2, str(WORKER), "sft", str(ddp), str(tmp_path / "r1"), "ddp"))
    check(torchrun(2, str(WORKER), "sft", str(fsdp), str(tmp_path / "r2"), "fsdp"))
    a, b, c = (torch.load(p, weights_only=True)["after"] for p in (one, ddp, fsdp))
    before = torch.load(one, weights_only=True)["before"]
    assert any(not torch.equal(a[k], before[k]) for k in a), "the fine-tuning moved the weights"
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4), k
        assert torch.allclose(a[k], c[k], atol=1e-5, rtol=1e-4), k
