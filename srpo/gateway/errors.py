"""The gateway's refusals: :class:`ProtocolError` and OpenAI's error object (a leaf module: the
wire format, the tool rules and the Responses API all raise it)."""

from __future__ import annotations

from typing import Any


class ProtocolError(Exception):
    """A request the endpoint refuses: ``status`` (400, 404, 413 ...), the offending ``param``."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error", retry_after_s: int | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind
        self.retry_after_s = retry_after_s  # 429/503: the Retry-After header

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, param=self.param, code=self.code, kind=self.kind)


def error_body(message: str, *, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
