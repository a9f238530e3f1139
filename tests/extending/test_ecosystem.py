"""Fitting the ecosystem: experiment trackers, the retrieval service, the wheel."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tiny_train(run_dir, extra=()):
    overrides = [f"run.output_dir={run_dir}", "run.steps=3", "model.name=tiny-llama", "model.autocast_bf16=false",
                 "workflow.max_new_tokens=6", "train.tasks_per_step=2", "train.group_size=2", "train.lr=0.01",
                 "task.train.n=8", "checkpoint.every=2", "train.skip_zero_advantage=false", *extra]
    return [sys.executable, "-m", "srpo.apps.cli", "train", "--config", str(ROOT / "configs/math/single/srpo.yaml"),
            *[x for o in overrides for x in ("--set", o)]]


# ------------------------------------------------------------------------------------ trackers

def wandb_history(path: Path, key: str) -> dict:
    """``step → value`` of ``key`` from an offline W&B run's ``.wandb`` log.

    wandb 0.31 writes it from its Go core and no longer ships a Python reader; the format is a
    LevelDB-style log — a 7-byte header (":W&B", magic 0xBEE1, version), then 32 KiB blocks of
    records, each with a 7-byte header (CRC, length, type: full/first/middle/last) — holding
    protobuf ``Record`` messages."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1
    out, pos, buf = {}, 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                if key in items:
                    out[items["_step"]] = items[key]
    return out


@pytest.mark.slow
def test_every_tracker_logs_offline_and_the_metric_reads_back(tmp_path, monkeypatch):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TRACKIO_DIR": str(tmp_path / "trackio"),
           "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    backends = "log.backends=[tensorboard, wandb, mlflow, trackio]"
    settings = [backends, "log.wandb_mode=offline", "log.project=srpo-test", "log.run_name=trackers"]
    done = subprocess.run(tiny_train(run, settings), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ids = json.loads((run / "trackers.json").read_text())
    # A resumed run continues the same tracker runs.
    done = subprocess.run(tiny_train(run, [*settings, "run.steps=5"]) + ["--resume"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run / "trackers.json").read_text()) == ids
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    metric = "time/step_s"  # differs at every step
    want = {r["step"]: r[metric] for r in rows}
    assert sorted(want) == [1, 2, 3, 4, 5]

    # TensorBoard: the event files.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars(metric)} == pytest.approx(want)

    # W&B offline: the history records of the run's transaction log.
    logs = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 2 and all(p.name == f"run-{ids['wandb']}.wandb" for p in logs)  # one run, two sessions
    assert {**wandb_history(logs[0], metric), **wandb_history(logs[1], metric)} == pytest.approx(want)

    # MLflow file store in <run>/mlruns.
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]
    history = {m.step: m.value for m in client.get_metric_history(run_id, metric)}
    assert history == pytest.approx(want)
    assert client.get_run(run_id).data.params["method.name"] == "srpo"

    # trackio's local database, read by trackio itself (its folder is fixed when it is imported).
    read = subprocess.run([sys.executable, "-c", (
        "import json; from trackio.sqlite_storage import SQLiteStorage as S; "
        f"print(json.dumps({{r['step']: r['{metric}'] for r in S.get_logs('srpo-test', 'trackers') if '{metric}' in r}}))")],
        env=env, capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stderr[-2000:]
    assert {int(k): v for k, v in json.loads(read.stdout.strip().splitlines()[-1]).items()} == pytest.approx(want)


def test_an_unknown_or_missing_tracker_fails_before_any_model(monkeypatch):
    from srpo.build import load_config
    from srpo.config import ConfigError
    import srpo.runs.trackers as trackers

    with pytest.raises(ConfigError, match="log.backends: unknown tracker 'comet'; valid: mlflow, tensorboard, trackio, wandb"):
        load_config(None, ["log.backends=[comet]"])
    monkeypatch.setitem(trackers.TRACKERS._caps, "wandb",
                        trackers.TrackerCapabilities(requires=("no_such_module_xyz", "srpo[wandb]")))
    with pytest.raises(ConfigError, match=r"log.backends: wandb is not installed; pip install 'srpo\[wandb\]'"):
        load_config(None, ["log.backends=[wandb]"])
    with pytest.raises(ConfigError, match="log.wandb_mode"):
        load_config(None, ["log.wandb_mode=sometimes"])


# ---------------------------------------------------------------------------- retrieval service

import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc=None, seconds: float = 120) -> dict:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return json.loads(r.read())
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} did not come up")


@pytest.fixture
def bm25_server(request):
    """``srpo retriever serve`` as a user starts it, on 127.0.0.1 and a free port."""
    corpus = getattr(request, "param", "synthetic_kb:n=40:seed=2")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "srpo.apps.cli", "retriever", "serve", "--corpus", corpus,
                             "--port", str(port)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        health = wait_healthy(f"http://127.0.0.1:{port}/health", proc)
        yield f"http://127.0.0.1:{port}/retrieve", corpus, health
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _queries_for(corpus: str) -> list[str]:
    from srpo.data import corpus_passages

    passages = corpus_passages(corpus)
    return [p.title for p in passages[:15]] + [" ".join(p.text.split()[:6]) for p in passages[-15:]] + ["", "zzzz qqqq"]


@pytest.mark.slow
@pytest.mark.parametrize("bm25_server", [
    "synthetic_kb:n=40:seed=2",
    pytest.param(str(SHARED / "hotpotqa_dev500_corpus.jsonl"),
                 marks=pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared/data")),
], indirect=True, ids=["synthetic_kb", "hotpotqa"])
def test_the_server_returns_what_the_in_process_index_returns(bm25_server):
    from srpo.data import corpus_passages
    from srpo.tasks.retrieval_service import HTTPRetriever
    from srpo.tasks.search import BM25Retriever

    url, corpus, health = bm25_server
    local = BM25Retriever(corpus_passages(corpus))
    assert health["passages"] == len(local.passages)
    remote = HTTPRetriever(url)
    queries = _queries_for(corpus)
    for k in (1, 3, 5):
        assert remote.search_many(queries, k) == local.search_many(queries, k)
    assert remote.search(queries[0], 3) == local.search(queries[0], 3)
    assert remote.stats == {"requests": 4, "retries": 0, "failures": 0, "timeouts": 0}
    # The raw API is Search-R1's: documents with "Title"\ntext contents, and scores on request.
    body = json.dumps({"queries": queries[:2], "topk": 2, "return_scores": True}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        result = json.loads(r.read())["result"]
    first = local.search_many_scored(queries[:1], 2)[0][0]
    assert result[0][0]["document"]["contents"] == f'"{first[0].title}"\n{first[0].text}'
    assert result[0][0]["score"] == pytest.approx(first[1])
    body = json.dumps({"queries": queries[:1]}).encode()  # no topk, no scores: the server default, bare documents
    with urllib.request.urlopen(urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})) as r:
        bare = json.loads(r.read())["result"][0]
    assert "score" not in bare[0] and [d["id"] for d in bare] == [p.pid for p in local.search(queries[0], 3)]


def test_search_r1_documents_parse_without_srpo_fields():
    from srpo.tasks.retrieval_service import passage_from

    assert passage_from({"document": {"id": "7", "contents": '"Paris"\nThe capital of France.'}, "score": 3.0}) == \
        __import__("srpo.tasks.search", fromlist=["Passage"]).Passage("7", "Paris", "The capital of France.")
    assert passage_from({"id": "8", "contents": "no title here"}).text == "no title here"


class _SlowApp:
    """A compatible server that does not answer until the test is done (a real uvicorn server in a
    thread, frozen)."""

    def __init__(self):
        import uvicorn
        from fastapi import FastAPI

        app = FastAPI()

        self.requests = 0

        @app.post("/retrieve")
        def retrieve(body: dict):
            self.requests += 1
            thawed = threading.Event()
            self.thaw = thawed
            thawed.wait(60)  # frozen: answers only when the test is done with it
            return {"result": [[] for _ in body["queries"]]}

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}/retrieve"
        return self

    def __exit__(self, *exc):
        if getattr(self, "thaw", None) is not None:
            self.thaw.set()
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_an_unreachable_or_slow_server_costs_the_tool_call_not_the_run():
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.tasks.rewards import task_reward
    from srpo.tasks.retrieval_service import HTTPRetriever, RetrieverUnavailable
    from srpo.tasks.search import synthetic_kb
    from srpo.rollout.builtin import BuiltinEngine
    from srpo.workflows import Runtime, build_workflow

    _, tasks = synthetic_kb(6, seed=2)
    nowhere = HTTPRetriever(f"http://127.0.0.1:{free_port()}/retrieve", timeout_s=0.5, retries=2, backoff_s=0.01)
    with pytest.raises(RetrieverUnavailable, match="after 3 tries"):
        nowhere.search("anything", 3)
    assert nowhere.stats == {"requests": 3, "retries": 2, "failures": 1, "timeouts": 0}

    wf = build_workflow("search", retriever=nowhere, max_turns=2)
    rt = Runtime(BuiltinEngine(ScriptedPolicies(lambda role, prompt: "<search>who</search>", wf.roles())), wf.default_role_specs(),
                 task_reward)
    results = rt.run(wf, [(f"e{i}", t) for i, t in enumerate(tasks[:3])])
    assert len(results) == 3 and all(r.info["tool_errors"] >= 1 for r in results)  # each search failed ...
    assert "workflow" not in rt.failures  # ... and the episodes went on
    assert nowhere.stats["failures"] == 1 + sum(r.info["tool_errors"] for r in results)

    with _SlowApp() as server:
        slow = HTTPRetriever(server.url, timeout_s=0.3, retries=1, backoff_s=0.01)
        with pytest.raises(RetrieverUnavailable, match="no answer within 0.3 s"):
            slow.search("anything", 3)
        # A server that does not answer costs the call its timeout once: a timeout is not retried
        # (a frozen server made each retry wait the whole timeout again).  Had the client waited
        # for the server, the call would have succeeded when the server thawed, at the end.
        assert server.requests == 1  # the server, too, saw one request: no retry reached it
        assert slow.stats == {"requests": 1, "retries": 0, "failures": 1, "timeouts": 1}


def test_a_run_config_names_a_server_instead_of_a_corpus():
    from srpo.build import load_config
    from srpo.config import ConfigError
    from srpo.build import retriever as build_retriever
    from srpo.tasks.retrieval_service import HTTPRetriever

    base = ROOT / "configs/search/search/srpo.yaml"
    cfg = load_config(base, ["task.corpus=''", "retriever.url=http://127.0.0.1:9/retrieve"])
    assert isinstance(build_retriever(cfg), HTTPRetriever)
    with pytest.raises(ConfigError, match="not both"):
        load_config(base, ["retriever.url=http://127.0.0.1:9/retrieve"])
    with pytest.raises(ConfigError, match="needs a corpus .* or a retrieval server"):
        load_config(base, ["task.corpus=''"])


@pytest.mark.slow
def test_a_retrieval_server_restarted_between_two_calls_is_reconnected_transparently():
    """The service is stopped and started again (a new process on the same port) between two calls
    of one client: the second call reaches the new server over a new connection, with no failure."""
    from srpo.tasks.retrieval_service import HTTPRetriever

    port = free_port()

    def serve():
        return subprocess.Popen([sys.executable, "-m", "srpo.apps.cli", "retriever", "serve", "--corpus",
                                 "synthetic_kb:n=40:seed=2", "--port", str(port)],
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)

    proc = serve()
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc)
        remote = HTTPRetriever(f"http://127.0.0.1:{port}/retrieve")
        query = _queries_for("synthetic_kb:n=40:seed=2")[0]
        first = remote.search(query, 3)
        proc.terminate()
        proc.wait(timeout=30)
        proc = serve()  # restarted: the client's pooled connection now leads nowhere
        wait_healthy(f"http://127.0.0.1:{port}/health", proc)
        assert remote.search(query, 3) == first and first
        assert remote.stats["failures"] == 0 and remote.stats["timeouts"] == 0, remote.stats
    finally:
        proc.terminate()
        proc.wait(timeout=30)
