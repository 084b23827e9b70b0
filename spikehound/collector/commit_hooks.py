"""Callbacks told of every committed batch (span and resource metrics), kept apart from the commit itself.

They run on the writer thread right after the commit. The batch is on disk by
then and its senders are owed their success: a hook that raises costs its own
figures only. It is handed to ``on_failure`` (counted and logged, see
``StepFailures``), and never reaches the commit's caller, where it would read
as a failed write and tell the senders to retry data that is stored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from spikehound.storage.writer import WriteBatch

log = logging.getLogger("spikehound.collector.commit_hooks")


class CommitHook(Protocol):
    """Told of every batch the ingest pipeline committed (``SpanMetrics.add``, ``ResourceMetrics.add``).

    Called on the writer thread, right after the commit and before the next one; the batch's senders wait for
    it to return, and every later commit does too, so it must not block (no I/O, no lock the event loop holds)
    and should take little time per record. It may raise: the exception is counted and the batch stays
    committed and acknowledged, the next hook still runs. It must not change ``batch``; it may be a batch of
    windows and spikes alone, with no spans or points. Its decoded ``spans`` are there only where this process
    reads them (``IngestQueue.keep_spans``: without the detection process); ``span_count`` and ``blocks`` are
    always there.
    """

    def __call__(self, batch: WriteBatch, /) -> None: ...


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
