"""The kvrelay error tree. Every error a caller can cause or a service can report is one of these.

    KvrelayError
    ├── ConfigError                  bad configuration; processes exit with CONFIG_EXIT_CODE
    ├── ModelLoadError               a model directory that cannot be served
    │   ├── ModelNotFoundError       the directory or a required file is missing
    │   ├── CorruptModelError        a file that does not parse (GGUF, safetensors, JSON)
    │   ├── ManifestMismatchError    a file whose sha256 differs from the manifest
    │   └── KernelBuildError         the C kernels do not build or load on a CPU that can run them
    ├── CapacityError                weights plus the minimum KV cache do not fit the budget
    ├── InvalidRequestError          the caller's input is wrong (a 400 at the edge)
    │   ├── EmptyPromptError
    │   ├── TokenOutOfRangeError
    │   ├── InvalidSamplingError
    │   └── ContextLengthExceededError
    ├── DuplicateRequestError        a request ID that is already running
    ├── RequestNotFoundError         abort or lookup of an unknown request ID
    └── EngineDeadError              the engine loop stopped after an internal error

User input is checked by raising these, never with `assert`. On the internal gRPC API each maps to one
status code (services/common/grpc_server.py `abort_for`).
"""

from __future__ import annotations

# sysexits.h EX_CONFIG: supervisors never restart a process that exits with it. The CLI exits with it for
# ConfigError, CapacityError and ModelLoadError: deterministic failures a restart cannot fix.
CONFIG_EXIT_CODE = 78


class KvrelayError(Exception):
    """Base of every kvrelay error."""


class ConfigError(KvrelayError):
    """The configuration is invalid. The message names the offending settings."""


class ModelLoadError(KvrelayError):
    """A model directory cannot be served."""


class ModelNotFoundError(ModelLoadError):
    """The model directory, or a file it needs, does not exist."""


class CorruptModelError(ModelLoadError):
    """A model file exists but does not parse."""


class ManifestMismatchError(ModelLoadError):
    """A file's sha256 differs from the one recorded in the manifest."""

    def __init__(self, file_name: str, expected: str, actual: str) -> None:
        super().__init__(
            f"model file {file_name!r} does not match the manifest: "
            f"expected sha256 {expected[:16]}…, found {actual[:16]}…; refusing to start"
        )
        self.file_name = file_name


class KernelBuildError(ModelLoadError):
    """kernels.c does not build or load (no compiler, no source, a compile error): a broken install.

    Raised at model load, never for a CPU without AVX2/FMA (that one takes the torch path). The message
    carries the compiler's command and output. A ModelLoadError, so the CLI exits with CONFIG_EXIT_CODE
    and supervisors do not restart a build that will fail the same way.
    """


class CapacityError(KvrelayError):
    """The weights plus the smallest usable KV cache do not fit in the configured memory."""


class InvalidRequestError(KvrelayError):
    """The request is malformed. `param` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EmptyPromptError(InvalidRequestError):
    def __init__(self) -> None:
        super().__init__("the prompt has no tokens", param="prompt_token_ids")


class TokenOutOfRangeError(InvalidRequestError):
    def __init__(self, token_id: int, vocab_size: int) -> None:
        super().__init__(
            f"token ID {token_id} is outside the vocabulary [0, {vocab_size})", param="prompt_token_ids"
        )


class InvalidSamplingError(InvalidRequestError):
    """A sampling parameter is out of range."""


class ContextLengthExceededError(InvalidRequestError):
    def __init__(self, num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds "
            f"the model's context of {max_model_len} tokens",
            param="max_tokens",
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


class DuplicateRequestError(KvrelayError):
    """A request with this ID is already in the engine."""


class WorkerBusyError(KvrelayError):
    """The worker's waiting queue is at `engine.max_waiting_requests`: another replica should take it."""


class RequestNotFoundError(KvrelayError):
    """No request with this ID is known."""


class EngineDeadError(KvrelayError):
    """The engine loop stopped after an internal error; the service must restart."""
