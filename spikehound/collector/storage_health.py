"""Whether storage takes writes: an episode runs from the first failed commit to the next one that succeeds.

The ingest pipeline reports every commit's outcome here; the receivers ask ``admit`` before they decode a
request, and ``/readyz`` reads ``describe``. While storage is away (PostgreSQL restarting or stopped, a
full disk, any write error) senders are refused at once with a retry delay, except the requests that arrive
once the next attempt is due: their data is the attempt, so the collector learns that storage is back from a
real write of real data. One line is logged when an episode starts and one when it ends, never one per
request or retry. A nearly full disk takes some writes and refuses the next: an episode ends only once
writes have gone through for ``SETTLE_SECONDS``, and a failure before that continues it (senders are let in
again at the first good write all the same). Other writers (alerting, retention, checkpoints) report their
failures through ``note``, which stays quiet about what the episode's line already said.

>>> health = StorageHealth(clock=lambda: 100.0)
>>> health.available, health.admit()
(True, True)
>>> round(health.failed(OSError(28, "No space left on device")), 2)
0.25
>>> health.available, health.kind, health.admit(), health.retry_after()
(False, 'disk_full', False, 1)
"""

from __future__ import annotations

import errno
import logging
import math
import time
from collections.abc import Callable

from sqlalchemy.exc import InterfaceError, OperationalError

from spikehound.backoff import Backoff
from spikehound.collector.telemetry import CollectorTelemetry

log = logging.getLogger("spikehound.collector.storage")

# 0.25, 0.5, 1, then 2 s between attempts: a database that returns is used again within 2 s.
RETRY = Backoff(initial=0.25, most=2.0)
READ_RETRY_AFTER_SECONDS = 2  # what a read the database could not serve tells its client (the attempts' most)
SETTLE_SECONDS = 5.0  # writes succeed this long before an episode is over
KINDS = ("unreachable", "disk_full", "error")
KIND_WORDS = {"unreachable": "the database cannot be reached", "disk_full": "the disk is full",
              "error": "writes fail"}
# PostgreSQL's SQLSTATEs: 53xxx insufficient resources (53100 disk full: "could not extend file"),
# 57P01-57P03 the server shutting down or starting up, 08xxx the connection.
_DISK_FULL_STATES = ("53100",)
_UNREACHABLE_STATES = ("57P01", "57P02", "57P03", "08")
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_DISK_FULL_WORDS = ("database or disk is full", "no space left on device", "could not extend file",
                    "file too large", "disk quota exceeded")
_UNREACHABLE_WORDS = ("connection refused", "could not connect", "server closed the connection",
                      "connection is closed", "terminating connection", "the database system is",
                      "unable to open database file", "connection timeout expired", "consuming input failed")


def classify(exc: BaseException) -> str:
    """The kind of a write failure: ``disk_full``, ``unreachable`` or ``error``.

    Looks through SQLAlchemy's wrapper to the driver's error (its SQLSTATE, errno and message).

    >>> classify(OSError(errno.ENOSPC, "No space left on device"))
    'disk_full'
    >>> classify(ConnectionRefusedError(111, "Connection refused"))
    'unreachable'
    >>> classify(ValueError("bad"))
    'error'
    """
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 8:
        seen.append(current)
        current = getattr(current, "orig", None) or current.__cause__ or current.__context__
    for error in seen:
        state = str(getattr(error, "sqlstate", "") or getattr(error, "pgcode", "") or "")
        if state.startswith(_DISK_FULL_STATES):
            return "disk_full"
        if state.startswith(_UNREACHABLE_STATES):
            return "unreachable"
        if isinstance(error, OSError) and error.errno in _DISK_FULL_ERRNOS:
            return "disk_full"
        if isinstance(error, (ConnectionError, TimeoutError)):
            return "unreachable"
    text = " ".join(str(error) for error in seen).lower()
    if any(words in text for words in _DISK_FULL_WORDS):
        return "disk_full"
    if any(words in text for words in _UNREACHABLE_WORDS):
        return "unreachable"
    return "error"


# What a read raises when the database cannot serve it (down, restarting, out of reach): the API and the pages
# answer it 503 with Retry-After, not 500.
DATABASE_AWAY = (OperationalError, InterfaceError)


def read_refusal(exc: OperationalError | InterfaceError) -> str:
    """What a read the database could not serve is answered with (and logged at debug level)."""
    return f"storage unavailable: {first_line(exc.orig or exc)}"


def first_line(exc: BaseException, limit: int = 200) -> str:
    """``Class: first line of the message``, short enough for a log line or an answer."""
    text = str(exc).strip()
    return f"{exc.__class__.__name__}: {text.splitlines()[0][:limit]}" if text else exc.__class__.__name__


class StorageHealth:
    """The writer's view of storage; used on the event loop only."""

    def __init__(self, telemetry: CollectorTelemetry | None = None, *,
                 clock: Callable[[], float] = time.monotonic, retry: Backoff = RETRY) -> None:
        self.telemetry = telemetry  # None: not exported (a part's own view, in tests)
        self.clock = clock
        self.retry = retry
        self.available = True  # the last write went through: senders are let in, /readyz is ready
        self.episode = False  # from the first failed write until writes have succeeded for SETTLE_SECONDS
        self.kind = ""  # of the current episode
        self.error = ""  # its last error, as first_line() says it
        self.since = clock()  # when the current episode began
        self.returned_at = self.since  # when its first write went through again
        self.failures = 0  # attempts failed in this episode
        self.refused = 0  # requests refused in this episode
        self._next_attempt = -math.inf
        self._noted: set[str] = set()  # parts whose failure was logged in this episode
        self._export(available=1)

    def admit(self) -> bool:
        """Whether a sender's request may go on to be decoded and queued now (False: refuse it, retry later)."""
        if self.available or self.due():
            return True
        self.refused += 1
        return False

    def due(self) -> bool:
        """Whether the next write attempt of an episode may be made now."""
        return self.clock() >= self._next_attempt

    def retry_after(self) -> int:
        """Whole seconds a refused sender should wait: until the next attempt, at least 1."""
        if self._next_attempt == math.inf:  # a write hangs: its end is not known
            return math.ceil(self.retry.most)
        return max(1, math.ceil(self._next_attempt - self.clock()))

    def failed(self, exc: BaseException) -> float:
        """A write failed: start or continue the episode; return the seconds until the next attempt."""
        now = self.clock()
        self.failures += 1
        self.error = first_line(getattr(exc, "orig", None) or exc)  # the driver's words, not SQLAlchemy's wrapping
        delay = self.retry.step(self.failures)
        self._next_attempt = now + delay
        kind = classify(exc)
        if not self.episode:
            self.available, self.episode, self.kind, self.since, self.refused = False, True, kind, now, 0
            self._noted.clear()
            self._export(available=0, outage=kind)
            log.error("storage unavailable (%s: %s): %s; senders are told to retry (gRPC UNAVAILABLE, HTTP 503 "
                      "with Retry-After), /readyz answers 503, and a write is tried again every %.0f s at most",
                      kind, KIND_WORDS[kind], self.error, self.retry.most)
            return delay
        if self.available:  # it came back for a moment (a disk with a little room): the same episode goes on
            self.available = False
            self._export(available=0)
        if kind != self.kind:
            self.kind = kind
            log.error("storage still unavailable, now %s (%s): %s", kind, KIND_WORDS[kind], self.error)
        else:
            log.debug("storage write failed again (%d in this episode): %s", self.failures, self.error)
        return delay

    def stalled(self, seconds: float) -> None:
        """A write has had no answer for ``seconds`` (a hung server): an outage until it ends one way or another;
        no other attempt is due meanwhile."""
        self.failed(TimeoutError(f"the database has not answered a write for {seconds:.0f} s (hung, or out of "
                                 "reach without a reset)"))
        self._next_attempt = math.inf

    def succeeded(self) -> bool:
        """A write committed; True when it is the first since writes failed (senders are let in again)."""
        if self.available:
            self.settle()
            return False
        self.available, self.returned_at = True, self.clock()
        self._next_attempt = -math.inf
        self._export(available=1)
        return True

    def settle(self) -> None:
        """End the episode once writes have gone through for SETTLE_SECONDS (the pipeline asks on idle ticks too)."""
        if not (self.episode and self.available) or self.clock() - self.returned_at < SETTLE_SECONDS:
            return
        self.episode = False
        log.warning("storage available again after %.1f s (%s): %d write attempt(s) failed and %d request(s) were "
                    "refused meanwhile; writes have gone through since", self.returned_at - self.since, self.kind,
                    self.failures, self.refused)
        self.failures = 0

    def _export(self, available: int, outage: str = "") -> None:
        if self.telemetry is not None:
            self.telemetry.storage_available.set(available)
            if outage:
                self.telemetry.storage_outages.labels(outage).inc()

    def note(self, part: str, exc: BaseException) -> None:
        """Another writer's failure (``part`` names it): logged once per episode. A database that cannot be
        reached or a full disk starts an episode (with no traffic, only these writers find out); any other
        error is that part's own, logged at ERROR."""
        if not self.episode and classify(exc) != "error":
            self.failed(exc)
        if not self.episode:
            log.error("%s failed: %s", part, first_line(exc))
        elif part not in self._noted:
            self._noted.add(part)
            log.warning("%s waits for storage (%s): %s", part, self.kind, first_line(exc))
        else:
            log.debug("%s failed again: %s", part, first_line(exc))

    def describe(self) -> str:
        """For ``/readyz``: what is wrong and since when; ``ok`` when nothing is."""
        if self.available:
            return "ok"
        return (f"storage unavailable ({self.kind}: {KIND_WORDS[self.kind]}) for {self.clock() - self.since:.0f} s: "
                f"{self.error}")
