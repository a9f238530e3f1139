"""What a saved configuration may make srpo run: nothing, unless the user says so.

A run folder or an ``srpo sft`` output carries the configuration it was trained with
(``config.json``).  That configuration may name code: a workflow's program
(``workflow.options.entry: team.py:solve``), another interpreter (``workflow.options.python``),
or an import path any registry accepts (``workflow.name: mypkg.teams:Debate``, ``task.reward``,
``rollout.engine``, ...).  Importing any of them runs its module.  The weights beside that file
are loaded without running code (safetensors, ``torch.load(weights_only=True)``), so a folder
downloaded from someone else must not run code through its config either.

:func:`code_named` lists every place a config names code; ``srpo serve`` and ``srpo eval``
refuse to run what a folder names unless the user passes ``--trust-run-code`` — or replaces it on
their own command line (``--workflow``, ``--options``, ``--kind``, ``--engine``, ``--set``).
"""

from __future__ import annotations

import re
from typing import Any, Iterator

from srpo.registry import is_import_path

TRUST_FLAG = "--trust-run-code"
# Keys whose value is run, whatever it looks like: a program, an interpreter.
PROGRAM_KEYS = frozenset({"workflow.options.entry", "workflow.options.python", "sft.script"})
# ``package.module:attribute`` (the one form the registries import, srpo.registry.IMPORT_PATH) or
# ``path/to/file.py:function`` (what the workflow loaders run).
_FILE_ENTRY = re.compile(r"^.+\.py:[A-Za-z_]\w*$")


# Values with a colon that are data, not code — hub datasets, synthetic sources, URLs — in the keys
# that hold data (a data source's ``source``/``corpus``, a URL); anywhere else such a value is
# what a registry would import, and is flagged like any import path.
_DATA_PREFIXES = ("hub:", "synthetic_", "http:", "https:", "file:")
_DATA_KEYS = ("source", "corpus", "url", "base_url", "retriever_url")
# Keys whose values are names, never imported (role names may contain a colon).
_NAME_KEYS = ("workflow.options.roles",)


def names_code(value: Any, key: str = "") -> bool:
    """Whether ``value`` (one config value, at ``key``) is an import path or a program file a loader
    would run."""
    if not isinstance(value, str):
        return False
    if value.startswith(_DATA_PREFIXES) and key.rsplit(".", 1)[-1].split("[")[0] in _DATA_KEYS:
        return False
    return is_import_path(value) or bool(_FILE_ENTRY.match(value))


def _leaves(data: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _leaves(value, f"{prefix}[{i}]")
    else:
        yield prefix, data


def code_named(data: dict) -> dict[str, Any]:
    """``{dotted key: value}`` of every place ``data`` (a config as a dict) names code to import or
    run: the program keys with any value, ``trust_remote_code: true``, and every import path."""
    found = {}
    for key, value in _leaves(data):
        if key in PROGRAM_KEYS and value not in ("", None):
            found[key] = value
        elif key.endswith("trust_remote_code") and value is True:
            found[key] = value
        elif names_code(value, key) and not key.startswith(_NAME_KEYS):
            found[key] = value
    return found


def _get(data: dict, dotted: str) -> Any:
    node: Any = data
    for part in re.split(r"\.|\[(\d+)\]", dotted):
        if part in (None, ""):
            continue
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return _MISSING
    return node


_MISSING = object()


class UntrustedCode(ValueError):
    """A saved configuration names code the user did not ask to run."""


def refuse_saved_code(saved: dict, final: dict, source: str) -> None:
    """Raise :class:`UntrustedCode` when ``final`` (the config about to be built) still names code
    that came from ``saved`` (the folder's config) — code the user replaced or removed on their
    own command line is theirs.  The message names each key and the way out."""
    kept = {key: value for key, value in code_named(saved).items() if _get(final, key) == value}
    if not kept:
        return
    listed = "; ".join(f"{key} = {value!r}" for key, value in sorted(kept.items()))
    raise UntrustedCode(
        f"{source} names code to run ({listed}). srpo does not import or run code named in a run folder: "
        f"pass {TRUST_FLAG} if you trust whoever wrote it, or give your own on the command line "
        f"(--workflow/--options, --kind, --engine, --set KEY=VALUE)")


#: Keys of a saved config whose value may be a file srpo reads (a chat template is read into every
#: prompt; a corpus is searched and quoted back): inside the folder, or refused.
FILE_KEYS = ("model.chat_template", "task.corpus")


def _is_file_reference(key: str, value: Any) -> bool:
    if not isinstance(value, str) or not value:
        return False
    if key == "model.chat_template":  # a registered template name, Jinja text, or a .jinja file
        return value.endswith(".jinja") and "{" not in value
    return not value.startswith(_DATA_PREFIXES) and not value.startswith("synthetic_")


def files_outside(saved: dict, final: dict, folder) -> dict[str, str]:
    """``{key: path}`` of the files the folder's config (``saved``) names that are still in
    ``final`` and resolve — symbolic links followed — outside ``folder``."""
    from pathlib import Path

    root = Path(folder).resolve()
    out = {}
    for key in FILE_KEYS:
        value = _get(saved, key)
        if value is _MISSING or not _is_file_reference(key, value) or _get(final, key) != value:
            continue
        path = Path(value) if Path(value).is_absolute() else root / value
        resolved = path.resolve()
        if resolved != root and root not in resolved.parents:
            out[key] = value
    return out


def refuse_files_outside(saved: dict, final: dict, folder, source: str) -> None:
    """Raise :class:`UntrustedCode` naming each file the folder's config names outside the folder."""
    outside = files_outside(saved, final, folder)
    if outside:
        listed = "; ".join(f"{key} = {value!r}" for key, value in sorted(outside.items()))
        raise UntrustedCode(f"{source} names files outside itself ({listed}); srpo reads only files inside a run "
                            f"folder it did not write: pass {TRUST_FLAG} if you trust it, or give your own on the "
                            f"command line (--set KEY=VALUE, --corpus)")
