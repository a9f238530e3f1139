"""``srpo serve``'s server on a slow stand-in engine, for the shutdown test (tests/test_serve_load.py):
``python tests/serve_worker.py <seconds per batch>`` prints the URL, then serves until signalled."""

import sys
import time

from srpo.gateway.backends import ServeBackend
from srpo.gateway.server import serve_forever
from srpo.policies.sampling import Sample, SamplingParams
from srpo.policies.scripted import ScriptedPolicies
from srpo.types import RoleSpec


class SlowEngine:
    def __init__(self, tokenizer, seconds: float):
        self.tokenizer, self.seconds = tokenizer, seconds

    def generate(self, requests, generator=None):
        time.sleep(self.seconds)
        ids = self.tokenizer("ok", add_special_tokens=False)["input_ids"]
        return [Sample(completion_ids=ids, text="ok", logprobs=[-1.0] * len(ids), finish_reason="eos") for _ in requests]


if __name__ == "__main__":
    policies = ScriptedPolicies(lambda role, prompt: "ok", ["solver"])
    specs = {"solver": RoleSpec("solver", sampling=SamplingParams(max_new_tokens=4))}
    backend = ServeBackend(SlowEngine(policies.tokenizer, float(sys.argv[1])), policies, specs, max_batch=2)
    serve_forever(backend, "127.0.0.1", 0, ready=lambda host, port: print(f"http://{host}:{port}/v1", flush=True))
