"""A running stack's status document: GET /status on its codec, as `kvrelay status` (services/cli/status.py)
prints it and the benchmarks read the workers' counters from it. Standard library only, no proxy; with
KVRELAY_API_KEY set it sends the key (a stack with API keys answers /status only to a key holder).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

from services.common.errors import KvrelayError

TIMEOUT_S = 5.0
API_KEY_ENV = "KVRELAY_API_KEY"


class StackUnreachableError(KvrelayError):
    """The stack did not answer GET /status with a JSON status document."""


def fetch_status(url: str, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """GET {url}/status (no proxy); the parsed document, which has a `services` list."""
    status_url = url.rstrip("/") + "/status"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(status_url)
    api_key = os.environ.get(API_KEY_ENV)
    if api_key:  # a stack with API keys answers /status only to a key holder
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with opener.open(request, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        raise StackUnreachableError(f"{status_url} answered HTTP {exc.code}") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StackUnreachableError(f"no kvrelay stack answers at {url} ({reason})") from None
    try:
        document = json.loads(body)
    except ValueError:
        raise StackUnreachableError(f"{status_url} did not answer with JSON") from None
    if not isinstance(document, dict) or not isinstance(document.get("services"), list):
        raise StackUnreachableError(f"{status_url} answered JSON without a `services` list")
    return document
