"""Safe to expose: a run folder from someone else never runs code on ``srpo serve``/``srpo eval``,
and the servers hold against hostile clients (API key, Host names, JSON only, bounded bodies and
nesting, streams that never hold the event loop).  docs/security.md lists what each test guards."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

from helpers import HELPERS, ROOT  # noqa: E402
from helpers.runs import ENV, free_port, trained  # noqa: E402
from srpo.apps.cli import main  # noqa: E402
from srpo.runs import serving  # noqa: E402

DATA = ["--data", "synthetic_arithmetic:level=0:n=1:split=test", "-k", "1", "--max-new-tokens", "2"]


# ------------------------------------------------------------------ 1. a run folder never runs code

def _plant(run: Path, marker: Path, folder: Path, **changes) -> None:
    """Rewrite the newest checkpoint's config as an attacker would — naming code that writes
    ``marker`` when imported — and re-sign its manifest so that it verifies."""
    from srpo.runs.checkpoint import MANIFEST, latest_pointer
    from srpo.runs.fileio import sha256_file

    (folder / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "def solve(task, base_url):\n    return '1'\n"
        "def reward(task, answer):\n    return 1.0\n"
        "class Team:\n    pass\n")
    checkpoint = latest_pointer(run)
    config = json.loads((checkpoint / "config.json").read_text())
    for dotted, value in changes.items():
        node = config
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    (checkpoint / "config.json").write_text(json.dumps(config))
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"] = {p.relative_to(checkpoint).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)}
                         for p in sorted(checkpoint.rglob("*")) if p.is_file() and p.name != MANIFEST}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("victim") / "run"
    trained(run, ["run.steps=1"])
    return run


@pytest.fixture
def planted(finished_run, tmp_path, monkeypatch):
    """A copy of a finished run whose config names code; the code's folder is importable."""
    import shutil

    run = tmp_path / "downloaded"
    shutil.copytree(finished_run, run)
    monkeypatch.syspath_prepend(str(tmp_path))
    return run, tmp_path / "MARKER", tmp_path


def test_eval_refuses_a_folders_program_and_import_paths_unless_trusted(planted, capsys):
    run, marker, folder = planted
    program = f"{folder / 'evil.py'}:solve"
    _plant(run, marker, folder, **{"workflow.name": "openai_agent",
                                   "workflow.options": {"entry": program, "roles": ["solver"]}})
    assert main(["eval", "--model", str(run), *DATA]) == 2
    err = capsys.readouterr().err
    assert "workflow.options.entry" in err and "--trust-run-code" in err and not marker.exists()
    # The user's own workflow replaces the folder's: the weights are evaluated, nothing of the folder runs.
    assert main(["eval", "--model", str(run), "--workflow", "single", *DATA]) == 0
    assert not marker.exists()
    # Asked for on the command line, the folder's program is loaded.
    main(["eval", "--model", str(run), "--trust-run-code", *DATA])
    assert marker.read_text() == "ran"


def test_import_paths_in_a_folder_are_refused_or_dropped_never_imported(planted, capsys):
    run, marker, folder = planted
    _plant(run, marker, folder, **{"workflow.name": "evil:Team", "task.reward": "evil:reward",
                                   "rollout.engine": "evil:Team", "method.loss": "evil:reward",
                                   "log.backends": ["evil:Team"], "train.parallel": "evil:Team"})
    assert main(["eval", "--model", str(run), *DATA]) == 2
    err = capsys.readouterr().err
    for key in ("workflow.name", "task.reward", "rollout.engine"):
        assert key in err
    assert "method.loss" not in err and "train.parallel" not in err  # unused by eval: dropped, not imported
    assert not marker.exists() and "evil" not in sys.modules


def test_serve_serves_an_agent_programs_roles_without_the_program(planted):
    run, marker, folder = planted
    _plant(run, marker, folder, **{"workflow.name": "openai_agent",
                                   "workflow.options": {"entry": f"{folder / 'evil.py'}:solve",
                                                        "roles": ["solver"]}})
    proc = subprocess.Popen([sys.executable, "-m", "srpo.apps.cli", "serve", "--model", str(run), "--port", "0"],
                            env={**ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{folder}"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        said = []
        while not said or "http://" not in said[-1]:
            said.append(proc.stdout.readline())
            assert said[-1] or proc.poll() is None, "".join(said)
        url = re.search(r"(http://\S+/v1)", said[-1]).group(1)
        assert [m["id"] for m in httpx.get(f"{url}/models", timeout=30).json()["data"]] == ["solver"]
        reply = httpx.post(f"{url}/chat/completions", timeout=60,
                           json={"model": "solver", "messages": [{"role": "user", "content": "1+1?"}], "max_tokens": 2})
        assert reply.status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "without its agent program" in "".join(said) and not marker.exists()


# ------------------------------------------------------------------ 2. the servers against clients

@pytest.fixture(scope="module")
def guarded():
    """``serve_forever`` with an API key on a stand-in engine that streams 4,096-token replies."""
    proc = subprocess.Popen([sys.executable, str(HELPERS / "serve_worker.py"), "0", "--api-key", "sesame",
                             "--stream-tokens", "4096"], env=ENV, stdout=subprocess.PIPE, text=True)
    url = proc.stdout.readline().strip()
    assert url.startswith("http://"), url
    yield url, proc
    proc.terminate()
    proc.wait(timeout=30)


KEY = {"Authorization": "Bearer sesame"}


def _chat(**kw):
    return {"model": "solver", "messages": [{"role": "user", "content": "hi"}], **kw}


def _raw(url: str, head: str, body_chunks=()) -> bytes:
    """Send a request head (and body chunks, stopping when the server stops reading); the reply."""
    host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head.encode())
        try:
            for chunk in body_chunks:
                s.sendall(chunk)
        except OSError:  # the server refused and closed: what a bounded server does
            pass
        reply = b""
        try:
            while (data := s.recv(65536)):
                reply += data
        except OSError:
            pass
        return reply


def test_the_api_key_content_type_and_host_are_checked(guarded):
    url, _ = guarded
    assert httpx.post(f"{url}/chat/completions", json=_chat()).status_code == 401
    assert httpx.post(f"{url}/chat/completions", json=_chat(), headers={"Authorization": "Bearer sesamE"}).status_code == 401
    assert httpx.get(f"{url}/models").status_code == 401
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url, api_key="sesame", max_retries=0)
    assert client.chat.completions.create(model="solver", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4).choices[0].message.content
    # Anthropic's clients send the key as x-api-key; a refusal on /v1/messages is Anthropic-shaped
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=url[: -len("/v1")], api_key="sesame", max_retries=0)
    assert claude.messages.create(model="solver", max_tokens=4, messages=[{"role": "user", "content": "hi"}]).content
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url[: -len("/v1")], api_key="sesamE", max_retries=0).messages.create(
            model="solver", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    # JSON sent as text/plain (what a web page's simple request may do) is refused
    plain = httpx.post(f"{url}/chat/completions", content=json.dumps(_chat()),
                       headers={**KEY, "Content-Type": "text/plain"})
    assert plain.status_code == 415
    # a loopback server answers loopback Host names only (DNS rebinding)
    port = url.split(":")[2].split("/")[0]
    assert httpx.get(f"{url}/models", headers={**KEY, "Host": f"evil.example:{port}"}).status_code == 403
    assert httpx.get(f"{url}/models", headers={**KEY, "Host": f"localhost:{port}"}).status_code == 200


def test_oversized_deep_and_malformed_bodies_are_refused_plainly(guarded):
    url, _ = guarded
    path = "/v1/chat/completions"
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sesame\r\nContent-Type: application/json\r\n"
    # declared too long: refused from the header, before a byte of the body is sent
    reply = _raw(url, head + f"Content-Length: {100 << 20}\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 413")
    # chunked past the limit: the server stops reading at the limit
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
    reply = _raw(url, head + "Transfer-Encoding: chunked\r\n\r\n", [chunk] * 100)
    assert reply.startswith(b"HTTP/1.1 413")
    deep = "[" * 100_000 + "]" * 100_000
    for body, status in [(deep, 400), ("{not json", 400), ('{"model": "solver", "messages": 7}', 400)]:
        r = httpx.post(f"{url}/chat/completions", content=body, headers={**KEY, "Content-Type": "application/json"})
        assert r.status_code == status, (body[:20], r.text)
        assert "Traceback" not in r.text and "RecursionError" not in r.text and "JSONDecodeError" not in r.text


def _peak_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the server's peak memory from /proc")
def test_parallel_oversized_bodies_leave_the_servers_memory_bounded(guarded):
    url, proc = guarded
    before = _peak_rss_mib(proc.pid)
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sesame\r\n"
            "Content-Type: application/json\r\n")
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
    senders = [threading.Thread(target=_raw, args=(url, head + f"Content-Length: {100 << 20}\r\n\r\n", [b" " * (1 << 20)] * 100))
               for _ in range(8)]
    senders += [threading.Thread(target=_raw, args=(url, head + "Transfer-Encoding: chunked\r\n\r\n", [chunk] * 100))
                for _ in range(8)]
    for t in senders:
        t.start()
    for t in senders:
        t.join(timeout=120)
    grown = _peak_rss_mib(proc.pid) - before
    assert grown < 100, f"the server's peak memory grew by {grown:.0f} MiB under 16 oversized bodies"
    assert httpx.get(f"{url}/models", headers=KEY).status_code == 200  # and it still serves


def test_long_streams_never_hold_the_event_loop(guarded):
    url, _ = guarded

    def models_latency() -> float:
        start = time.perf_counter()
        assert httpx.get(f"{url}/models", headers=KEY, timeout=30).status_code == 200
        return time.perf_counter() - start

    idle = [models_latency() for _ in range(10)]
    streamed = []

    def stream():
        with httpx.stream("POST", f"{url}/chat/completions", headers=KEY, timeout=120,
                          json=_chat(stream=True, n=2, max_tokens=4096)) as r:
            streamed.append(sum(1 for line in r.iter_lines() if line.startswith("data: {")))

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    busy = []
    while any(t.is_alive() for t in threads):
        busy.append(models_latency())
    for t in threads:
        t.join()
    assert len(streamed) == 2 and min(streamed) > 4096  # every token left as a chunk of its own
    # Against this machine's own idle latency (measured above), not a fixed number of seconds.
    assert statistics.median(busy) <= statistics.median(idle) + 0.1, (idle, busy)


def test_incremental_decoding_is_linear_in_the_reply_and_exact():
    from srpo.gateway.streaming import TokenText
    from srpo.policies.tiny import byte_tokenizer

    tokenizer = byte_tokenizer()
    decoded = []

    class Counting:
        def decode(self, ids, **kw):
            decoded.append(len(ids))
            return tokenizer.decode(ids, **kw)

    text = "Héllo wörld — 你好 🙂, and so on.\n" * 100
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = TokenText(Counting(), stops=("STOP",))
    sent = "".join(stream.push(i) for i in ids)
    assert sent + stream.finish(text) == text
    assert sum(decoded) <= 8 * len(ids), "decoding re-read the reply (quadratic)"


# ------------------------------------------------------------------ 3. the retrieval server

def test_the_retriever_has_a_key_a_body_limit_and_no_docs_pages():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "srpo.apps.cli", "retriever", "serve", "--corpus",
                             "synthetic_kb:n=20:seed=0", "--port", str(port), "--api-key", "k"],
                            env=ENV, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:  # polled until it listens: no guess of how long the index takes to build
            try:
                if httpx.get(f"{url}/health", headers={"Authorization": "Bearer k"}).status_code == 200:
                    break
            except httpx.ConnectError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.05)
        from srpo.tasks.retrieval_service import HTTPRetriever

        assert len(HTTPRetriever(url, api_key="k").search("botanist born", 2)) == 2
        assert httpx.post(f"{url}/retrieve", json={"queries": ["a"]}).status_code == 401
        for page in ("/docs", "/openapi.json"):
            assert httpx.get(f"{url}{page}", headers={"Authorization": "Bearer k"}).status_code == 404
        head = (f"POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k\r\n"
                f"Content-Type: application/json\r\nContent-Length: {100 << 20}\r\n\r\n")
        assert _raw(url, head).startswith(b"HTTP/1.1 413")
        for body in ("{not json", "[" * 10_000 + "]" * 10_000):
            bad = httpx.post(f"{url}/retrieve", content=body,
                             headers={"Authorization": "Bearer k", "Content-Type": "application/json"})
            assert bad.status_code == 400 and "Expecting" not in bad.text and "Traceback" not in bad.text, bad.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ------------------------------------------------------------------ 4. the guard's own parts

def test_a_body_that_trickles_past_the_deadline_is_408_not_a_held_connection():
    sent = []

    async def app(scope, receive, send):  # never reached
        raise AssertionError("the app saw a request the guard should have refused")

    async def receive():
        await asyncio.sleep(0.01)  # one byte at a time, forever
        return {"type": "http.request", "body": b" ", "more_body": True}

    async def send(message):
        sent.append(message)

    guard = serving.GuardMiddleware(app, serving.Guard(body_deadline_s=0.3))
    scope = {"type": "http", "method": "POST", "headers": [(b"host", b"127.0.0.1:1"),
                                                           (b"content-type", b"application/json")]}
    asyncio.run(asyncio.wait_for(guard(scope, receive, send), 30))
    assert sent[0]["status"] == 408


def test_json_depth_counts_brackets_outside_strings():
    assert serving.json_depth(b'{"a": [1, {"b": "[[[[["}]}') == 3
    assert serving.json_depth(b'"[{\\"[["') == 0
    assert serving.json_depth(b"[" * 1000 + b"]" * 1000) == 1000


def test_an_exposed_server_without_a_key_says_so(capsys):
    serving.warn_if_exposed("0.0.0.0", "", "srpo serve")
    assert "reachable from other machines" in capsys.readouterr().err
    serving.warn_if_exposed("0.0.0.0", "k", "srpo serve")
    serving.warn_if_exposed("127.0.0.1", "", "srpo serve")
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------ 5. secrets stay out of run folders

def test_credentials_in_urls_never_reach_the_saved_config_or_the_lock(tmp_path, monkeypatch):
    from srpo.build import load_config
    from srpo.runs.secrets import redact
    from srpo.train import Trainer
    from helpers.runs import tiny, varied_reward

    uri = "https://alice:hunter2@mlflow.example.invalid/?token=s3cret&x=1"
    monkeypatch.setattr(sys, "argv", ["srpo", "train", "--set", f"log.mlflow_tracking_uri={uri}"])
    trainer = Trainer(load_config(None, tiny(tmp_path, ["run.steps=1", f"log.mlflow_tracking_uri={uri}"])),
                      progress=False, reward_fn=varied_reward)
    try:
        lock = (tmp_path / ".lock").read_text()
        assert "log.mlflow_tracking_uri" in lock  # the lock holds the command line
        trainer.fit()
    finally:
        trainer.close()
    saved = (tmp_path / "checkpoints" / "step_0000001" / "config.json").read_text()
    for text in (lock, saved):
        assert "hunter2" not in text and "s3cret" not in text
    assert "alice:***@mlflow.example.invalid/?token=***&x=1" in saved
    assert redact("see http://h:1/retrieve and ftp://u:p@h/") == "see http://h:1/retrieve and ftp://u:***@h/"


def test_agent_workers_inherit_no_secret_unless_the_config_names_it(monkeypatch):
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.rollout.builtin import BuiltinEngine
    from srpo.tasks.kinds import task_kind
    from srpo.tasks.math import synthetic_arithmetic
    from srpo.workflows.builtins import build_workflow
    from srpo.workflows.runtime import Runtime

    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("MY_TOOL_KEY", "tool_secret")
    answers = {}
    for allow in ([], ["MY_TOOL_KEY"]):
        agent = build_workflow("openai_agent", entry=f"{HELPERS / 'gateway_teams.py'}:reports_its_environment",
                               roles=["solver"], max_new_tokens=4, env=allow, max_workers=1)
        runtime = Runtime(BuiltinEngine(ScriptedPolicies(lambda role, prompt: "4", ["solver"])),
                          agent.default_role_specs(), task_kind("math").grade)
        (result,) = runtime.run(agent, [("e0", synthetic_arithmetic(1, level=0, seed=0)[0])])
        assert not runtime.failures, runtime.first_traceback
        answers[tuple(allow)] = result.answer
    home = f"HOME={os.environ.get('HOME', '-')}"
    assert answers[()] == f"HF_TOKEN=-,MY_TOOL_KEY=-,{home}"
    assert answers[("MY_TOOL_KEY",)] == f"HF_TOKEN=-,MY_TOOL_KEY=tool_secret,{home}"


def test_checkpoint_permissions_read_the_umask_without_setting_it(monkeypatch):
    """os.umask is process-wide: setting it for a moment changes other threads' files."""
    from srpo.runs import checkpoint

    before = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", lambda mask: pytest.fail("os.umask was called"))
        assert checkpoint._default_mode() == 0o750
    finally:
        monkeypatch.undo()
        os.umask(before)


def test_resume_and_warm_starts_from_a_planted_folder_run_nothing(planted, capsys):
    """--resume reads the folder's config only to compare it with the user's; an ``srpo sft``
    output is evaluated like a run folder — neither imports what the folder names."""
    import shutil

    from srpo.build import load_config
    from srpo.runs.checkpoint import CheckpointError, latest_pointer
    from srpo.train import Trainer
    from helpers.runs import tiny, varied_reward

    run, marker, folder = planted
    _plant(run, marker, folder, **{"workflow.name": "evil:Team", "task.reward": "evil:reward"})
    trainer = Trainer(load_config(None, tiny(run)), progress=False, reward_fn=varied_reward)
    try:
        with pytest.raises(CheckpointError):
            trainer.resume()  # the folder's run is another run's: refused, not imported
    finally:
        trainer.close()
    warm = folder / "warm"
    shutil.copytree(latest_pointer(run) / "model", warm / "model")
    (warm / "sft.json").write_text("{}")
    (warm / "config.json").write_text((latest_pointer(run) / "config.json").read_text())
    assert main(["eval", "--model", str(warm), *DATA]) == 2
    assert "--trust-run-code" in capsys.readouterr().err
    assert not marker.exists() and "evil" not in sys.modules


# Spellings of "a module of the folder" that are not a registered name: none may be imported.
HOSTILE_SPELLINGS = {"evil-x:Team": "evil-x", "evil :Team": "evil ", "1evil:Team": "1evil", "evil!:Team": "evil!",
                     "evil:Team extra": "evil", " evil:Team": " evil", "evil:Te-am": "evil"}
# Strict import paths that look like data (a synthetic source, a hub id, a file URL): imported only
# when trusted, so the trust check must flag them wherever a registry reads them.
# (``evil.py:Team`` is the strict path of package ``evil``'s module ``py``: flagged, as any is.)
DATA_LOOKALIKES = ("synthetic_evil:Team", "hub:Team", "file:Team", "evil.sub:Team", "evil.py:Team")


def test_names_are_classified_from_the_string_before_anything_is_imported(tmp_path, monkeypatch):
    """Every registry refuses each hostile spelling with the rule, and no module of the folder is
    imported (each would write the marker); the same spellings are config errors, not imports."""
    from srpo.registry import IMPORT_PATH_RULE, RegistryError, classify_name
    from srpo.methods import METHODS
    from srpo.objective import LOSSES
    from srpo.rollout.engine import ENGINES
    from srpo.runs.trackers import TRACKERS
    from srpo.tasks.kinds import TASK_KINDS
    from srpo.workflows import WORKFLOWS
    from srpo.gateway.parsers import TOOL_PARSERS

    marker = tmp_path / "MARKER"
    for module in set(HOSTILE_SPELLINGS.values()):
        (tmp_path / f"{module}.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text({module!r})\n"
                                              "class Team:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for spelling in HOSTILE_SPELLINGS:
        with pytest.raises(RegistryError, match="neither a registered name nor an import path"):
            classify_name(spelling)
        for registry in (LOSSES, METHODS, WORKFLOWS, TASK_KINDS, ENGINES, TRACKERS, TOOL_PARSERS):
            with pytest.raises(RegistryError) as err:
                registry.resolve(spelling)
            assert IMPORT_PATH_RULE in str(err.value), (registry.what, spelling)
    assert not marker.exists()
    assert classify_name("srpo") == "name" and classify_name("pkg.mod:attr.sub") == "import path"


@pytest.mark.parametrize("key", ["workflow.name", "task.reward", "rollout.engine", "method.loss", "method.name",
                                 "log.backends[0]", "workflow.roles.solver.tool_parser", "task.kind"])
def test_the_trust_check_flags_data_lookalike_import_paths_in_every_code_field(key):
    from srpo.runs.trust import code_named

    for value in DATA_LOOKALIKES:
        node: dict = {}
        config = node
        parts = key.replace("[0]", "").split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = [value] if key.endswith("[0]") else value
        assert key in code_named(config), (key, value)
    # A data source keeps its data spellings: a hub id or a synthetic source is not code.
    assert code_named({"task": {"train": {"source": "synthetic_parts"}, "eval": [{"source": "hub:gsm8k"}]}}) == {}


def test_no_writer_follows_a_link_planted_in_a_folder(finished_run, tmp_path):
    """``srpo report`` into a downloaded folder whose report.md, a plot or report/ is a link to the
    user's file: refused, naming the link, and the user's file is untouched; so are eval outputs
    and the atomic writer's temporary name."""
    import shutil

    from srpo.apps.report import write_summary
    from srpo.evaluation import write_results
    from srpo.runs.fileio import LinkRefused, write_text_atomic

    victim = tmp_path / "bashrc"
    victim.write_text("the user's file\n")
    for plant in ("report.md", "report/reward_accuracy.png", "report"):
        run = tmp_path / f"downloaded-{plant.replace('/', '-')}"
        shutil.copytree(finished_run, run)
        shutil.rmtree(run / "report", ignore_errors=True)
        (run / "report.md").unlink(missing_ok=True)
        target = victim if plant != "report" else tmp_path
        if "/" in plant:
            (run / "report").mkdir()
        (run / plant).symlink_to(target)
        with pytest.raises(LinkRefused, match="symbolic link srpo did not make"):
            write_summary(run)
        assert victim.read_text() == "the user's file\n"
    out = tmp_path / "eval"
    out.mkdir()
    (out / "eval.json").symlink_to(victim)
    with pytest.raises(LinkRefused):
        write_results({"k": 1, "datasets": {}, "macro": {"avg@1": 0.0, "pass@1": 0.0}}, out, "eval")
    # A planted file or link at the writer's temporary name is never opened.
    dest = tmp_path / "notes.md"
    (tmp_path / f".notes.md.tmp{os.getpid()}").symlink_to(victim)
    with pytest.raises(LinkRefused, match="not srpo's temporary file"):
        write_text_atomic(dest, "x")
    assert victim.read_text() == "the user's file\n" and not dest.exists()


def test_reports_escape_what_they_copy_and_name_a_wrong_typed_metric(finished_run, tmp_path, capsys):
    import shutil

    from srpo.apps.report import write_summary

    run = tmp_path / "downloaded"
    shutil.copytree(finished_run, run)
    (run / "eval_before.md").write_text("| x |\n<script>alert(1)</script><img src=x onerror=alert(2)>\n")
    report = write_summary(run).read_text()
    assert "<script>" not in report and "&lt;script&gt;alert(1)&lt;/script&gt;" in report and "<img" not in report
    rows = (run / "metrics.jsonl").read_text().splitlines()
    row = json.loads(rows[0])
    row["time/step_s"] = "1; rm -rf ~"
    (run / "metrics.jsonl").write_text("\n".join([json.dumps(row), *rows[1:]]) + "\n")
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "row 1: 'time/step_s' is str" in err[0] and "Traceback" not in err[0]


def test_a_retriever_url_from_a_folder_never_gets_the_users_key(planted, capsys, monkeypatch):
    """``srpo eval`` of a folder whose config names a retriever: the URL is dropped (said on stderr),
    so nothing — the user's SRPO_RETRIEVER_API_KEY least of all — is sent there; the user's own URL is kept."""
    from srpo.apps.cli import drop_folder_retriever

    saved = {"retriever": {"url": "http://attacker.example:8000/retrieve?token=abc"}}
    data = {"retriever": {"url": saved["retriever"]["url"]}}
    note = drop_folder_retriever(saved, data, user_url="")
    assert data["retriever"]["url"] == "" and "--retriever-url" in note and "token=abc" not in note
    mine = {"retriever": {"url": "http://127.0.0.1:9/retrieve"}}
    assert drop_folder_retriever(saved, mine, user_url="http://127.0.0.1:9/retrieve") is None
    assert mine["retriever"]["url"] == "http://127.0.0.1:9/retrieve"
    run, marker, folder = planted
    _plant(run, marker, folder, **{"retriever.url": "http://127.0.0.1:9/retrieve"})
    monkeypatch.setenv("SRPO_RETRIEVER_API_KEY", "the-users-secret")
    assert main(["eval", "--model", str(run), *DATA]) == 0
    err = capsys.readouterr().err
    assert "the folder's retriever.url" in err and "is not used" in err


def test_files_a_folder_names_stay_inside_it(planted, tmp_path, capsys):
    """A folder's chat template outside the folder (a path, or a link inside it that points out)
    is refused unless trusted; one inside the folder is read."""
    run, marker, folder = planted
    outside = tmp_path / "secrets.jinja"
    outside.write_text("{{ 'the users private file' }}")
    _plant(run, marker, folder, **{"model.chat_template": str(outside)})
    assert main(["eval", "--model", str(run), *DATA]) == 2
    err = capsys.readouterr().err
    assert "names files outside itself" in err and "model.chat_template" in err
    (run / "link.jinja").symlink_to(outside)
    _plant(run, marker, folder, **{"model.chat_template": "link.jinja"})
    assert main(["eval", "--model", str(run), *DATA]) == 2
    assert "names files outside itself" in capsys.readouterr().err
    from srpo.runs.trust import files_outside

    inside = run / "template.jinja"
    inside.write_text("x")
    assert files_outside({"model": {"chat_template": str(inside)}}, {"model": {"chat_template": str(inside)}}, run) == {}


def test_a_workers_url_is_not_in_its_exec_environment_where_siblings_could_read_it():
    """The token in a worker's base URL reaches it over its private pipe and is set inside the
    process (OPENAI_BASE_URL for its clients): /proc/<pid>/environ — readable by the user's other
    processes, a sibling worker among them — does not hold it."""
    from srpo.policies.scripted import ScriptedPolicies
    from srpo.rollout.builtin import BuiltinEngine
    from srpo.tasks.kinds import task_kind
    from srpo.tasks.math import synthetic_arithmetic
    from srpo.workflows.builtins import build_workflow
    from srpo.workflows.runtime import Runtime

    agent = build_workflow("openai_agent", entry=f"{HELPERS / 'gateway_teams.py'}:configured_from_env",
                           roles=["solver"], max_new_tokens=4, max_workers=1)
    runtime = Runtime(BuiltinEngine(ScriptedPolicies(lambda role, prompt: "4", ["solver"])),
                      agent.default_role_specs(), task_kind("math").grade)
    (result,) = runtime.run(agent, [("e0", synthetic_arithmetic(1, level=0, seed=0)[0])])
    assert not runtime.failures, runtime.first_traceback  # its env-configured client reached its episode
    (worker,) = agent._pool._idle
    token = worker.url.split("/e/")[1].split("/")[0]
    environ = Path(f"/proc/{worker.process.pid}/environ").read_bytes()
    assert token.encode() not in environ and b"OPENAI_BASE_URL" not in environ
    agent._pool.close()


def _code_fields() -> list[str]:
    """The fields of docs/security.md's table "Every field that can name code"."""
    text = (ROOT / "docs" / "security.md").read_text().split("## Every field that can name code", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", text, re.M)]


@pytest.mark.parametrize("field", _code_fields())
def test_every_field_in_the_security_table_refuses_hostile_spellings_without_importing(field, tmp_path, monkeypatch):
    """Through docs/security.md's table: a non-strict spelling in a registry field is a config error
    naming the field and the rule, and nothing is imported; a strict import path in any of them —
    programs included — is what the trust check flags in a folder's config."""
    import copy

    from srpo.build import config_from_dict
    from srpo.config import ConfigError, apply_overrides
    from srpo.runs.trust import code_named

    marker = tmp_path / "MARKER"
    (tmp_path / "evil-x.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    dotted = field.replace("<role>", "solver").removesuffix("[]")
    listed = field.endswith("[]")
    programs = {"workflow.options.entry", "workflow.options.python", "sft.script"}
    if dotted not in programs:
        data = copy.deepcopy({"model": {"name": "tiny-llama"}, "task": {"train": {"source": "synthetic_arithmetic", "n": 4}}})
        apply_overrides(data, {dotted: ["evil-x:Team"] if listed else "evil-x:Team"})
        with pytest.raises(ConfigError, match=re.escape(dotted)):
            config_from_dict(data)
        assert not marker.exists()
    saved: dict = {}
    node = saved
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = ["evilpkg.mod:Team"] if listed else "evilpkg.mod:Team"
    assert any(key.startswith(dotted) for key in code_named(saved)), (field, code_named(saved))
