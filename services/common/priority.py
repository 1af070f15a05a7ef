"""Priority classes: what a request's `priority` (worker.proto GenerateRequest.priority) means.

Three classes; a lower value runs first, as in vLLM's priority scheduling. The scheduler serves them in
turn and lets a waiting request of a higher class take the blocks of a lower one (engine/scheduling/
scheduler.py); the router counts only the queued work a request would wait behind (router/policy.py).
How a client picks one: docs/priority.md.
"""

from __future__ import annotations

HEADER = "x-kvrelay-priority"  # high | normal | low, on a request; the class that served, on its response

HIGH = -1
NORMAL = 0
LOW = 1

BY_NAME = {"high": HIGH, "normal": NORMAL, "low": LOW}
NAME_OF = {value: name for name, value in BY_NAME.items()}


def name_of(priority: int) -> str:
    """The class a priority value belongs to (values past the ends count as the nearest class)."""
    return NAME_OF[min(max(priority, HIGH), LOW)]
