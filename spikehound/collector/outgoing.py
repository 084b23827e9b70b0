"""What detection produced and storage has not yet committed: windows and spike states, in order.

One buffer for the detection driver (filled by its steps) and for the collector's side of a detection process
(filled by the child's answers, on another thread): steps are kept whole and in order, handed to the writer
all at once, and given back first when the write failed.

>>> from spikehound.detectors.engine import Detection
>>> def window(operation, samples=()):
...     return LatencyWindow("svc", operation, 0, 10, 1, 5, 5, 5, 5, samples=samples)
>>> waiting = Outgoing()
>>> waiting.keep(Detection(windows=[window("w1", samples=((5, b"t", b"s", 10),))]))
>>> waiting.keep(Detection(windows=[window("w2")]))
>>> out = waiting.take(); [(w.operation, w.samples) for w in out.windows], bool(waiting)
([('w1', ()), ('w2', ())], False)
>>> waiting.keep(Detection(windows=[window("w3")])); waiting.give_back(out)
>>> [w.operation for w in waiting.take().windows]
['w1', 'w2', 'w3']
"""

from __future__ import annotations

import threading
from dataclasses import replace

from spikehound.detectors.engine import Detection
from spikehound.model import LatencyWindow, Spike

__all__ = ["Outgoing"]


class Outgoing:
    """Thread-safe: one thread may keep while another takes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting = Detection()

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._waiting.windows or self._waiting.spikes)

    def keep(self, step: Detection) -> None:
        """A step's windows and spikes, after those kept before (every state: the writer keeps the last). A
        window is kept without its requests (``samples``): the detectors judged them already, storage keeps its
        figures only, and a replay after a restart closes thousands of windows before the first write."""
        windows = [replace(w, samples=()) if w.samples else w for w in step.windows]
        with self._lock:
            self._waiting.windows.extend(windows)
            self._waiting.spikes.extend(step.spikes)

    def take(self) -> Detection:
        """Everything waiting, handed over; ``give_back`` it if the write fails."""
        with self._lock:
            out, self._waiting = self._waiting, Detection()
        return out

    def give_back(self, out: Detection) -> None:
        """``out``'s write failed: it goes out again first, with the next write."""
        with self._lock:
            self._waiting = Detection(windows=out.windows + self._waiting.windows,
                                      spikes=out.spikes + self._waiting.spikes)

    @property
    def windows(self) -> list[LatencyWindow]:
        """The windows waiting (a copy)."""
        with self._lock:
            return list(self._waiting.windows)

    @property
    def spikes(self) -> list[Spike]:
        """The spike states waiting (a copy)."""
        with self._lock:
            return list(self._waiting.spikes)
