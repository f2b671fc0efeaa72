"""KForge model registry and the LLM path, against a local OpenAI-compatible server on loopback.

The server replays the replies in tests/data/kforge_replay.json (labelled replayed: written for this test,
no live model is called); the real ``openai`` client talks HTTP to it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hetforge.errors import HetforgeError
from hetforge.kforge import harness, loop, platforms, problems, providers

DATA = Path(__file__).parent / "data" / "kforge_replay.json"
HETFORGE = [sys.executable, "-m", "hetforge.cli.main"]


@pytest.fixture
def replay_server():
    replay = json.loads(DATA.read_text())
    assert replay["label"] == "replayed"
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"path": self.path, "body": body})
            r = replay["replies"][min(len(seen), len(replay["replies"])) - 1]
            out = json.dumps({"id": f"replay-{len(seen)}", "object": "chat.completion", "created": 0,
                              "model": body["model"], "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                  "role": "assistant", "content": r["content"]}}],
                              "usage": {"prompt_tokens": r["prompt_tokens"],
                                        "completion_tokens": r["completion_tokens"],
                                        "total_tokens": r["prompt_tokens"] + r["completion_tokens"]}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield srv.server_address[1], seen, replay
    srv.shutdown()


def _provider_file(tmp_path, name, port, timeout=10, retries=0) -> Path:
    f = tmp_path / "providers.json"
    f.write_text(json.dumps({"providers": {name: {"kind": "openai", "model": "replayed-fixture",
                                                   "base_url": f"http://127.0.0.1:{port}/v1", "timeout_s": timeout,
                                                   "max_retries": retries, "price_in_per_mtok": 1.0,
                                                   "price_out_per_mtok": 2.0}}}))
    return f


def test_replayed_llm_loop_fixes_a_build_error_from_the_fed_back_error(replay_server, tmp_path):
    port, seen, replay = replay_server
    prov = providers.get("replay", _provider_file(tmp_path, "replay", port))
    cfg = harness.Config(trials=2, threads=1, warmup=1, reps=5, budget_s=0.2, flush_bytes=1 << 20,
                         compile_baseline=False, cache=tmp_path / "cache")
    usage = providers.Usage()
    res = loop.solve(problems.resolve("relu")[0], platforms.get("cpp"), prov, 2, cfg, tmp_path / "run", usage,
                     1e12, 1e12)
    assert len(seen) == 2 and seen[0]["path"] == "/v1/chat/completions"
    first = seen[0]["body"]["messages"][1]["content"]
    assert "def get_inputs" in first and "C++/OpenMP" in first and "load_inline" in first
    second = seen[1]["body"]["messages"][1]["content"]
    assert "It failed: build failed" in second  # round 1's compile error went back to the model
    assert [r["correct"] for r in res.rounds] == [False, True] and res.correct and res.best_round == 2
    rs = replay["replies"]
    assert usage.tokens_in == rs[0]["prompt_tokens"] + rs[1]["prompt_tokens"]
    assert usage.cost_usd == pytest.approx((usage.tokens_in * 1.0 + usage.tokens_out * 2.0) / 1e6)
    assert (tmp_path / "run" / "relu" / "round_1" / "reply.md").read_text().startswith("Here is a fused")


def test_unconfigured_provider_is_one_line_exit_1(tmp_path):
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path), HETFORGE_KFORGE_CACHE=str(tmp_path / "c"))
    env.pop("OPENAI_API_KEY", None)
    r = subprocess.run([*HETFORGE, "kforge", "run", "relu", "--provider", "nosuch"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 1 and "provider 'nosuch' is not configured" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_unreachable_provider_fails_within_its_timeout():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    cfg = providers.ProviderConfig("dead", "openai", "m", f"http://127.0.0.1:{port}/v1", None, 2.0, 1)
    prov = providers.OpenAICompatible(cfg, "none")
    t0 = time.monotonic()
    with pytest.raises(HetforgeError, match="provider 'dead' unreachable .* after 2 tries"):
        prov.generate(providers.GenRequest(problems.resolve("relu")[0], "cpp", "s", "p"))
    assert time.monotonic() - t0 < 30


def test_provider_file_and_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
    monkeypatch.setenv("HETFORGE_KFORGE_MODEL", "some-model")
    f = tmp_path / "p.toml"
    f.write_text('[providers.local]\nkind = "openai"\nmodel = "qwen"\nbase_url = "http://127.0.0.1:1/v1"\n')
    cfgs = providers.load_configs(f)
    assert {"offline", "anthropic", "local"} <= set(cfgs) and cfgs["local"].model == "qwen"
    assert isinstance(providers.get("anthropic", f), providers.AnthropicProvider)
    f.write_text('[providers.bad]\nkind = "openai"\nmodle = "x"\n')
    with pytest.raises(HetforgeError, match="provider 'bad'"):
        providers.load_configs(f)
