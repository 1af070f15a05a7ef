"""Test doubles at the codec's Backend seam, app builders and a real uvicorn server in a thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from services.codec.app import create_app
from services.codec.backend.protocol import (
    BackendFailedError,
    BackendInfo,
    BackendUnavailableError,
    GenerationRequest,
    ServiceStatus,
    TokenDelta,
)
from services.codec.state import CodecIdentity
from services.codec.text.tokenizer import Tokenizer
from services.common.config import KvrelayConfig, LimitsConfig
from services.common.manifest import load_verified_manifest
from services.common.outputs import FinishReason, TokenLogprob
from tests.ports import free_port as free_port  # re-exported: the codec tests take ports here

MODEL_NAME = "smollm2-test"
MAX_CONTEXT = 2048


def identity_for(model_dir: Path) -> CodecIdentity:
    manifest = load_verified_manifest(model_dir, scope="tokenizer")
    return CodecIdentity(MODEL_NAME, manifest.tokenizer_fingerprint, manifest.model_fingerprint)


def token_deltas(
    token_ids: list[int],
    finish_reason: str,
    *,
    index: int = 0,
    num_prompt_tokens: int = 0,
    num_cached_tokens: int = 0,
    chunk_size: int = 1,
    logprobs: bool = False,
) -> list[TokenDelta]:
    """`token_ids` split into deltas of `chunk_size`; the last carries `finish_reason`.

    With `logprobs`, token i gets logprob -(i+1)/10 and two alternatives (itself, then token 0)."""
    deltas = []
    for start in range(0, len(token_ids), chunk_size):
        ids = token_ids[start : start + chunk_size]
        is_last = start + chunk_size >= len(token_ids)
        outs = [
            TokenLogprob(tid, -(start + k + 1) / 10, [(tid, -(start + k + 1) / 10), (0, -5.0)])
            for k, tid in enumerate(ids)
        ]
        deltas.append(
            TokenDelta(
                index=index,
                token_ids=ids,
                logprobs=outs if logprobs else [],
                finish_reason=FinishReason(finish_reason) if is_last else None,
                num_prompt_tokens=num_prompt_tokens,
                num_cached_tokens=num_cached_tokens,
            )
        )
    return deltas


def interleave(*streams: list[TokenDelta]) -> list[TokenDelta]:
    """Round-robin merge of per-sample delta lists, as a backend running n samples would send them."""
    merged: list[TokenDelta] = []
    for position in range(max(len(stream) for stream in streams)):
        merged.extend(stream[position] for stream in streams if position < len(stream))
    return merged


Script = Callable[[GenerationRequest], list[TokenDelta]]


def scripted(
    samples: list[list[int]],
    finish_reason: str = "stop",
    *,
    eos_token_id: int = 2,
    num_cached_tokens: int = 0,
    logprobs: bool = False,
    chunk_size: int = 1,
) -> Script:
    """A script that plays `samples[i % len(samples)]` for sample i of each request, interleaved.
    A "stop" finish appends EOS, as the engine does."""

    def script(request: GenerationRequest) -> list[TokenDelta]:
        streams = []
        for index in range(request.sampling.n):
            ids = list(samples[index % len(samples)])
            ids += [eos_token_id] if finish_reason == "stop" else []
            streams.append(
                token_deltas(
                    ids,
                    finish_reason,
                    index=index,
                    num_prompt_tokens=len(request.prompt_token_ids),
                    num_cached_tokens=num_cached_tokens,
                    chunk_size=chunk_size,
                    logprobs=logprobs,
                )
            )
        return interleave(*streams)

    return script


@dataclass
class FakeBackend:
    """Plays a scripted token stream per request and records what it saw and how each stream ended."""

    tokenizer_fingerprint: str
    script: Script = field(default=lambda request: [])
    max_model_len: int = MAX_CONTEXT
    vocab_size: int = 49152
    is_unavailable: bool = False
    fail_after: int | None = None  # raise BackendFailedError before delta k
    stall_before: int | None = None  # never yield delta k: wait there until the stream is closed
    delay_s: float = 0.0
    seen: list[GenerationRequest] = field(default_factory=list)
    closed_early: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    statuses_value: list[ServiceStatus] = field(default_factory=list)
    status_reads: int = 0  # calls of `statuses` (a drainer reads them before it takes each job)
    is_closed: bool = False
    model_fingerprint: str = "fake-model-fp"  # the workers' served one: responses' system_fingerprint
    numerics: str = "default"
    encoder_decoder: bool = False  # serve as an encoder-decoder model (its decoder starts at token 0)

    def reset(self) -> None:
        self.script = lambda request: []
        self.is_unavailable = False
        self.fail_after = None
        self.stall_before = None
        self.delay_s = 0.0
        self.seen.clear()
        self.closed_early.clear()
        self.completed.clear()

    async def info(self) -> BackendInfo:
        if self.is_unavailable:
            raise BackendUnavailableError("fake backend is down")
        return BackendInfo(
            MODEL_NAME, self.max_model_len, 16, self.model_fingerprint, self.tokenizer_fingerprint,
            self.vocab_size, self.numerics, encoder_decoder=self.encoder_decoder,
        )  # fmt: skip

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        self.seen.append(request)
        if self.is_unavailable:
            raise BackendUnavailableError("fake backend is down")
        try:
            for position, delta in enumerate(self.script(request)):
                if self.fail_after is not None and position == self.fail_after:
                    raise BackendFailedError("worker crashed (fake)")
                if position == self.stall_before:
                    await asyncio.Event().wait()  # only closing the stream (an abort) ends this
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                yield delta
        except (GeneratorExit, asyncio.CancelledError):
            self.closed_early.append(request.request_id)
            raise
        self.completed.append(request.request_id)

    async def statuses(self) -> list[ServiceStatus]:
        if self.is_unavailable:
            raise BackendUnavailableError("fake backend is down")
        self.status_reads += 1
        return list(self.statuses_value)

    async def close(self) -> None:
        self.is_closed = True


def make_config(**limits: int) -> KvrelayConfig:
    return KvrelayConfig(limits=LimitsConfig(**limits))


def make_app(
    tokenizer: Tokenizer, backend: FakeBackend, identity: CodecIdentity, config: KvrelayConfig | None = None
) -> FastAPI:
    return create_app(backend, tokenizer, config or make_config(), identity)


@contextmanager
def serve_in_thread(app: FastAPI) -> Iterator[str]:
    """Runs `app` under uvicorn on a free loopback port; yields the base URL."""
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_config=None, access_log=False, lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)
