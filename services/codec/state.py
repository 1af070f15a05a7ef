"""What one codec app holds: its identity, its backend and the objects built once at startup.

`create_app` builds one `CodecState` and stores it on `app.state.codec`; routes reach it through
`codec_state(request)`. Per-request values (request ID, `RequestStats`) live in the ASGI scope's
state, set by the middleware. `gate` is admission (admission/gate.py: context rules, quotas, the fair
queue); its quota store may hold a Redis client, which `aclose` closes at shutdown.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from services.codec.admission.gate import Gate
from services.codec.admission.metrics import LimitsMetrics
from services.codec.backend.info import BackendInfoCache
from services.codec.backend.protocol import Backend
from services.codec.backend.readiness import Readiness
from services.codec.backend.results import ResultCache
from services.codec.errors import UnknownModelError
from services.codec.generation import Generator
from services.codec.metrics import CodecMetrics, RequestStats
from services.codec.text.assistant import Assistant
from services.codec.text.chat_template import ChatTemplate, chat_template_from_tokenizer
from services.codec.text.prompts import PromptEncoder, default_workers
from services.codec.text.tokenizer import Tokenizer
from services.common.config import KvrelayConfig
from services.common.errors import ConfigError, InvalidRequestError

FINGERPRINT_PREFIX_LEN = 12
# Which release answered (a grey release's canary or the main one): on every HTTP response and in every
# public gRPC call's initial metadata. The version is the model directory's name (the chart's
# model.version); the fingerprint the first 16 hex digits of the weights' (else the tokenizer's).
MODEL_VERSION_HEADER = "x-kvrelay-model-version"
MODEL_FINGERPRINT_HEADER = "x-kvrelay-model-fingerprint"
RELEASE_FINGERPRINT_LEN = 16


@dataclass(frozen=True)
class CodecIdentity:
    """Who this codec is: the served model name and the fingerprints of what it loaded.

    `tokenizer_fingerprint` must equal the backend's for the codec to report ready.
    `model_fingerprint` is "" when the codec did not see a manifest for the weights.
    """

    model_name: str
    tokenizer_fingerprint: str
    model_fingerprint: str = ""
    model_version: str = ""  # the model directory's name

    @property
    def release_headers(self) -> tuple[tuple[str, str], ...]:
        """The headers (and gRPC metadata) that say which release answered."""
        source = self.model_fingerprint or self.tokenizer_fingerprint
        headers = [(MODEL_FINGERPRINT_HEADER, source[:RELEASE_FINGERPRINT_LEN])]
        if self.model_version:
            headers.insert(0, (MODEL_VERSION_HEADER, self.model_version))
        return tuple(headers)

    @property
    def system_fingerprint(self) -> str:
        """A short fingerprint for responses' `system_fingerprint` before the workers' is known."""
        source = self.model_fingerprint or self.tokenizer_fingerprint
        return f"fp_{source[:FINGERPRINT_PREFIX_LEN]}"


@dataclass
class CodecState:
    identity: CodecIdentity
    config: KvrelayConfig
    backend: Backend
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    metrics: CodecMetrics
    info: BackendInfoCache
    generator: Generator
    readiness: Readiness
    gate: Gate
    encoder: PromptEncoder  # templates and tokenizes under the byte cap, off the event loop
    started_at: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def build(
        cls, backend: Backend, tokenizer: Tokenizer, config: KvrelayConfig, identity: CodecIdentity
    ) -> CodecState:
        metrics = CodecMetrics()
        limits_metrics = LimitsMetrics(metrics.registry)
        info = BackendInfoCache(backend)
        encoder = PromptEncoder(
            tokenizer,
            metrics,
            max_bytes=config.limits.max_input_bytes,
            workers=config.limits.prompt_workers or default_workers(),
        )
        generator = Generator(
            backend,
            tokenizer,
            metrics,
            step_timeout_s=config.limits.step_timeout_ms / 1000.0,
            on_step_timeout=limits_metrics.step_timeouts.inc,
            encoder_timeout_s=config.limits.encoder_timeout_ms / 1000.0,
            on_encoder_timeout=limits_metrics.encoder_timeouts.inc,
            results=ResultCache.from_config(config, metrics.result_cache, os.environ),
        )
        return cls(
            identity=identity,
            config=config,
            backend=backend,
            tokenizer=tokenizer,
            chat_template=_chat_template(tokenizer, config.model.chat_template),
            metrics=metrics,
            info=info,
            generator=generator,
            readiness=Readiness(backend, identity.tokenizer_fingerprint),
            gate=Gate.from_config(config, info, generator, limits_metrics, os.environ, encoder),
            encoder=encoder,
        )

    async def aclose(self) -> None:
        """Releases what the state holds besides the backend (the quota store's and the result cache's
        connections; result writes under way finish first)."""
        await self.gate.aclose()
        if self.generator.results is not None:
            await self.generator.results.aclose()

    def check_model(self, model: str | None) -> None:
        """404 model_not_found unless `model` is the served name (None is allowed where optional)."""
        if model is not None and model != self.identity.model_name:
            raise UnknownModelError(model)

    @functools.cached_property
    def assistant(self) -> Assistant:
        """The model's tool call format, tool-aware template and thinking mode (text/assistant.py)."""
        return Assistant.for_model(self.tokenizer, self.chat_template, self.config.model.tool_call_format)

    def require_chat_template(self) -> ChatTemplate:
        if self.chat_template is None:
            return chat_template_from_tokenizer(self.tokenizer)  # raises ChatTemplateMissingError
        return self.chat_template

    async def vocab_size(self) -> int:
        """The backend's vocabulary size (fetched on first use)."""
        return (await self.info.get()).vocab_size

    @property
    def system_fingerprint(self) -> str:
        """OpenAI's `system_fingerprint`: the workers' numerics fingerprint (the served model fingerprint:
        weights, KV dtype and, in deterministic mode, the kernel build and threads), with `_det` under
        engine.deterministic; the codec's own until the workers' info was read (every generation reads
        it before its response starts)."""
        info = self.info.cached
        if info is None:
            return self.identity.system_fingerprint
        mode = "_det" if info.numerics == "deterministic" else ""
        return f"fp_{info.model_fingerprint[:FINGERPRINT_PREFIX_LEN]}{mode}"

    @property
    def request_timeout_s(self) -> float:
        return self.config.limits.request_timeout_ms / 1000.0

    @property
    def stream_send_timeout_s(self) -> float:
        return self.config.limits.stream_send_timeout_ms / 1000.0


def codec_state(request: Request) -> CodecState:
    state: CodecState = request.app.state.codec
    return state


def request_id(request: Request) -> str:
    return str(getattr(request.state, "request_id", ""))


def backend_request_id(request: Request) -> str:
    """The ID sent inward: our request ID, made unique when the client chose it."""
    return str(getattr(request.state, "backend_request_id", "") or request_id(request))


def request_stats(request: Request) -> RequestStats:
    stats = getattr(request.state, "stats", None)
    if not isinstance(stats, RequestStats):
        stats = RequestStats(request_id=request_id(request))
        request.state.stats = stats
    return stats


def _chat_template(tokenizer: Tokenizer, template_file: str | None = None) -> ChatTemplate | None:
    """The configured template file (`model.chat_template`) if any, else the model's own, else None."""
    override = None
    if template_file is not None:
        try:
            override = Path(template_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"model.chat_template {template_file!r} cannot be read: {exc}") from exc
    try:
        return chat_template_from_tokenizer(tokenizer, override)
    except InvalidRequestError:  # no template: chat requests get a 400, completions still work
        return None
