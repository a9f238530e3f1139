"""Benchmark 22: ``srpo serve`` under concurrent clients — throughput, time to first token and
latency at 1, 8 and 32 clients — with srpo's own engine, with ``--engine vllm``, and beside vLLM's
own OpenAI server on the same requests.

Each server runs as users start it (its own process): the demo's team (SmolLM2-135M,
``parallel_aggregate`` with 2 workers) served by role with ``srpo serve`` (``srpo-builtin``: srpo's
engine at ``--threads``; ``srpo-vllm``: ``--engine vllm``, from ``.venv-vllm``), and ``vllm serve``
on the same model folder (``vllm-serve``, from ``.venv-vllm``; the requests then carry the roles'
system prompt themselves, as srpo adds it).  Each of C clients (the
``openai`` package's async client, streaming) sends requests back to back, ``--requests-per-client``
each, alternating the roles ``worker_1`` and ``aggregator``, 64-token replies at temperature 1 to a
prompt that asks for a long answer.  Reported per C: completion tokens per second over the wall
time, the median time to the first content delta, and the p50 / p99 time to the whole reply; and
where the server's CPU went — the CPU seconds per 1,000 completion tokens of each process of the
server's session (its HTTP front, vLLM's engine core), read from ``/proc`` around the load: on two
cores whatever the front spends is taken from the engine.

    python benchmarks/bench_serve.py --clients 1,8,32                                   # srpo's engine
    python benchmarks/bench_serve.py --sides srpo-builtin,srpo-vllm,vllm-serve --rounds 2  # all three (make test-vllm first)

The sides alternate within each round.  All three schedule continuously (a request joins the
running batch at the next token step).  Both vLLM sides run the engine in ``--vllm-dtype``
(bfloat16; srpo's through ``--set rollout.dtype``, which otherwise follows the model's float32
weights); srpo's own engine samples with the model's float32 weights.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a long story about a lighthouse keeper and the sea."
ROLES = ("worker_1", "aggregator")
VLLM_PYTHON = ROOT / ".venv-vllm/bin/python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(side: str, port: int, threads: int, model_dir: str,
                   vllm_dtype: str = "bfloat16") -> tuple[list[str], dict]:
    """The command line and environment that start ``side``'s server on ``port``; both vLLM sides
    run their engine in ``vllm_dtype`` (srpo's through ``rollout.dtype``: by default it follows
    the model's float32 weights)."""
    # vLLM on CPU: the same KV-cache size for both vLLM sides, every core bound
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}
    if side == "vllm-serve":
        # `vllm serve`'s own module: the `vllm` script looks up a distribution named vllm, and
        # vllm-cpu's is named vllm-cpu
        return [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(port),
                "--dtype", vllm_dtype, "--max-model-len", "4096", "--served-model-name", "team"], env
    python = sys.executable if side == "srpo-builtin" else str(VLLM_PYTHON)
    return ([python, "-m", "srpo.apps.cli", "serve", "--model", "smollm2-135m", "--workflow", "parallel_aggregate",
            "--options", json.dumps({"num_workers": 2}), "--port", str(port), "--threads", str(threads),
            "--engine", "builtin" if side == "srpo-builtin" else "vllm"]
            + ([] if side == "srpo-builtin" else ["--set", f"rollout.dtype={vllm_dtype}"])), env


def start_server(side: str, port: int, threads: int, model_dir: str, vllm_dtype: str) -> subprocess.Popen:
    """``side``'s server, waited for until it answers ``/v1/models``."""
    import urllib.request

    cmd, env = server_command(side, port, threads, model_dir, vllm_dtype)
    # Its own session: stopping it takes its engine processes with it (a vLLM engine core left
    # behind keeps a core busy and slows the next server measured).
    # Its log goes to a file: a pipe nobody reads fills up and stalls the server mid-measurement.
    log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-serve-{side}-", suffix=".log", delete=False)
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"{side} exited ({server.returncode}):\n{Path(log.name).read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit(f"{side} did not answer within 600 s")


def stop_server(server: subprocess.Popen) -> None:
    """Stop a server as Ctrl-C would, then whatever of its session is left."""
    server.terminate()
    try:
        server.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
    time.sleep(2)  # the killed processes release their cores and memory


def request_of(side: str, role: str) -> tuple[str, list[dict]]:
    """The model name and messages of a request for ``role``: srpo serves roles by name and adds
    their system prompt; vLLM's server serves the model, so the request carries the prompt."""
    if side != "vllm-serve":
        return role, [{"role": "user", "content": PROMPT}]
    from srpo.tasks.kinds import task_kind

    return "team", [{"role": "system", "content": task_kind("math").system_prompt}, {"role": "user", "content": PROMPT}]


async def one_request(client, side: str, role: str, tokens: int) -> dict:
    start = time.perf_counter()
    first, count = None, 0
    model, messages = request_of(side, role)
    stream = await client.chat.completions.create(model=model, messages=messages,
                                                  max_tokens=tokens, temperature=1.0, stream=True,
                                                  stream_options={"include_usage": True})
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            count = chunk.usage.completion_tokens
    return {"ttft_s": first if first is not None else time.perf_counter() - start,
            "latency_s": time.perf_counter() - start, "tokens": count}


def session_cpu(session: int) -> dict[int, tuple[str, float]]:
    """pid → (name, CPU seconds so far) of every process in ``session`` (Linux ``/proc``)."""
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            name = (entry / "comm").read_text().strip()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # from the state on: field 3 of proc(5) is fields[0]
        if int(fields[3]) == session:
            found[int(entry.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return found


def cpu_by_process(before: dict, after: dict) -> dict[str, float]:
    """Process name → the CPU seconds its processes spent between two :func:`session_cpu` readings."""
    spent: dict[str, float] = {}
    for pid, (name, total) in after.items():
        spent[name] = spent.get(name, 0.0) + total - before.get(pid, (name, 0.0))[1]
    return spent


async def load(side: str, port: int, clients: int, per_client: int, tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)

    async def user(i: int) -> list[dict]:
        return [await one_request(client, side, ROLES[(i + j) % 2], tokens) for j in range(per_client)]

    start = time.perf_counter()
    done = [r for rs in await asyncio.gather(*(user(i) for i in range(clients))) for r in rs]
    wall = time.perf_counter() - start
    await client.close()
    latencies = sorted(r["latency_s"] for r in done)
    p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
    return {"side": side, "clients": clients, "requests": len(done), "wall_s": wall,
            "tokens_per_s": sum(r["tokens"] for r in done) / wall, "mean_tokens": statistics.mean(r["tokens"] for r in done),
            "ttft_p50_s": statistics.median(r["ttft_s"] for r in done),
            "latency_p50_s": statistics.median(latencies), "latency_p99_s": p99}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sides", default="srpo-builtin", help="comma-separated: srpo-builtin, srpo-vllm, vllm-serve")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-dtype", default="bfloat16", help="the engine dtype of both vLLM sides")
    ap.add_argument("--out", default="runs/bench_serve.json")
    args = ap.parse_args()
    from srpo.policies.models import converted_checkpoint

    model_dir = str(converted_checkpoint("smollm2-135m"))  # the folder vLLM's server loads
    rows = []
    for r in range(args.rounds):
        for side in args.sides.split(","):
            port = free_port()
            server = start_server(side, port, args.threads, model_dir, args.vllm_dtype)
            try:
                asyncio.run(load(side, port, 1, 1, 4))  # warm-up
                for c in map(int, args.clients.split(",")):
                    before = session_cpu(server.pid)
                    row = asyncio.run(load(side, port, c, args.requests_per_client, args.tokens))
                    spent = cpu_by_process(before, session_cpu(server.pid))
                    kilo_tokens = row["tokens_per_s"] * row["wall_s"] / 1000
                    row["cpu_s_per_1k_tokens"] = {name: s / kilo_tokens for name, s in sorted(spent.items()) if s > 0}
                    rows.append({"round": r, **row})
                    print(json.dumps(rows[-1]), flush=True)
            finally:
                stop_server(server)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"\n{args.tokens}-token replies, srpo's server at {args.threads} threads\n")
    print("| server | round | clients | requests | completion tokens/s | mean reply tokens | first token p50 (s) | "
          "latency p50 (s) | latency p99 (s) | CPU s per 1k tokens, by process |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        cpu = ", ".join(f"{name} {s:.2f}" for name, s in r["cpu_s_per_1k_tokens"].items())
        print(f"| {r['side']} | {r['round']} | {r['clients']} | {r['requests']} | {r['tokens_per_s']:.1f} | "
              f"{r['mean_tokens']:.1f} | {r['ttft_p50_s']:.2f} | {r['latency_p50_s']:.2f} | {r['latency_p99_s']:.2f} | "
              f"{cpu} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
