"""The device-dependent logic of a GPU run, covered on a CPU machine (issue: the first GPU run must
not fail).  Each test names the defect it guards against."""

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from srpo.config import ConfigError, parse_config
from srpo.parallel.devices import DeviceError, process_group_backend, rank_device
from srpo.policies.decoding import draw, kv_budget, SAMPLE_KV_BUDGET
from srpo.rollout.vllm import buckets, cpu_cores_of_rank, engine_visible_devices, engine_weights, staging_root

TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}


def test_draws_come_from_the_generators_device(monkeypatch):
    """The trainer's and the evaluator's generators live on the CPU; a draw on CUDA probabilities
    must ask the CPU generator for its numbers (torch.rand with a CPU generator and a CUDA device
    raises "Expected a 'cuda' device type for generator")."""
    seen = []
    real = torch.rand

    def spy(*args, **kwargs):
        seen.append((kwargs.get("generator"), kwargs.get("device")))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "rand", spy)
    g = torch.Generator()
    draw(torch.softmax(torch.randn(3, 7), -1), g)
    ours = [dev for gen, dev in seen if gen is g]
    assert ours and all(dev == g.device for dev in ours)
    # The same numbers as before the change on a CPU: a checkpointed generator state replays.
    monkeypatch.setattr(torch, "rand", real)
    a = draw(torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(1)), -1),
             torch.Generator().manual_seed(3))
    u = torch.rand((4, 1), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(1)), -1)
    cdf = probs.double().cumsum(-1)
    assert torch.equal(a, torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1))


def test_each_rank_takes_its_own_device_and_cpu_runs_stay_on_gloo():
    """run.device cuda under torchrun is cuda:LOCAL_RANK (not GPU 0 on every rank); cuda:N under
    torchrun is refused (every rank on GPU N); a CPU run uses gloo and the CPU on a GPU machine."""
    assert rank_device("cpu", TORCHRUN) == torch.device("cpu")
    assert rank_device("cuda", TORCHRUN) == torch.device("cuda", 1)
    assert rank_device("cuda", {}) == torch.device("cuda", 0)
    assert rank_device("cuda:3", {}) == torch.device("cuda", 3)
    with pytest.raises(DeviceError, match="would put all 2 ranks on GPU 3"):
        rank_device("cuda:3", TORCHRUN)
    assert isinstance(DeviceError("x"), ConfigError)  # the command line reports it as a config error
    assert process_group_backend("cpu") == "gloo"
    assert process_group_backend("cuda") == "cuda:nccl,cpu:gloo"


def test_fsdp_shards_on_the_mesh_of_run_device():
    """fully_shard without a mesh takes the CUDA mesh whenever CUDA exists; srpo passes the mesh of
    run.device, so a CPU run's shards live on a CPU mesh."""
    from srpo.parallel.fsdp import ensure_process_group, shard
    from srpo.policies import load_model

    ensure_process_group("cpu")
    model, _ = load_model("tiny-llama")
    root = shard(model, "cpu")
    param = next(root.parameters())
    assert param.device_mesh.device_type == "cpu"


def test_engine_of_each_rank_sees_only_its_gpu():
    """vLLM's single-process executor takes cuda:0; under torchrun each rank's engine is started
    with CUDA_VISIBLE_DEVICES set to that rank's GPU (an index into the launch's visible GPUs)."""
    assert engine_visible_devices({}) is None
    assert engine_visible_devices(TORCHRUN) == "1"
    assert engine_visible_devices({**TORCHRUN, "CUDA_VISIBLE_DEVICES": "4,5"}) == "5"
    # One process on run.device cuda:N: the engine goes to GPU N too (it used to take GPU 0).
    assert engine_visible_devices({}, current=2) == "2"
    assert engine_visible_devices({"CUDA_VISIBLE_DEVICES": "4,5,6"}, current=2) == "6"


def test_every_cuda_run_makes_its_device_current(monkeypatch):
    """run.device cuda:N in one process: cuda:N becomes the current device before the backend is
    made (FSDP's mesh, the CUDA RNG and tensors made without a device follow it)."""
    from srpo import build
    from srpo.parallel import devices

    calls = []
    monkeypatch.setattr(devices.torch.cuda, "set_device", lambda d: calls.append(str(d)))
    devices.use_device(torch.device("cuda", 3))
    devices.use_device(torch.device("cpu"))
    assert calls == ["cuda:3"]
    assert "use_device(device(cfg))" in __import__("inspect").getsource(build.backend)


def test_lora_ranks_round_up_to_what_vllm_serves():
    from srpo.rollout.vllm import engine_lora_rank

    assert [engine_lora_rank(r) for r in (1, 4, 8, 24, 48, 64, 300, 512)] == [1, 8, 8, 32, 64, 64, 320, 512]
    with pytest.raises(ValueError, match="up to 512"):
        engine_lora_rank(1024)


def test_overlap_with_vllm_needs_its_engine_process():
    from srpo.config import ConfigError
    from srpo.rollout.vllm import require_engine_process

    env = {}
    require_engine_process(env)
    assert env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, "the safe default is set where unset"
    with pytest.raises(ConfigError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        require_engine_process({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


def test_adapter_syncs_never_ask_the_hub(tmp_path, monkeypatch):
    """PEFT's save_embedding_layers="auto" fetched the base model's config from the hub at every
    adapter save (every sync, every policy, every rank); srpo's adapters are saved without it."""
    import peft.utils.save_and_load as sl

    from srpo.policies.layouts import build_policies

    policies = build_policies("lora", "tiny-llama", ["a", "b"])
    asked = []
    monkeypatch.setattr(sl, "check_file_exists_on_hf_hub", lambda *a, **k: asked.append(a) or False, raising=False)
    seen = []
    real = sl.get_peft_model_state_dict
    monkeypatch.setattr(sl, "get_peft_model_state_dict",
                        lambda *a, **k: seen.append(k.get("save_embedding_layers")) or real(*a, **k))
    import peft.peft_model as pm

    monkeypatch.setattr(pm, "get_peft_model_state_dict", sl.get_peft_model_state_dict)
    policies.save_adapter("b", tmp_path / "b")
    assert seen == [False] and not asked
    assert any((tmp_path / "b").rglob("adapter_model.safetensors"))


def test_weight_sync_buckets_and_a_small_dev_shm(monkeypatch, tmp_path):
    """The weights go in buckets of bounded size; a /dev/shm without room for two buckets (a
    container's 64 MB default) sends them to disk instead of failing."""
    state = {f"w{i}": torch.zeros(1000) for i in range(10)}  # 4,000 bytes each
    groups = list(buckets(state, limit=10_000))
    assert [len(g) for g in groups] == [2, 2, 2, 2, 2] and sum(map(len, groups)) == 10
    assert [len(g) for g in buckets({"big": torch.zeros(5000), "s": torch.zeros(1)}, limit=100)] == [1, 1]
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(64 << 20, 0, 64 << 20))
    assert staging_root(256 << 20, shm=str(shm), env={}) != shm  # 64 MB free: two 256 MB buckets do not fit
    assert staging_root(16 << 20, shm=str(shm), env={}) == shm
    assert staging_root(16 << 20, shm=str(tmp_path / "missing"), env={}) != tmp_path / "missing"
    # Sized for every local rank at once and for a tensor larger than a bucket (it travels alone).
    eight = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}
    assert staging_root(2 << 20, shm=str(shm), env=eight) == shm  # 8 ranks x 2 x 2 MB = 32 MB
    assert staging_root(8 << 20, shm=str(shm), env=eight) != shm  # 8 x 2 x 8 MB = 128 MB
    assert staging_root(1 << 20, 40 << 20, shm=str(shm), env={}) != shm  # one 40 MB embedding, twice


def test_weight_sync_falls_back_to_disk_when_shm_fills(tmp_path, monkeypatch):
    """A /dev/shm that fills during a sync (other jobs share it): the bucket is staged on disk and
    the sync goes on; only disk failing too is an error, naming the path."""
    import errno

    import safetensors.torch as st

    from srpo.rollout import vllm

    engine = vllm.VLLMEngine.__new__(vllm.VLLMEngine)
    shm_root = tmp_path / "shm"
    shm_root.mkdir()
    engine.shm = Path(tempfile.mkdtemp(dir=shm_root))
    engine.settings = vllm.EngineSettings(bucket_bytes=1 << 20)
    engine.sync_stats = {"syncs": 0, "buckets": 0, "max_bucket_bytes": 0}
    loaded = []

    class LLM:
        def collective_rpc(self, name, args=()):
            if name == "srpo_load_bucket":
                loaded.append((Path(args[0]).parent.parent, sorted(st.load_file(args[0]))))

        def reset_prefix_cache(self):
            pass

    engine.llm = LLM()
    engine.watch = vllm.EngineCoreWatch(engine.llm)  # a stand-in LLM has no core process to watch
    real_save = st.save_file

    def save_file(tensors, path):
        if str(path).startswith(str(shm_root)):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(tensors, path)

    monkeypatch.setattr(st, "save_file", save_file)
    engine.sync({"a": torch.zeros(10), "b": torch.ones(10)})
    assert loaded == [(Path(tempfile.gettempdir()), ["a", "b"])]
    assert engine.shm.parent == Path(tempfile.gettempdir())
    engine.close()


def test_each_ranks_cpu_engine_binds_its_own_cores():
    """On CPU, two ranks' engines binding the same cores would halve each other's speed."""
    assert cpu_cores_of_rank({}, cores=2) == "0-1"
    two = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert [cpu_cores_of_rank({**two, "LOCAL_RANK": str(r)}, cores=2) for r in (0, 1)] == ["0-0", "1-1"]
    assert [cpu_cores_of_rank({**two, "LOCAL_RANK": str(r)}, cores=16) for r in (0, 1)] == ["0-7", "8-15"]
    four = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}  # more ranks than cores: one core each, in turn
    assert [cpu_cores_of_rank({**four, "LOCAL_RANK": str(r)}, cores=2) for r in range(4)] == ["0-0", "1-1", "0-0", "1-1"]


def test_engine_weights_stream_each_tensor_once_in_the_engines_dtype():
    """The sync's walk of a model: a tied head is given once (safetensors refuses shared storage;
    the engine ties it itself), every other tensor once with its values, cast to the engine's
    dtype; and the walk is lazy, so the buckets hold what they are given, not the model."""
    from srpo.policies import load_model

    model = load_model("tiny-llama")[0]  # tie_word_embeddings: lm_head.weight is embed_tokens.weight
    state = model.state_dict()
    items = list(engine_weights(model, torch.bfloat16))
    names = [n for n, _ in items]
    assert len(names) == len(set(names)) == len(state) - 1 and "lm_head.weight" not in names
    for name, tensor in items:
        assert tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu"
        assert torch.equal(tensor, state[name].to(torch.bfloat16))
    walk = engine_weights(model)
    assert not isinstance(walk, (list, dict))  # a generator: nothing gathered or copied before it is asked for
    assert sum(len(g) for g in buckets(walk, limit=1 << 14)) == len(names)


def test_sampler_memory_budget_follows_the_device(monkeypatch):
    """The KV budget of one sampling call is 4 GiB on a CPU; on a GPU half its free memory (a fixed
    4 GiB split a 4B model's long calls into one row each)."""
    assert kv_budget(torch.device("cpu")) == SAMPLE_KV_BUDGET
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 << 30, 80 << 30))
    assert kv_budget(torch.device("cuda", 0)) == 30 << 30


def test_pure_bf16_full_fine_tuning_is_refused_and_lora_keeps_float32_adapters():
    """bf16 weights with no float32 master copy lose updates below bf16's rounding step; refused
    unless said knowingly.  The LoRA layout over a bf16 base trains float32 adapters."""
    with pytest.raises(ConfigError, match="no float32 master copy"):
        parse_config({"model": {"dtype": "bfloat16", "layout": "shared"}})
    parse_config({"model": {"dtype": "bfloat16", "layout": "shared"}, "train": {"low_precision_weights": True}})
    parse_config({"model": {"dtype": "bfloat16", "layout": "lora"}})
    from srpo.policies.layouts import build_policies

    policies = build_policies("lora", "tiny-llama", ["a", "b"], dtype=torch.bfloat16)
    assert {p.dtype for pid in policies.policy_ids for p in policies.parameters(pid)} == {torch.float32}
    # why: one AdamW-sized step of a bf16 weight of 1.0 at lr 1e-5 is rounded away entirely
    w = torch.tensor([1.0], dtype=torch.bfloat16)
    assert torch.equal(w - 1e-5, w)


def test_top_p_below_one_on_vllm_is_refused():
    """vLLM's processed log-probs include its top-p renormalisation, the trainer's do not: the
    mismatch and TIS would be biased."""
    from srpo.build import config_from_dict

    data = {"model": {"name": "tiny-llama"}, "task": {"kind": "math", "train": {"source": "synthetic_arithmetic"}},
            "workflow": {"roles": {"solver": {"top_p": 0.9}}}}
    with pytest.raises(ConfigError, match="top-p renormalisation"):
        config_from_dict({**data, "rollout": {"engine": "vllm"}})
    config_from_dict({**data, "rollout": {"engine": "builtin"}})


def test_engine_dtype_follows_the_trainers_compute():
    from srpo.rollout.vllm import engine_dtype

    assert engine_dtype(parse_config({"run": {"device": "cuda"}, "model": {"autocast_bf16": True}})) == "bfloat16"
    assert engine_dtype(parse_config({"run": {"device": "cpu"}, "model": {"autocast_bf16": True}})) == "float32"
    assert engine_dtype(parse_config({"rollout": {"dtype": "float16"}})) == "float16"


def test_data_parallel_gradients_are_summed_in_buckets(monkeypatch):
    """DDP sums gradients in flat buckets (one collective per bucket, not per tensor), and the
    summed values land back in every tensor."""
    from srpo.parallel.base import DataParallel

    dp = DataParallel.__new__(DataParallel)
    dp.enabled, dp.rank, dp.world = True, 0, 2
    calls = []
    monkeypatch.setattr(dp, "sum_", lambda t: (calls.append(t.numel()), t.mul_(2))[1])
    monkeypatch.setattr(DataParallel, "BUCKET_BYTES", 4 * 250)
    params = [torch.nn.Parameter(torch.ones(n)) for n in (100, 100, 100, 400)]
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    dp.reduce_gradients(params)
    assert calls == [200, 100, 400]  # 800 bytes, then 400 (a third would pass 1000), then one large alone
    assert all(torch.equal(p.grad, torch.full_like(p, 6.0)) for p in params)


@pytest.mark.slow
def test_gpu_check_runs_reduced_on_cpu_and_cannot_say_ok_when_wrong(tmp_path):
    """scripts/gpu_check.py in its reduced CPU form: every combination judged against a reference
    (resume vs straight, sampler vs trainer, FSDP over 2 gloo ranks vs one process), missing pieces
    skipped by name, one JSON report; a sabotaged resume is reported FAILED with its stage."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, str(script), "--device", "cpu", "--model", "tiny-llama", "--steps", "2"]
    done = subprocess.run([*base, "--only", "sampler · shared,sampler · lora,fsdp,vllm,staleness,dcp,memory",
                           "--out", str(tmp_path / "r.json")], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    verdicts = {r["combination"]: r["verdict"] for r in report["combinations"]}
    assert verdicts["sampler · shared · fp32"] == verdicts["sampler · lora · fp32"] == "ok"
    assert verdicts["fsdp · all devices"] == "ok" and "2 rank(s) vs one process" in done.stdout
    assert verdicts["staleness · shared"] == verdicts["staleness · lora"] == "ok"
    assert verdicts["fsdp · lora · all devices"] == verdicts["fsdp · kl reference · all devices"] == "ok"
    assert verdicts["staleness · fsdp · built-in sampler"] == "SKIPPED" and report["floor_gib_full_model"] > 0
    assert all(v == "SKIPPED" for c, v in verdicts.items() if c.startswith("vllm"))  # no vLLM in this environment
    assert verdicts["gloo · one rank · dcp save and load"] == verdicts["fsdp · bf16 · temperature 0.7"] == "ok"
    assert verdicts["memory · qwen3-4b shape · load, update, wake"] == "SKIPPED"  # GPU memory: CUDA only
    sabotaged = subprocess.run([*base, "--only", "sampler · shared · fp32", "--out", str(tmp_path / "s.json")],
                               env={**env, "SRPO_GPU_CHECK_SABOTAGE": "resume"}, capture_output=True, text=True,
                               timeout=900)
    assert sabotaged.returncode == 1
    (record,) = json.loads((tmp_path / "s.json").read_text())["combinations"]
    assert record["verdict"] == "FAILED" and record["stage"] == "compare resumed with straight"
    assert "Traceback" in record["traceback"]


def test_sleep_mode_releases_the_engines_before_the_update_and_wakes_them_before_the_sync():
    """rollout.sleep_during_update: the call order on a stand-in for vLLM's LLM (the sleep mode
    itself needs CUDA), and the refusal where it cannot run."""
    from types import SimpleNamespace

    import pytest

    from srpo.build import config_from_dict
    from srpo.config import ConfigError
    from srpo.rollout.vllm import VLLMEngine, VLLMRollout

    calls = []
    llm = SimpleNamespace(sleep=lambda level: calls.append(("sleep", level)),
                          wake_up=lambda tags: calls.append("wake:" + "+".join(tags)))
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.llm, engine.asleep = llm, 0
    engine.sync = lambda state: calls.append("sync")
    engine.sync_adapter = lambda pid, save: calls.append("sync")
    for layout, level, name in (("shared", 2, "p"), ("lora", 1, "base")):
        calls.clear()
        rollout = VLLMRollout.__new__(VLLMRollout)
        rollout.sleep_mode, rollout.engines = True, {name: engine}
        rollout.settings, rollout.syncs = SimpleNamespace(check_every=0), 0
        rollout.check_sync = lambda after: calls.append(f"check after {after}")
        rollout.policies = SimpleNamespace(layout=layout, policy_ids=["p"],
                                           model_for=lambda pid: SimpleNamespace(state_dict=lambda: {}))
        rollout.release()
        rollout.release()  # already asleep: once
        rollout.update_weights()
        assert calls == [("sleep", level), "wake:weights", "sync", "wake:kv_cache", "check after a wake"]
        assert engine.asleep == 0
    with pytest.raises(ConfigError, match="sleep_during_update: the builtin engine releases its memory during updates on "
                                          "no device"):
        config_from_dict({"model": {"name": "tiny-llama"}, "rollout": {"sleep_during_update": True},
                          "task": {"kind": "math", "train": {"source": "synthetic_arithmetic"}}})


def test_the_best_checkpoint_is_chosen_on_rank_0_and_followed_by_every_rank():
    """vLLM is not batch-invariant: ranks can see different held-out figures.  Each rank deciding
    alone, one would save (a collective) while another went on.  Rank 0 decides; the others follow
    its broadcast, whatever they measured."""
    from types import SimpleNamespace

    from srpo.train.loop import Trainer

    rank0_says = {}

    class Backend:
        def __init__(self, rank):
            self.rank = rank

        def broadcast_object(self, obj, src=0):
            if self.rank == 0:
                rank0_says["record"] = obj
                return obj
            return rank0_says["record"]

    key = "eval/macro/avg@4"

    def trainer(rank, best):
        return SimpleNamespace(BEST_METRIC=Trainer.BEST_METRIC, cfg=SimpleNamespace(eval=SimpleNamespace(k=4)),
                               backend=Backend(rank), best=best, step=7)

    previous = {"value": 0.5}
    # Rank 0 measured no gain, rank 1 a gain: neither saves.
    assert Trainer._new_best(trainer(0, previous), {key: 0.5}) is None
    assert Trainer._new_best(trainer(1, previous), {key: 0.9}) is None
    # Rank 0 measured a gain, rank 1 none: both save, both record rank 0's figure.
    got0 = Trainer._new_best(trainer(0, previous), {key: 0.6})
    got1 = Trainer._new_best(trainer(1, previous), {key: 0.4})
    assert got0 == got1 == {"step": 7, "checkpoint": "step_0000007", "metric": key, "value": 0.6}
    assert Trainer._new_best(trainer(1, previous), {"reward": 1.0}) is None, "no evaluation: no collective"


def test_a_silent_rank_is_named_before_the_nccl_watchdog_could_abort(capsys):
    """NCCL's watchdog aborts a process on a collective's timeout without running Python, so the
    message naming the silent rank must already be out: the heartbeat thread names a peer silent
    for more than silence_report_s (half the collective timeout, at most 30 s), once."""
    from srpo.parallel.base import DataParallel

    class Store(dict):  # a torch.distributed.Store's check/get, over a dict
        def check(self, keys):
            return all(k in self for k in keys)

        def get(self, key):
            return self[key].encode()

    backend = DataParallel.__new__(DataParallel)
    backend.rank, backend.world, backend.silence_report_s, backend._reported = 0, 3, 30.0, set()
    backend._store = Store({"srpo/heartbeat/0": "1000", "srpo/heartbeat/1": "995", "srpo/heartbeat/2": "960"})
    assert backend.report_silent_peers(1000.0) == [2]
    assert "rank 2 has not answered for 40 s" in capsys.readouterr().err
    assert backend.report_silent_peers(1001.0) == [], "named once"
    backend._store["srpo/heartbeat/2"] = "1001"
    assert backend.report_silent_peers(1002.0) == []
    backend._store["srpo/heartbeat/2"] = "1001"
    assert backend.report_silent_peers(1040.0) == [1, 2], "silent again: named again"


def test_fsdp_models_are_built_on_the_cpu_and_sharded_onto_the_gpu():
    """The full model used to be moved to the GPU before it was sharded (an 8B fp32 model: ~33 GB
    above one shard), its KL reference copied there too.  Under FSDP they are built on the CPU;
    fully_shard moves each unit's shard to the mesh's device as it shards it."""
    from srpo import build

    fsdp = parse_config({"run": {"device": "cuda"}, "train": {"parallel": "fsdp"}})
    ddp = parse_config({"run": {"device": "cuda"}})
    assert build.load_device(fsdp) == torch.device("cpu")
    assert build.load_device(ddp) == torch.device("cuda", 0)
