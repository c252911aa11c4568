"""Reading a streamed generation: the chat servers' stream shapes, as events.

A streaming probe (``prober: stream``) cares about three things in the bytes a
server streams back: a token (a piece of generated text), the stream's final
event, and an error the server reports inside the stream. Each format turns
bytes, as they arrive, into those events:

``openai``
    Server-sent events (``data: {json}``, a blank line between events) in the
    OpenAI-compatible chat-completions and completions shape that vLLM, SGLang,
    TGI and Colossal-Inference's ``/chat`` stream: the text of
    ``choices[0].delta.content``, ``choices[0].text``, or a top-level
    ``content``/``text`` (Colossal-Inference's ``DeltaMessage``); ``data: [DONE]``
    or a ``finish_reason`` ends it; ``{"error": …}`` is an engine error.
``colossalchat``
    Server-sent events from ColossalChat's ``/generate/stream``
    (sse-starlette): ``event: generate`` carries a piece of text as its data,
    ``event: end`` ends the stream.
``colossal_inference``
    Colossal-Inference's ``/generate`` with ``"stream": true``: JSON objects
    ``{"text": …}`` each followed by a NUL byte, the text so far each time
    (a token is what it grew by). No final event: the body's own end (the
    chunked encoding's last chunk) ends it.

Why parse it ourselves: the formats are a few lines each, and what a probe
needs (the time each token arrived, not a client library's reassembled
message) is exactly what client libraries hide. Time to first token ignores
empty pieces (a role-only first chunk, keep-alive comments), as NVIDIA
AIPerf's definition does.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

StreamFormat = Literal["openai", "colossalchat", "colossal_inference"]
STREAM_FORMATS: tuple[str, ...] = ("openai", "colossalchat", "colossal_inference")


class MalformedStream(Exception):
    """Bytes that are not the format's events (reason ``body``)."""


@dataclass(frozen=True)
class Token:
    text: str


@dataclass(frozen=True)
class Done:
    """The stream's final event: the server says the answer is complete."""


@dataclass(frozen=True)
class EngineError:
    message: str


Event = Token | Done | EngineError


class _ServerSentEvents:
    """The event-stream format (HTML Living Standard, 9.2.6): lines end in CRLF, LF or
    CR; ``field: value``; a blank line dispatches; a line starting with ``:`` is a
    comment (keep-alives)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._pending_cr = False
        self._event = ""
        self._data: list[str] = []

    def feed(self, text: str) -> Iterator[tuple[str, str]]:
        """(event name, data) of every event completed by ``text``."""
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]  # the LF of a CRLF split between two reads
        self._pending_cr = text.endswith("\r")
        self._buffer += text
        lines = self._buffer.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        self._buffer = lines.pop()
        for line in lines:
            if not line:
                if self._data:
                    yield self._event or "message", "\n".join(self._data)
                self._event, self._data = "", []
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                self._data.append(value)
            elif name == "event":
                self._event = value


def _openai_text(document: Any) -> tuple[str, bool]:
    """(the text, whether a finish_reason ends it) of one OpenAI-shaped chunk."""
    if not isinstance(document, dict):
        raise MalformedStream(f"an event's data is JSON but not an object: {document!r:.80}")
    choices = document.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice = choices[0]
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        return (text if isinstance(text, str) else ""), bool(choice.get("finish_reason"))
    message = document.get("message")
    text = document.get("content", document.get("text"))
    if text is None and isinstance(message, dict):
        text = message.get("content")
    return (text if isinstance(text, str) else ""), bool(document.get("finish_reason"))


class StreamParser:
    """Bytes in, events out, for one of :data:`STREAM_FORMATS`."""

    def __init__(self, format: StreamFormat) -> None:
        self.format = format
        # a multi-byte character may be split between two reads
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._sse = _ServerSentEvents()
        self._bytes = b""
        self._text_so_far = ""  # colossal_inference: each object holds all the text yet

    def feed(self, data: bytes) -> list[Event]:
        if self.format == "colossal_inference":
            return self._feed_nul_delimited(data)
        try:
            text = self._utf8.decode(data)
        except UnicodeDecodeError as exc:
            raise MalformedStream(f"the stream is not UTF-8: {exc}") from None
        events: list[Event] = []
        for name, payload in self._sse.feed(text):
            events.extend(self._sse_event(name, payload))
        return events

    def _sse_event(self, name: str, payload: str) -> list[Event]:
        if self.format == "colossalchat":
            if name == "generate":
                return [Token(payload)]
            if name == "end":
                return [Done()]
            if name == "error":
                return [EngineError(payload[:200] or "the server sent an error event")]
            return []
        if payload.strip() == "[DONE]":
            return [Done()]
        try:
            document = json.loads(payload)
        except ValueError:
            raise MalformedStream(f"an event's data is not JSON: {payload[:80]!r}") from None
        if isinstance(document, dict) and document.get("error") is not None:
            error = document["error"]
            message = error.get("message") if isinstance(error, dict) else error
            return [EngineError(str(message)[:200])]
        text, finished = _openai_text(document)
        events: list[Event] = [Token(text)] if text else []
        return [*events, Done()] if finished else events

    def _feed_nul_delimited(self, data: bytes) -> list[Event]:
        self._bytes += data
        *complete, self._bytes = self._bytes.split(b"\0")
        events: list[Event] = []
        for raw in complete:
            if not raw.strip():
                continue
            try:
                document = json.loads(raw)
            except ValueError:
                raise MalformedStream(f"a streamed object is not JSON: {raw[:80]!r}") from None
            text = document.get("text") if isinstance(document, dict) else None
            if not isinstance(text, str):
                raise MalformedStream(f"a streamed object has no text: {raw[:80]!r}")
            grown = text[len(self._text_so_far):] if text.startswith(self._text_so_far) \
                else text
            self._text_so_far = text
            if grown:
                events.append(Token(grown))
        return events

    def end(self) -> list[Event]:
        """The body ended cleanly: what that means for the format."""
        if self.format == "colossal_inference":
            if self._bytes.strip():  # a last object without its NUL
                return [*self._feed_nul_delimited(b"\0"), Done()]
            return [Done()]
        return []
