"""Tokenizers: a Hugging Face tokenizer from a local model folder, or a byte-level one for zoo models.

Random-weight zoo models have no trained tokenizer, so they get :class:`ByteTokenizer` (one id per
UTF-8 byte). Such a model can emit ids past 255 (its vocabulary is larger): those decode as ``<id>``
so nothing is hidden. :class:`StreamDecoder` turns a growing id list into text pieces for streaming
without cutting a multi-byte character in half.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from hetforge.errors import UsageError


class Tokenizer(Protocol):
    name: str
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class ByteTokenizer:
    """One token per UTF-8 byte; ``vocab_size`` is the model's, ids >= 256 decode as ``<id>``."""

    vocab_size: int
    eos_id: int | None = None
    name: str = "byte-level"

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        bad = [b for b in ids if b >= self.vocab_size]
        if bad:
            raise UsageError(f"the prompt holds byte {bad[0]} but the model's vocabulary has only {self.vocab_size} "
                             "ids; use ASCII text")
        return ids

    def decode(self, ids: list[int]) -> str:
        out: list[str] = []
        run = bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
            out.append(f"<{i}>")
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


@dataclass
class HFTokenizer:
    """A ``transformers`` tokenizer (loaded from a local folder)."""

    tok: object
    name: str = "hugging-face"
    eos_id: int | None = None

    def __post_init__(self) -> None:
        if self.eos_id is None:
            self.eos_id = getattr(self.tok, "eos_token_id", None)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def for_model(loaded) -> Tokenizer:
    """The tokenizer that goes with a :class:`~hetforge.models.zoo.LoadedModel`."""
    eos = getattr(loaded.config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if loaded.tokenizer is not None:
        return HFTokenizer(loaded.tokenizer, name=f"hugging-face ({loaded.name})", eos_id=eos)
    return ByteTokenizer(loaded.vocab_size, eos_id=eos)


@dataclass
class StreamDecoder:
    """Turns ids arriving one by one into text pieces; holds back an unfinished UTF-8 character."""

    tokenizer: Tokenizer
    ids: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of the decoded text already handed out

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""  # probably half a character; wait for the next token
        piece = text[self.emitted:]
        self.emitted = len(text)
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        piece = text[self.emitted:]
        self.emitted = len(text)
        return piece

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.ids)
