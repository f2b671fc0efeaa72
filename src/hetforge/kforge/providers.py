"""The model registry: one interface over OpenAI-compatible endpoints, Anthropic's API and the offline generator.

Configuration comes from a file (JSON or TOML; ``--providers FILE``, ``$HETFORGE_KFORGE_PROVIDERS`` or
``~/.config/hetforge/kforge.{json,toml}``) mapping a name to ``kind`` (openai, anthropic, offline),
``model``, ``base_url``, ``api_key_env``, ``timeout_s``, ``max_retries``, ``max_tokens`` and prices per
million tokens; or from the environment for the built-in names ``openai`` (``OPENAI_API_KEY``,
``OPENAI_BASE_URL``, ``HETFORGE_KFORGE_MODEL``) and ``anthropic`` (``ANTHROPIC_API_KEY``,
``HETFORGE_KFORGE_MODEL``). ``offline`` always exists and needs no network.
"""

from __future__ import annotations

import json
import os
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetforge.errors import HetforgeError, UsageError
from hetforge.kforge import offline
from hetforge.kforge.agents import Advice
from hetforge.kforge.harness import Attempt
from hetforge.kforge.problems import Problem


@dataclass
class GenRequest:
    problem: Problem
    platform: str
    system: str
    prompt: str
    advice: list[Advice] = field(default_factory=list)
    last: Attempt | None = None
    round: int = 1


@dataclass
class Reply:
    text: str
    tokens_in: int = 0
    tokens_out: int = 0
    cost_usd: float = 0.0
    seconds: float = 0.0
    done: bool = False  # the provider has nothing new to offer (offline search exhausted)
    note: str = ""


@dataclass
class ProviderConfig:
    name: str
    kind: str
    model: str = ""
    base_url: str | None = None
    api_key_env: str | None = None
    timeout_s: float = 120.0
    max_retries: int = 2
    max_tokens: int = 8192
    price_in_per_mtok: float = 0.0
    price_out_per_mtok: float = 0.0


class Provider:
    name = "provider"

    def generate(self, req: GenRequest) -> Reply:
        raise NotImplementedError


class Usage:
    """Token and cost accounting over a run."""

    def __init__(self):
        self.calls = 0
        self.tokens_in = 0
        self.tokens_out = 0
        self.cost_usd = 0.0

    def add(self, r: Reply) -> None:
        self.calls += 1
        self.tokens_in += r.tokens_in
        self.tokens_out += r.tokens_out
        self.cost_usd += r.cost_usd

    def to_dict(self) -> dict:
        return {"calls": self.calls, "tokens_in": self.tokens_in, "tokens_out": self.tokens_out,
                "cost_usd": self.cost_usd}


class OpenAICompatible(Provider):
    """Any OpenAI-compatible chat endpoint (vLLM, llama.cpp server, Ollama, hosted APIs) via the ``openai`` client."""

    def __init__(self, cfg: ProviderConfig, api_key: str):
        import openai

        self._connect(openai, openai.OpenAI, cfg, api_key, "api.openai.com")

    def _connect(self, api: Any, client: Any, cfg: ProviderConfig, api_key: str, host: str) -> None:
        self.cfg, self.name, self._api, self._host = cfg, cfg.name, api, host
        self.client = client(api_key=api_key, base_url=cfg.base_url, timeout=cfg.timeout_s,
                             max_retries=cfg.max_retries)

    def _request(self, call: Callable[[], Any]) -> Any:
        """``call()`` with the client library's connection, timeout and HTTP errors as one-line errors."""
        api = self._api
        try:
            return call()
        except (api.APIConnectionError, api.APITimeoutError) as e:
            raise HetforgeError(f"provider '{self.name}' unreachable at {self.cfg.base_url or self._host} "
                                f"after {self.cfg.max_retries + 1} tries (timeout {self.cfg.timeout_s:g} s): "
                                f"{type(e).__name__}") from None
        except api.APIStatusError as e:
            raise HetforgeError(f"provider '{self.name}' refused the request: HTTP {e.status_code}") from None

    def generate(self, req: GenRequest) -> Reply:
        t0 = time.perf_counter()
        r = self._request(lambda: self.client.chat.completions.create(
            model=self.cfg.model, max_tokens=self.cfg.max_tokens,
            messages=[{"role": "system", "content": req.system}, {"role": "user", "content": req.prompt}]))
        u = r.usage
        tin, tout = (u.prompt_tokens, u.completion_tokens) if u else (0, 0)
        return Reply(r.choices[0].message.content or "", tin, tout, self._cost(tin, tout), time.perf_counter() - t0)

    def _cost(self, tin: int, tout: int) -> float:
        return (tin * self.cfg.price_in_per_mtok + tout * self.cfg.price_out_per_mtok) / 1e6


class AnthropicProvider(OpenAICompatible):
    """Anthropic's Messages API via the ``anthropic`` client."""

    def __init__(self, cfg: ProviderConfig, api_key: str):
        import anthropic

        self._connect(anthropic, anthropic.Anthropic, cfg, api_key, "api.anthropic.com")

    def generate(self, req: GenRequest) -> Reply:
        t0 = time.perf_counter()
        r = self._request(lambda: self.client.messages.create(
            model=self.cfg.model, max_tokens=self.cfg.max_tokens, system=req.system,
            messages=[{"role": "user", "content": req.prompt}]))
        text = "".join(getattr(b, "text", "") for b in r.content)
        tin, tout = r.usage.input_tokens, r.usage.output_tokens
        return Reply(text, tin, tout, self._cost(tin, tout), time.perf_counter() - t0)


class OfflineProvider(Provider):
    """No network: the offline generator, searching its tunables with the analysis agent's advice."""

    name = "offline"

    def __init__(self):
        self.state: dict[str, dict] = {}

    def generate(self, req: GenRequest) -> Reply:
        if req.platform != "cpp":
            raise HetforgeError(f"the offline provider writes C++/OpenMP only (platform 'cpp'), not "
                                f"'{req.platform}'; configure an LLM provider for other platforms")
        st = self.state.setdefault(req.problem.name, {"tried": [], "results": [], "ep": None})
        if st["tried"] and req.last is not None:
            st["results"].append(req.last)
        if st["ep"] is None:
            try:
                st["ep"] = offline.capture(req.problem)
            except offline.Unsupported as e:
                return Reply(f"Cannot write this kernel: {e}", done=True, note=str(e))
        if not st["tried"]:
            tun = offline.Tunables()
        else:
            ok = [(a.time_s, t) for t, a in zip(st["tried"], st["results"], strict=False) if a.correct and a.time_s
                  and not a.flagged]
            best = min(ok, key=lambda x: x[0])[1] if ok else st["tried"][0]
            knobs = [k for a in req.advice for k in a.knobs]
            tun = offline.next_tunables(st["tried"], best, knobs, offline.has_gemm(st["ep"]))
            if tun is None:
                return Reply("The tunable search is exhausted.", done=True, note="search exhausted")
        st["tried"].append(tun)
        try:
            code = offline.generate(req.problem, tun, st["ep"])
        except offline.Unsupported as e:
            return Reply(f"Cannot write this kernel: {e}", done=True, note=str(e))
        return Reply(f"Fused kernel, tunables {tun.key()}.\n```python\n{code}```\n", note=tun.key())


def config_path(explicit: Path | None = None) -> Path | None:
    if explicit is not None:
        if not explicit.is_file():
            raise UsageError(f"provider file '{explicit}' does not exist")
        return explicit
    env = os.environ.get("HETFORGE_KFORGE_PROVIDERS")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CONFIG_HOME", os.path.expanduser("~/.config"))) / "hetforge"
    return next((p for p in (base / "kforge.toml", base / "kforge.json") if p.is_file()), None)


def load_configs(path: Path | None = None) -> dict[str, ProviderConfig]:
    """Configured providers: the file's entries over the environment's built-ins."""
    out: dict[str, ProviderConfig] = {"offline": ProviderConfig("offline", "offline")}
    model = os.environ.get("HETFORGE_KFORGE_MODEL", "")
    if os.environ.get("OPENAI_API_KEY") or os.environ.get("OPENAI_BASE_URL"):
        out["openai"] = ProviderConfig("openai", "openai", model, os.environ.get("OPENAI_BASE_URL"), "OPENAI_API_KEY")
    if os.environ.get("ANTHROPIC_API_KEY"):
        out["anthropic"] = ProviderConfig("anthropic", "anthropic", model, None, "ANTHROPIC_API_KEY")
    p = config_path(path)
    if p is not None and p.is_file():
        try:
            data = tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
        except (ValueError, tomllib.TOMLDecodeError) as e:
            raise UsageError(f"provider file '{p}' is not valid {p.suffix[1:]}: {e}") from None
        for name, d in (data.get("providers", data) or {}).items():
            try:
                out[name] = ProviderConfig(name=name, **d)
            except TypeError as e:
                raise UsageError(f"provider '{name}' in '{p}': {e}") from None
    return out


def get(name: str, path: Path | None = None) -> Provider:
    """A ready provider, or one line saying what is missing and how to configure it."""
    cfgs = load_configs(path)
    how = ("configure it in ~/.config/hetforge/kforge.toml (or --providers FILE) as [providers.NAME] with kind, "
           "model, base_url, api_key_env; or set OPENAI_API_KEY/OPENAI_BASE_URL or ANTHROPIC_API_KEY plus "
           "HETFORGE_KFORGE_MODEL")
    if name not in cfgs:
        raise HetforgeError(f"provider '{name}' is not configured: {how}")
    c = cfgs[name]
    if c.kind == "offline":
        return OfflineProvider()
    if c.kind not in ("openai", "anthropic"):
        raise UsageError(f"provider '{name}' has kind '{c.kind}'; use openai, anthropic or offline")
    if not c.model:
        raise HetforgeError(f"provider '{name}' has no model: set 'model' in its entry or HETFORGE_KFORGE_MODEL")
    key = os.environ.get(c.api_key_env or "", "") if c.api_key_env else ""
    if not key and (c.kind == "anthropic" or not c.base_url):
        raise HetforgeError(f"provider '{name}' has no API key: set ${c.api_key_env or 'its api_key_env'}; {how}")
    return (OpenAICompatible if c.kind == "openai" else AnthropicProvider)(c, key or "none")
