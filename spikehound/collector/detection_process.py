"""A single collector's detection in a process of its own, on the second core.

The receivers, decoding and the storage writer keep the collector's process (and its GIL) to themselves;
the detectors run in a child forked at start (``detection_worker.serve``), fed after each commit with the
span blocks just committed, in commit order. Nothing is decoded twice in the collector: the child decodes
the stored blocks, as a restart's replay does. The pipe is the back-pressure: when the child falls behind, the
writer thread waits to hand it the next commit, the queue fills, and the receivers push back.

What the child produces comes back and waits here to be written with the pipeline's next commit, so storage
keeps one writer. The checkpoint is taken as one: the position storage is at is read on the writer thread,
between two commits, when the snapshot is asked for; the child answers after everything committed before it,
and what it produced before the snapshot is written before the checkpoint is saved.

A child that dies (killed, out of memory) is started again between two commits: it continues from the
checkpoint and replays what was committed after it, as a restarted collector does; nothing acknowledged is
lost (``spikehound_detection_process_restarts_total`` counts it).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine

from spikehound.collector.detection_driver import CHECKPOINT_NAME, DriverSettings, StepFailures
from spikehound.collector.detection_worker import serve
from spikehound.collector.detector_metrics import ENGINE_COUNTERS, ENGINE_GAUGES, DetectorMetrics
from spikehound.collector.outgoing import Outgoing
from spikehound.collector.pipeline import Flush
from spikehound.collector.span_metrics import SpanMetrics
from spikehound.collector.spike_announcer import SpikeAnnouncer
from spikehound.collector.storage_health import StorageHealth
from spikehound.collector.telemetry import CollectorTelemetry
from spikehound.collector.writer_thread import WriterThread
from spikehound.detectors.engine import CHECKPOINT_FORMAT, Detection
from spikehound.heap import release_free_heap
from spikehound.otlp import encode_spans, spans_of_block
from spikehound.storage import checkpoints
from spikehound.storage.writer import WriteBatch

__all__ = ["ProcessDetection"]

log = logging.getLogger("spikehound.collector.detection")

ANSWER_SECONDS = 30.0  # an answer, or room for a commit, not given in this long: the child is hung, and replaced
RESUME_SECONDS = 1800.0  # a replay after a restart reads everything committed since the checkpoint
RESUME_LOG_SECONDS = 60.0  # while it lasts (commits wait), a line this often
STOP_SECONDS = 10.0
POINT_BYTES = 200  # a metric point, pickled, about
RESTART_SECONDS = 5.0  # after a child that failed to start, the next try
WAITING_BYTES = 32 * 2**20  # span blocks handed over and not yet taken by the child, at most


class _Child:
    """One detection process and its two pipes; its answers are read on a thread of their own."""

    def __init__(self, settings: DriverSettings, url: str, sqlite_synchronous: str, count_spans: bool,
                 took: Callable[[tuple[Any, ...]], None], unanswered: Callable[[list[bytes]], None]) -> None:
        to_child, self._inbox = multiprocessing.Pipe(duplex=False)
        self._outbox, from_child = multiprocessing.Pipe(duplex=False)
        # Forked: the child starts with the modules loaded, in milliseconds, and touches none of the
        # collector's objects (its own engine, driver and registry).
        self.process = multiprocessing.get_context("fork").Process(
            target=serve, args=(settings, url, sqlite_synchronous, count_spans, to_child, from_child),
            name="spikehound-detection", daemon=True)
        self.process.start()
        to_child.close()
        from_child.close()
        self.alive = True
        self._took = took
        self._unanswered = unanswered
        self._tokens = itertools.count()
        self._answers: dict[int, concurrent.futures.Future[Any]] = {}
        # Commits may wait for the child, so that the writer goes on while it takes a window's step (a burst);
        # past WAITING_BYTES of them, ``send`` blocks (the back-pressure).
        self._waiting: collections.deque[tuple[tuple[Any, ...] | None, int]] = collections.deque()
        self._waiting_bytes = 0
        # Per message handed over, in order, until its "out" answer: a feed's span blocks (else None). The
        # blocks of those a dead child never answered go to ``unanswered`` (their spans were counted nowhere).
        self._sent: collections.deque[list[bytes] | None] = collections.deque()
        self._changed = threading.Condition()
        self._sender = threading.Thread(target=self._send_waiting, name="spikehound-detection-feed", daemon=True)
        self._reader = threading.Thread(target=self._read, name="spikehound-detection-answers", daemon=True)
        self._sender.start()
        self._reader.start()

    @property
    def waiting_bytes(self) -> int:
        """Bytes handed over and not yet taken by the child (``spikehound_detection_waiting_bytes``)."""
        return self._waiting_bytes

    def send(self, message: tuple[Any, ...], size: int = 0, blocks: list[bytes] | None = None) -> bool:
        """Hand over a message of ``size`` bytes (a feed's span ``blocks``), in order; blocks while WAITING_BYTES
        wait for the child (one message always goes). False when the child is gone: its replacement replays
        from storage."""
        hung_at = time.monotonic() + ANSWER_SECONDS
        with self._changed:
            while self.alive and self._waiting and self._waiting_bytes + size > WAITING_BYTES:
                if time.monotonic() > hung_at:
                    # Stopped (SIGSTOP, a debugger) or stuck: the writer must not wait on it for good.
                    log.error("the detection process took nothing for %.0f s: ended, to be started again",
                              ANSWER_SECONDS)
                    self.process.kill()
                    hung_at = float("inf")  # its reader sees the end and says it is gone
                self._changed.wait(1.0)
            if not self.alive:
                return False
            self._put(message, size)
            self._sent.append(blocks)
            return True

    def _put(self, message: tuple[Any, ...] | None, size: int) -> None:
        self._waiting.append((message, size))
        self._waiting_bytes += size
        self._changed.notify_all()

    def _send_waiting(self) -> None:
        while True:
            with self._changed:
                while not self._waiting:
                    self._changed.wait()
                message, size = self._waiting.popleft()
            if message is None:
                break
            try:
                self._inbox.send(message)
            except (OSError, ValueError):  # BrokenPipeError, or closed
                break
            with self._changed:
                self._waiting_bytes -= size
                self._changed.notify_all()
        self.alive = False
        self._fail_answers()
        with self._changed:
            self._changed.notify_all()  # a sender waiting for room sees the end

    def ask(self, kind: str, *args: Any) -> concurrent.futures.Future[Any]:
        """Send ``(kind, *args, token)``; the future of its answer (an error once the child is gone)."""
        token = next(self._tokens)
        answer: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._answers[token] = answer
        self.send((kind, *args, token))
        if not self.alive:
            self._fail_answers()
        return answer

    def _read(self) -> None:
        while True:
            try:
                message = self._outbox.recv()
            except (EOFError, OSError):
                break
            try:
                if message[0] == "reply":
                    answer = self._answers.pop(message[1], None)
                    if answer is not None:
                        answer.set_result(message[2])
                else:
                    with self._changed:
                        self._sent.popleft()
                    self._took(message)
            except Exception:
                # Unread, the child would block on its next answer and the writer on the child: end it, and the
                # collector forks another that replays from the checkpoint.
                log.exception("an answer of the detection process could not be taken: it is ended")
                self.process.kill()
                break
        with self._changed:  # no message is handed over after this
            self.alive = False
            unanswered, self._sent = self._sent, collections.deque()
        self._fail_answers()
        for blocks in unanswered:
            if blocks:
                self._unanswered(blocks)

    def _fail_answers(self) -> None:
        while self._answers:
            _, answer = self._answers.popitem()
            if not answer.done():
                answer.set_exception(RuntimeError("the detection process is gone"))

    def stop(self) -> None:
        """Let it finish what it was sent, then end it (killed if it does not end in STOP_SECONDS)."""
        self.send(("stop",))
        with self._changed:
            self._put(None, 0)
        self._sender.join(STOP_SECONDS)
        self.process.join(STOP_SECONDS)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._inbox.close()
        self._reader.join(STOP_SECONDS)
        self._outbox.close()

    def kill(self) -> None:
        """End the child at once, and its two threads and pipes with it."""
        self.alive = False
        self.process.kill()
        self.process.join()
        with self._changed:
            self._put(None, 0)  # the sender thread ends (its pipe is broken by now in any case)
        self._sender.join(STOP_SECONDS)
        self._reader.join(STOP_SECONDS)  # it reads the end of the pipe the dead child held
        self._inbox.close()
        self._outbox.close()


class ProcessDetection:
    """Implements the pipeline's ``CommitDetection`` with the detectors in a child process.

    Its calls come from the pipeline's one task, ``committed`` and ``probe`` on the writer thread; every
    message to the child is sent from the writer thread, so the child sees them in commit order.
    """

    reads_spans = False  # the child decodes the stored blocks; the receivers keep no decoded span for it

    def __init__(self, settings: DriverSettings, url: str, sqlite_synchronous: str, engine: Engine,
                 writer_thread: WriterThread, health: StorageHealth, telemetry: CollectorTelemetry, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._child_args = (settings, url, sqlite_synchronous)
        self.engine = engine
        self.writer_thread = writer_thread
        self.health = health  # told of checkpoints that fail
        self.telemetry = telemetry
        self.clock = clock  # seconds, for the checkpoint schedule; tests step it
        self.announcer = SpikeAnnouncer(telemetry)
        self.metrics = DetectorMetrics(self.stats)
        self.failures = StepFailures(self.metrics.errors)
        self._lock = threading.Lock()  # the figures, filled by the child's answers
        self.outgoing = Outgoing()  # what the child produced, to be written with the next commit
        self._stats: dict[str, int] = {key: 0 for _, key, _ in ENGINE_COUNTERS + ENGINE_GAUGES}
        self._child_failures: dict[str, int] = {}
        self._restarts = 0
        self._child: _Child | None = None
        self._gone: int | None = None  # the process id of the child whose end was counted
        self._next_start = 0.0  # monotonic seconds: no new child before (one that failed to start)
        self._next_checkpoint = clock() + settings.checkpoint_seconds
        self.span_metrics: SpanMetrics | None = None  # counted by the child, added here (see count_spans)

    def stats(self) -> dict[str, int]:
        """The child's figures as of its last answer (from any thread)."""
        with self._lock:
            stats = {**self._stats, "process_restarts": self._restarts}
        stats["waiting_bytes"] = self._child.waiting_bytes if self._child is not None else 0
        return stats

    # -- start and stop ---------------------------------------------------------------------------

    async def start(self, flush: Flush) -> None:
        """Fork the detection process, let it continue from the checkpoint, save a checkpoint at once."""
        await self._start_child()
        await self.checkpoint(flush)

    async def stop(self, flush: Flush) -> None:
        """Save the last checkpoint, then end the child."""
        await self.checkpoint(flush)
        if self._child is not None:
            await asyncio.to_thread(self._child.stop)
            self._child = None

    def count_spans(self, metrics: SpanMetrics) -> None:
        """Before start: the child counts the spans of every commit into ``metrics`` (it decodes them anyway,
        and the collector's core is the ingest's). A commit made while no child runs, and those a child that
        died never answered, are counted here."""
        self.span_metrics = metrics

    async def _start_child(self) -> None:
        self._child = child = _Child(*self._child_args, count_spans=self.span_metrics is not None,
                                     took=self._took, unanswered=self._count_blocks)
        self._child_failures = {}  # the new child counts from 0
        started = time.perf_counter()
        open_ids = await self._resumed(child)
        self.announcer.open_ids = set(open_ids)
        log.info("detection runs in process %d (started in %.2f s)", child.process.pid, time.perf_counter() - started)

    async def _resumed(self, child: _Child) -> list[str]:
        """The child's answer to "resume" (the spikes open now), within RESUME_SECONDS; a line every
        RESUME_LOG_SECONDS meanwhile, since commits wait for it (a long replay, or a stopped process)."""
        answer = asyncio.wrap_future(child.ask("resume"))
        began = time.monotonic()
        while True:
            left = RESUME_SECONDS - (time.monotonic() - began)
            if left <= 0:
                answer.cancel()
                raise TimeoutError(f"the detection process did not resume in {RESUME_SECONDS:.0f} s")
            try:
                return await asyncio.wait_for(asyncio.shield(answer), min(RESUME_LOG_SECONDS, left))
            except TimeoutError:
                log.warning("the detection process (%d) has been resuming for %.0f s (replaying what was "
                            "committed after the checkpoint); commits wait for it", child.process.pid,
                            time.monotonic() - began)

    async def _child_alive(self) -> bool:
        """Start a dead child again (between two commits: what was committed is all in storage, and the new one
        replays it); whether one runs."""
        child = self._child
        if child is not None and child.alive:
            return True
        if time.monotonic() < self._next_start:
            return False
        if child is not None and child.process.pid != self._gone:
            child.kill()
            self._gone = child.process.pid
            self._restarts += 1
            log.error("the detection process (%d) ended (exit code %s): started again from the checkpoint",
                      child.process.pid, child.process.exitcode)
        try:
            await self._start_child()
        except Exception as exc:
            self._next_start = time.monotonic() + RESTART_SECONDS
            log.error("the detection process could not be started again (%s: %s); next try in %.0f s",
                      exc.__class__.__name__, exc, RESTART_SECONDS)
            return False
        return True

    # -- the child's answers (on its reader thread) --------------------------------------------------

    def _took(self, message: tuple[Any, ...]) -> None:
        _, windows, spikes, stats, failures, span_counts = message
        self.outgoing.keep(Detection(windows=windows, spikes=spikes))
        if span_counts is not None and self.span_metrics is not None:
            self.span_metrics.add_counts(span_counts)
        with self._lock:
            self._stats = stats
        for part, count in failures.items():  # counted by the child, exposed here
            seen = self._child_failures.get(part, 0)
            if count > seen:
                self.metrics.errors.labels(part).inc(count - seen)
            self._child_failures[part] = count

    # -- the pipeline's calls ---------------------------------------------------------------------

    def committed(self, batch: WriteBatch) -> None:
        """On the writer thread, right after ``batch`` committed: hand its blocks to the child; never raises."""
        if not batch.span_count and not batch.points:
            return
        payloads = ([block.payload for block in batch.blocks] if batch.blocks or not batch.spans
                    else [encode_spans(batch.spans).SerializeToString()])
        child = self._child
        if child is not None and child.alive:
            size = sum(map(len, payloads)) + POINT_BYTES * len(batch.points)
            if child.send(("feed", payloads, list(batch.points)), size, payloads):
                return
        # A dead child's replacement replays this batch from storage for the detectors, but counts no span of it.
        self._count_blocks(payloads)

    def _count_blocks(self, blocks: list[bytes]) -> None:
        """The spans of a feed that a dead child never answered (on the answers' thread), or of a commit with no
        child to take it (on the writer thread)."""
        if self.span_metrics is not None:
            self.span_metrics.add(WriteBatch(spans=[s for block in blocks for s in spans_of_block(block)]))

    def take_outgoing(self) -> Detection:
        return self.outgoing.take()

    def has_outgoing(self) -> bool:
        return bool(self.outgoing)

    def sent(self, out: Detection, committed: bool) -> None:
        """``out`` (from ``take_outgoing``) was committed (announce it), or goes out again first."""
        if committed:
            self.announcer.written(out)
        else:
            self.outgoing.give_back(out)

    async def backlogs_coming(self, *, unless_holding: bool = False) -> None:
        await self._ask("backlogs", unless_holding)

    async def idle(self, idle_seconds: float) -> None:
        """The idle step waits for the child: what it closes is written with the tick's flush."""
        await self._ask("idle", idle_seconds)

    async def _ask(self, kind: str, *args: Any) -> Any:
        if not await self._child_alive():
            return None
        child = self._child
        assert child is not None
        answer = await self.writer_thread.run(child.ask, kind, *args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(answer), ANSWER_SECONDS)
        except TimeoutError:
            log.error("the detection process did not answer %r in %.0f s: ended, to be started again", kind,
                      ANSWER_SECONDS)
            await asyncio.to_thread(child.kill)
        except RuntimeError:
            pass  # it died meanwhile: started again with the next call
        return None

    async def between_commits(self, flush: Flush) -> None:
        """Also under continuous ingest: a SIGKILL loses at most checkpoint_seconds of learned state."""
        if not await self._child_alive():
            return
        if self.clock() >= self._next_checkpoint:
            self._next_checkpoint = self.clock() + self.settings.checkpoint_seconds
            await self.checkpoint(flush)

    async def checkpoint(self, flush: Flush) -> None:
        """Save the child's learned state with the storage position it covers (see the module's docstring)."""
        if self._child is None or not self._child.alive:
            return
        started = time.perf_counter()
        try:  # the position is read from storage, which may be away
            position, answer = await self.writer_thread.run(self._ask_snapshot)
        except Exception as exc:
            self.health.note("detector checkpoint", exc)
            return
        child = self._child
        try:
            state = await asyncio.wait_for(asyncio.wrap_future(answer), ANSWER_SECONDS)
        except TimeoutError:
            log.error("no checkpoint: the detection process gave no snapshot in %.0f s: ended, to be started "
                      "again", ANSWER_SECONDS)
            await asyncio.to_thread(child.kill)
            return
        except RuntimeError:
            log.error("no checkpoint: the detection process ended before its snapshot")
            return
        # What the detectors closed before it is written first: the checkpoint's storage position says that
        # everything before it was seen, and a SIGKILL right after must not lose those windows and spikes.
        if not await flush():
            return
        try:
            await self.writer_thread.run(self._save, state, position)
        except Exception as exc:
            self.health.note("detector checkpoint", exc)
            return
        self.telemetry.checkpoint_seconds.observe(time.perf_counter() - started)
        # The child gives back its own free heap after each snapshot; this process's (the writer's batches, the
        # snapshot just written) is given back here, or glibc keeps it for good (spikehound/heap.py).
        await asyncio.to_thread(release_free_heap)

    def probe(self) -> None:
        """On the writer thread during a storage episode: save a checkpoint (sizeable, so a full disk does not
        pass it); raises when storage still fails, or when the child cannot give its state."""
        position, answer = self._ask_snapshot()
        self._save(answer.result(ANSWER_SECONDS), position)

    def _ask_snapshot(self) -> tuple[tuple[int, int], concurrent.futures.Future[Any]]:
        """On the writer thread, between two commits: storage's position now, and the snapshot asked for then."""
        assert self._child is not None
        return checkpoints.position(self.engine), self._child.ask("snapshot")

    def _save(self, state: bytes, position: tuple[int, int]) -> None:
        with checkpoints.writing(self.engine) as conn:
            checkpoints.save_on(conn, CHECKPOINT_NAME, CHECKPOINT_FORMAT, state, *position)
