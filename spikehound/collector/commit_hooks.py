"""Callbacks told of every committed batch (span and resource metrics), kept apart from the commit itself.

They run on the writer thread right after the commit. The batch is on disk by
then and its senders are owed their success: a hook that raises costs its own
figures only. It is handed to ``on_failure`` (the pipeline counts and logs it),
and never reaches the commit's caller, where it would read as a failed write
and tell the senders to retry data that is stored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from spikehound.storage.writer import WriteBatch

log = logging.getLogger("spikehound.collector.commit_hooks")

CommitHook = Callable[[WriteBatch], None]


class CommitHooks:
    """The hooks, called in the order added; ``run`` never raises."""

    def __init__(self, on_failure: Callable[[Exception], None]) -> None:
        self._hooks: list[CommitHook] = []
        self._on_failure = on_failure

    def add(self, hook: CommitHook) -> None:
        self._hooks.append(hook)

    def __len__(self) -> int:
        return len(self._hooks)

    def run(self, batch: WriteBatch) -> None:
        """Tell every hook of ``batch`` (committed); a failing hook is reported and the next one still runs."""
        for hook in self._hooks:
            try:
                hook(batch)
            except Exception as exc:
                self._report(exc)

    def _report(self, exc: Exception) -> None:
        try:
            self._on_failure(exc)
        except Exception:  # the report itself failed: still no reason to call the commit failed
            log.exception("a commit hook failed, and reporting it failed too")
