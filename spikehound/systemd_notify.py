"""Tell systemd how the service is doing (``sd_notify``) through ``$NOTIFY_SOCKET``; a no-op without systemd.

The protocol is one unix datagram of newline-separated ``KEY=VALUE`` lines sent to the socket that
``$NOTIFY_SOCKET`` names (a leading ``@`` means Linux's abstract namespace). systemd documents it as stable
and meant to be re-implemented (sd_notify(3)), so this needs neither libsystemd nor a C extension.

``WATCHDOG_USEC`` (set by ``WatchdogSec=``) asks for a ``WATCHDOG=1`` at least that often; systemd's advice,
followed here, is to ping at half the interval. ``WATCHDOG_PID``, when set, names the process meant.

>>> quiet = Notifier(env={})
>>> quiet.enabled, quiet.notify("READY=1"), quiet.watchdog_interval
(False, False, None)
>>> Notifier(env={"NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "30000000"}).watchdog_interval
15.0
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger("spikehound.systemd")


def _address(value: str) -> str | None:
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    if value:
        log.warning("NOTIFY_SOCKET=%r is not a unix socket path; not notifying systemd", value)
    return None


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None  # meant for another process (the main process forked us, say)
    return int(usec) / 2 / 1e6


class Notifier:
    """Sends service state to systemd. Every method returns whether a datagram went out.

    The socket is non-blocking: a notification systemd cannot take right now is dropped rather than
    stalling the event loop that sends it (the next watchdog ping follows anyway).
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.address = _address(env.get("NOTIFY_SOCKET", ""))
        self.watchdog_interval = _watchdog_interval(env) if self.address else None
        self._socket: socket.socket | None = None
        self._failures = 0

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        if self.address is None:
            return False
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._socket.setblocking(False)
            self._socket.sendto("\n".join(lines).encode(), self.address)
        except OSError as exc:
            self._failures += 1
            if self._failures == 1:  # once: a missing socket would otherwise log at every watchdog ping
                log.warning("cannot notify systemd at %s: %s", os.environ.get("NOTIFY_SOCKET"), exc)
            return False
        return True

    def status(self, text: str) -> bool:
        """A one-line status that ``systemctl status`` shows."""
        return self.notify(f"STATUS={_one_line(text)}")

    def ready(self, text: str) -> bool:
        """Start-up (or a reload) is complete: the service takes work."""
        return self.notify("READY=1", f"STATUS={_one_line(text)}")

    def reloading(self, text: str) -> bool:
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}",
                           f"STATUS={_one_line(text)}")

    def stopping(self, text: str) -> bool:
        return self.notify("STOPPING=1", f"STATUS={_one_line(text)}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _one_line(text: str) -> str:
    return " ".join(text.split())
