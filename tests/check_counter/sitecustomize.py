"""Put on PYTHONPATH by tests/e2e/test_checks_once.py: with KVRELAY_CHECK_COUNTS naming a directory, this
interpreter appends one line to <directory>/<pid>.log per call of each of a request's checks: its sampling
settings (`SamplingParams.validate`), its prompt's token range (`engine_input.check_prompt`) and its ID
against the live ones (`engine_input.check_unique`). The wrappers go in before any service module imports
the checks, so every `from ... import` of them binds the counted one."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

_directory = os.environ.get("KVRELAY_CHECK_COUNTS")


def _counted(name: str, check: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(check)
    def counted(*args: Any, **kwargs: Any) -> Any:
        with open(os.path.join(str(_directory), f"{os.getpid()}.log"), "a") as log:
            log.write(name + "\n")
        return check(*args, **kwargs)

    return counted


if _directory:
    from services.common import engine_input
    from services.common.sampling import SamplingParams

    SamplingParams.validate = _counted("sampling", SamplingParams.validate)  # type: ignore[method-assign]
    engine_input.check_prompt = _counted("token_range", engine_input.check_prompt)
    engine_input.check_unique = _counted("request_id", engine_input.check_unique)
