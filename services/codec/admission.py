"""Admission: the context-length rules, checked on token counts before anything is queued.

A request is refused (400 context_length_exceeded, and the backend never sees it) when its prompt is
over `limits.max_input_tokens`, or when prompt + max_tokens is over the model's context. An explicit
max_tokens over `limits.max_output_tokens` is a 400 too (not clamped). An absent max_tokens becomes
`limits.default_max_output_tokens`, capped by what the context has left.

The model's context comes from `backend.info()`, fetched on first use and then cached.
"""

from __future__ import annotations

from services.codec.backend import Backend, BackendInfo
from services.codec.errors import PromptTooLongError
from services.common.config import LimitsConfig
from services.common.errors import ContextLengthExceededError, InvalidRequestError


class Admission:
    def __init__(self, backend: Backend, limits: LimitsConfig) -> None:
        self._backend = backend
        self._limits = limits
        self._info: BackendInfo | None = None

    @property
    def cached_info(self) -> BackendInfo | None:
        return self._info

    async def backend_info(self) -> BackendInfo:
        """The backend's model info; BackendUnavailableError until it first answers."""
        if self._info is None:
            self._info = await self._backend.info()
        return self._info

    async def resolve_max_tokens(
        self, num_prompt_tokens: int, requested: int | None, prompt_param: str
    ) -> int:
        """The max_tokens to send, or a 400 naming the limit that the request breaks."""
        limits = self._limits
        if requested is not None and requested > limits.max_output_tokens:
            raise InvalidRequestError(
                f"max_tokens ({requested}) is over this server's limit of {limits.max_output_tokens}",
                param="max_tokens",
            )
        if num_prompt_tokens > limits.max_input_tokens:
            raise PromptTooLongError(num_prompt_tokens, limits.max_input_tokens, "input limit", prompt_param)
        max_context = (await self.backend_info()).max_context
        if num_prompt_tokens >= max_context:
            raise PromptTooLongError(num_prompt_tokens, max_context, "model's context", prompt_param)
        if requested is None:
            return min(limits.default_max_output_tokens, max_context - num_prompt_tokens)
        if num_prompt_tokens + requested > max_context:
            raise ContextLengthExceededError(num_prompt_tokens, requested, max_context)
        return requested
