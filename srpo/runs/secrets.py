"""Credentials never leave the process through a run's files: URLs lose their passwords and
secret query parameters before a config is saved, uploaded to a tracker or written in the lock.

``https://user:hunter2@mlflow.example/`` → ``https://user:***@mlflow.example/``;
``http://host/retrieve?token=abc&k=3`` → ``http://host/retrieve?token=***&k=3``.  Give secrets
to srpo through the environment (``MLFLOW_TRACKING_PASSWORD``, ``SRPO_RETRIEVER_API_KEY``), not
inside a URL in a config file."""

from __future__ import annotations

import re
from typing import Any

REDACTED = "***"
# scheme://user:password@  — the password part
_USERINFO = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/@\s:]*:)(?P<secret>[^/@\s]+)(?P<tail>@)")
# ?token=... &api_key=... (names that carry a secret by convention)
_QUERY = re.compile(r"(?P<head>[?&](?:access_token|token|api[_-]?key|key|secret|password|passwd|pwd|sig|signature|"
                    r"auth|authorization|credential|credentials)=)(?P<secret>[^&#\s]+)", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with every URL's password and secret query values replaced by ``***``."""
    text = _USERINFO.sub(lambda m: f"{m['head']}{REDACTED}{m['tail']}", text)
    return _QUERY.sub(lambda m: f"{m['head']}{REDACTED}", text)


def redacted(value: Any) -> Any:
    """A copy of ``value`` (a config as a dict, a list of arguments) with every string redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redacted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redacted(v) for v in value)
    return value
