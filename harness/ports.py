"""Loopback ports for the daemons the tests and the benchmarks start."""

from __future__ import annotations

import socket
import threading
from collections import deque

_RECENT = deque[int](maxlen=256)  # handed out lately: the OS may offer a just-closed port again at once
_LOCK = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS's pick), not one this process handed out lately:
    a daemon given three ports in a row must not get one twice."""
    with _LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _RECENT:
                _RECENT.append(port)
                return port
