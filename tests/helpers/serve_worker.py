"""``srpo serve``'s server on a stand-in engine (tests/serving/): ``python tests/helpers/serve_worker.py
SECONDS [--api-key KEY] [--stream-tokens N] [--hold] [--announce]`` prints the URL, then serves until
signalled.

The engine takes ``SECONDS`` per batch and answers "ok"; with ``--stream-tokens N`` it draws N
tokens a reply (calling ``on_token`` for each, as a real sampler does) — a long stream at once;
with ``--hold`` a batch never ends.  ``--announce`` prints ``request`` as each request reaches the
backend and ``generating`` as each batch starts, so a test knows what the server holds."""

import argparse
import sys
import threading
import time

from srpo.gateway.backends import ServeBackend
from srpo.gateway.server import serve_forever
from srpo.types import Sample, SamplingParams
from srpo.policies.scripted import ScriptedPolicies
from srpo.types import RoleSpec


def say(line: str) -> None:
    """One whole line in one write: the engine's thread and the event loop announce at once, and
    print()'s two writes (the text, then the newline) would interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class SlowEngine:
    def __init__(self, tokenizer, seconds: float, stream_tokens: int = 0, hold: bool = False, announce: bool = False):
        self.tokenizer, self.seconds, self.stream_tokens = tokenizer, seconds, stream_tokens
        self.hold, self.announce = hold, announce

    def generate(self, requests, generator=None):
        if self.announce:
            say("generating")
        if self.hold:
            threading.Event().wait()
        time.sleep(self.seconds)
        ids = self.tokenizer("ok", add_special_tokens=False)["input_ids"]
        if self.stream_tokens:
            ids = (self.tokenizer(" and so on", add_special_tokens=False)["input_ids"] * self.stream_tokens)[
                : self.stream_tokens]
            for r in requests:
                for token in ids:
                    if r.params.on_token is not None:
                        r.params.on_token(token)
        text = self.tokenizer.decode(ids)
        return [Sample(completion_ids=ids, text=text, logprobs=[-1.0] * len(ids), finish_reason="length")
                for _ in requests]


class AnnouncingBackend(ServeBackend):
    async def complete(self, req, on_token=None):
        say("request")
        return await super().complete(req, on_token)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("seconds", type=float)
    parser.add_argument("--api-key", default="")
    parser.add_argument("--stream-tokens", type=int, default=0)
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--announce", action="store_true")
    args = parser.parse_args()
    policies = ScriptedPolicies(lambda role, prompt: "ok", ["solver"])
    specs = {"solver": RoleSpec("solver", sampling=SamplingParams(max_new_tokens=4))}
    engine = SlowEngine(policies.tokenizer, args.seconds, args.stream_tokens, args.hold, args.announce)
    backend = (AnnouncingBackend if args.announce else ServeBackend)(
        engine, policies, specs, max_batch=2, max_tokens=max(args.stream_tokens, 16))
    serve_forever(backend, "127.0.0.1", 0, api_key=args.api_key,
                  ready=lambda host, port: print(f"http://{host}:{port}/v1", flush=True))
