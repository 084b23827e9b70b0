"""One way for a test to wait for something a daemon does in its own time.

>>> calls = iter([None, None, 3])
>>> eventually(lambda: next(calls), "the third call", timeout=5, every=0)
3
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(check: Callable[[], T | None], what: str, timeout: float = 60.0, every: float = 0.1) -> T:
    """Call ``check`` until it returns something truthy and return that; fail naming ``what`` after ``timeout``.

    An exception from ``check`` counts as "not yet" (a daemon still starting refuses connections), and the
    last one is chained to the failure so that its cause is not lost.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            found = check()
        except Exception as exc:
            last_error, found = exc, None
        else:
            last_error = None
        if found:
            return found
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}") from last_error
        time.sleep(every)
