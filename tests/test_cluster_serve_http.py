"""`hetforge cluster serve MODEL --cluster FILE --http`: a real Ray Serve endpoint in a subprocess (a local Ray
cluster of two node processes on loopback, two replicas), real HTTP requests from threads, clean exit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from test_cluster_ray import cluster_file

# Ray Serve and its HTTP stack come with the cluster extra (`make install`, and CI, install it); without it
# `cluster serve --http` refuses to start, so there is nothing to test.
pytest.importorskip("ray.serve", reason="Ray Serve is not installed: it comes with the cluster extra "
                                        "(`make install`, or pip install -e '.[cluster]')")
pytest.importorskip("starlette", reason="Ray Serve's HTTP server (starlette) is not installed: pip install -e "
                                        "'.[cluster]' brings it")

PROMPTS = ["Once upon a time", "The little girl", "In the morning the", "He looked at the", "She said that",
           "The dog ran"]
MAX_NEW = 6
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_ADDRESS": ""}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetforge.cli.main", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def post(url: str, body: bytes, timeout: float = 300) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def session_processes(sid: int) -> list[str]:
    """Processes still alive in the server's session (its Ray head, node processes, workers, actors)."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,stat=,args="], capture_output=True, text=True).stdout
    rows = [ln.split(None, 3) for ln in out.splitlines()]
    return [" ".join(r) for r in rows if len(r) >= 3 and r[1] == str(sid) and not r[2].startswith("Z")]


def test_http_endpoint_two_replicas_serve_concurrent_requests_with_single_node_tokens_and_exit_cleanly(tmp_path):
    from hetforge.models.zoo import load_model
    from hetforge.runtime import Engine, SamplingParams

    path = cluster_file(tmp_path, "two", ["a", "b"])
    port = free_port()
    # --max-batch 3: a replica holds at most 3 requests, so 6 at once must use both replicas
    proc = subprocess.Popen([sys.executable, "-m", "hetforge.cli.main", "cluster", "serve", "demo", "--cluster",
                             str(path), "--http", "--port", str(port), "--replicas", "2", "--max-batch", "3",
                             "--max-requests", str(len(PROMPTS)), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=True)
    lines: list[str] = []
    ready = threading.Event()

    def read_err():
        for ln in proc.stderr:
            lines.append(ln)
            if ln.startswith("serving demo on "):
                ready.set()

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    try:
        single = Engine(load_model("demo"), soc="host")  # the reference, while the server starts
        want = [single.generate(p, SamplingParams(max_new_tokens=MAX_NEW)).tokens for p in PROMPTS]
        assert ready.wait(240), "".join(lines)[-3000:]
        url = f"http://127.0.0.1:{port}/generate"

        code, doc = post(url, b'{"prompt": "Once upon', timeout=60)  # bad JSON: 400, one line, server keeps going
        assert code == 400 and "not JSON" in doc["error"] and "\n" not in doc["error"]
        code, doc = post(url, json.dumps({"prompt": "hi", "max_new_tokens": 0}).encode(), timeout=60)
        assert code == 400 and "max_new_tokens" in doc["error"]

        results: list[tuple[int, dict] | None] = [None] * len(PROMPTS)

        def ask(i: int) -> None:
            body = {"prompt": PROMPTS[i], "max_new_tokens": MAX_NEW, "temperature": 0, "seed": 1}
            results[i] = post(url, json.dumps(body).encode())

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        out, _ = proc.communicate(timeout=120)  # --max-requests: it stops by itself
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, "".join(lines)[-3000:]
    assert all(r is not None and r[0] == 200 for r in results), results
    got = [r[1] for r in results]  # type: ignore[index]
    assert [g["tokens"] for g in got] == want  # greedy: the single-node Engine's tokens
    assert [g["text"] for g in got] == [single.tokenizer.decode(w) for w in want]
    assert {g["replica"]["index"] for g in got} == {0, 1}  # both replicas served
    assert {tuple(g["replica"]["nodes"]) for g in got} == {("a",), ("b",)}
    assert all(g["timing"]["timing"] == "measured" and g["timing"]["server_s"] > 0
               and 1 <= g["timing"]["batch_size"] <= 3 for g in got)
    summary = json.loads(out)  # --json: one document, after shutdown
    assert summary["served"] == len(PROMPTS) and summary["stopped_by"] == "max-requests"
    assert set(summary["served_per_replica"]) == {"0", "1"} and summary["tokens"] == MAX_NEW * len(PROMPTS)
    deadline = time.monotonic() + 30  # Ray's head, node processes and Serve's actors are gone
    while session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert session_processes(proc.pid) == []


def test_http_port_in_use_or_invalid_is_one_line_and_exit_2(tmp_path):
    path = cluster_file(tmp_path, "two", ["a", "b"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        r = cli("cluster", "serve", "demo", "--cluster", str(path), "--http", "--port", str(busy))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "already in use" in r.stderr, r.stderr
    assert r.stdout == ""
    r = cli("cluster", "serve", "demo", "--cluster", str(path), "--http", "--port", "70000")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--port must be 1..65535" in r.stderr, r.stderr
    r = cli("cluster", "serve", "demo", "--cluster", str(path))
    assert r.returncode == 2 and "either --requests FILE or --http" in r.stderr


def test_parse_request_checks_every_field():
    from hetforge.cluster.http_serve import parse_request
    from hetforge.errors import UsageError

    ok = parse_request(b'{"prompt": "hi", "max_new_tokens": 4, "temperature": 0.5, "seed": 7}')
    assert ok["prompt"] == "hi" and ok["params"].max_new_tokens == 4 and ok["params"].seed == 7
    assert parse_request(b'{"prompt": "hi"}')["params"].temperature == 0.0
    for body, word in [(b"{", "not JSON"), (b"[1]", "JSON object"), (b'{"prompt": ""}', "prompt"),
                       (b'{"prompt": "x", "max_new_tokens": true}', "max_new_tokens"),
                       (b'{"prompt": "x", "temperature": -1}', "temperature"),
                       (b'{"prompt": "x", "seed": 1.5}', "seed"), (b'{"prompt": "x", "top_k": 3}', "unknown"),
                       (b"\xff", "not JSON")]:
        with pytest.raises(UsageError, match=word):
            parse_request(body)

