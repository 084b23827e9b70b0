"""Loopback ports for the daemons the tests and the benchmarks start.

A port is picked here, closed, and bound again later by the daemon it is given to. Between the two, nothing
must take it: not this process (it never hands a port out twice in a row), not another pytest-xdist worker
(each worker draws from a slice of its own), and not the kernel (the slices lie below the ephemeral range,
so an outgoing connection or a daemon told to listen on port 0 never lands on one).
"""

from __future__ import annotations

import os
import random
import socket
import threading
from collections import deque

# Below Linux's default ephemeral range (32768-60999) and above the well-known and most registered ports.
_FIRST, _LAST = 12000, 32000
_SLICES = 16  # enough for any -n this machine would use; worker N uses slice N % 16
_RECENT = deque[int](maxlen=256)  # handed out lately: a daemon given three ports in a row must not get one twice
_LOCK = threading.Lock()


def _worker_slice() -> range:
    """This process's ports: a pytest-xdist worker's own slice (``PYTEST_XDIST_WORKER=gw3``), else the last."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) % (_SLICES - 1) if worker.startswith("gw") and worker[2:].isdigit() else _SLICES - 1
    width = (_LAST - _FIRST) // _SLICES
    return range(_FIRST + index * width, _FIRST + (index + 1) * width)


_PORTS = _worker_slice()
_cursor = random.randrange(len(_PORTS))  # two runs at once start apart


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now and that no other test worker will be handed.

    >>> 12000 <= free_port() < 32000
    True
    """
    global _cursor
    with _LOCK:
        for _ in range(len(_PORTS)):
            port = _PORTS[_cursor]
            _cursor = (_cursor + 1) % len(_PORTS)
            if port not in _RECENT and _bindable(port):
                _RECENT.append(port)
                return port
    raise RuntimeError(f"no free loopback port in {_PORTS.start}-{_PORTS.stop - 1}")
