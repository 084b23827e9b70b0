"""The detection process's side: a loop that feeds the detectors what the collector committed, and answers.

The collector (``detection_process.py``) forks this process at start and talks to it over two pipes. Every
message is a tuple whose first item says what it is:

===================================  =====================================================================
collector -> detection               meaning
===================================  =====================================================================
``("resume", token)``                continue from the stored checkpoint, replay what was committed after it;
                                     answers the ids of the spikes open now
``("feed", payloads, points)``       one commit: its span blocks as stored (encoded OTLP) and metric points
``("idle", seconds, token)``         no span came for ``seconds``; answers None once stepped
``("backlogs", unless_holding, token)``  backlogs are coming; answers None
``("snapshot", token)``              answers the pickled learned state (everything sent before it is in it)
===================================  =====================================================================

Back, after every message: ``("out", windows, spikes, stats, errors, span_counts)`` (what the step produced to
be written, windows without their samples; the driver's figures; failures counted per part; when the collector
asked for span metrics, the ``SpanCounts`` of the feed's spans, else None), then ``("reply", token, value)``
where the message asked for one. The detection process never writes to storage: it reads its
checkpoint and the commits to replay, and the collector's writer commits what it sends back, so SQLite still
has one writer.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import stat
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from spikehound.collector.commit_feed import CommitFeed
from spikehound.collector.detection_driver import CHECKPOINT_NAME, DetectionDriver, DriverSettings
from spikehound.collector.span_metrics import SpanMetrics
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.heap import release_free_heap
from spikehound.model import Span
from spikehound.otlp import spans_of_block
from spikehound.storage import checkpoints
from spikehound.storage.engine import make_engine
from spikehound.storage.reader import Reader

__all__ = ["serve"]

log = logging.getLogger("spikehound.collector.detection")

COUNTED_SERIES = 2**31  # a feed's span counts go back whole: the collector's instance applies the bounds


def serve(settings: DriverSettings, url: str, sqlite_synchronous: str, count_spans: bool, inbox: Connection,
          outbox: Connection) -> None:
    """The detection process's whole life: until the collector closes ``inbox`` (or dies).

    With ``count_spans``, the spans of every feed are counted for the collector's span metrics (a replay's
    are not: they were counted when first committed).
    """
    # The collector's signals are the collector's: systemd sends SIGTERM to every process of the unit, and the
    # collector ends this one once its last checkpoint is saved. The event loop's wake-up descriptor, inherited
    # with the fork, must not be written to from here.
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    # The collector's objects that only its other threads held are garbage here: collected now, while a
    # descriptor one of them closes is still the inherited copy and not one this process opened since. The
    # rest stays put, never collected (and, frozen, never walked by the cyclic collector again).
    gc.collect()
    gc.freeze()
    _close_inherited(keep={inbox.fileno(), outbox.fileno()})
    engine = make_engine(url, sqlite_synchronous=sqlite_synchronous)
    driver = DetectionDriver(settings, CollectorTelemetry(), advance_while_held=False)
    feed = CommitFeed(driver, Reader(engine))
    counts = span_counter() if count_spans else None
    try:
        while True:
            try:
                message = inbox.recv()
            except (EOFError, OSError):
                return
            if message[0] == "stop":
                return
            answer = _handle(message, driver, feed, engine, counts)
            out = driver.take_outgoing()
            outbox.send(("out", out.windows, out.spikes, driver.stats(),
                         dict(driver.failures.counts), counts.take_counts() if counts is not None else None))
            if answer is not None:
                outbox.send(("reply", answer[0], answer[1]))
    except (BrokenPipeError, ConnectionResetError):
        return  # the collector is gone
    finally:
        engine.dispose()


def span_counter(clock: Callable[[], float] = time.monotonic) -> SpanMetrics:
    """What counts the span metrics of each feed here, for the collector's instance to add (its bounds and
    idle drop are the collector's: this one holds a message's counts at a time)."""
    return SpanMetrics(max_series=COUNTED_SERIES, clock=clock, drop_idle=False)


def _close_inherited(keep: set[int]) -> None:
    """Close the sockets and pipes that came with the fork but ``keep``: the collector's listeners (a port must
    be free as soon as the collector is gone) and the collector's own ends of the two pipes (else this
    process, holding a writer of its own inbox, would never read the end of it when the collector dies)."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        keep = keep | {parent.sentinel}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd <= 2 or fd in keep:
            continue
        with contextlib.suppress(OSError):
            mode = os.fstat(fd).st_mode
            if stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode):
                os.close(fd)


def _handle(message: tuple[Any, ...], driver: DetectionDriver, feed: CommitFeed, engine: Any,
            counts: SpanMetrics | None) -> tuple[int, Any] | None:
    """Act on one message; (token, value) where it asks for an answer."""
    kind = message[0]
    if kind == "feed":
        _, payloads, points = message
        spans: list[Span] = []
        for payload in payloads:
            spans += spans_of_block(payload)
        if counts is not None:
            counts.add_spans(spans)
        feed.committed(spans, points)
        return None
    if kind == "idle":
        feed.idle(message[1])
        return message[2], None
    if kind == "backlogs":
        feed.backlogs_coming(message[1])
        return message[2], None
    if kind == "snapshot":
        state = driver.snapshot()
        release_free_heap()  # the pickle's tens of MB, and whatever a catch-up freed (spikehound/heap.py)
        return message[1], state
    if kind == "resume":
        feed.resume(checkpoints.load(engine, CHECKPOINT_NAME))
        engine.dispose()  # nothing is read after: the connection's page cache (up to 64 MiB) goes back now
        return message[1], sorted(driver.announcer.open_ids)
    raise ValueError(f"unknown message {kind!r}")
