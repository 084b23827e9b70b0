"""Logging set-up: plain lines for journald by default, JSON lines on request, secrets never written.

Under systemd (``$JOURNAL_STREAM`` names our stderr) plain lines carry a ``<N>`` syslog priority prefix,
which journald turns into the entry's priority (``journalctl -p warning`` works), and no timestamp of
their own, since journald adds one. ``setup`` may be called again (SIGHUP) to change level or format.

>>> import logging
>>> line = RedactingFormatter(logging.Formatter("%(message)s"), ["s3cret"])
>>> line.format(logging.makeLogRecord({"msg": "connect to postgresql://app:%s@db", "args": ("s3cret",)}))
'connect to postgresql://app:***@db'
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from collections.abc import Sequence

import orjson

from spikehound.config import Config, ConfigError, secret_values

# syslog priorities of our levels, for journald's SyslogLevelPrefix=
_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record), "level": record.levelname.lower(), "logger": record.name,
                 "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


class JournalFormatter(logging.Formatter):
    """``<priority>LEVEL logger: message``: journald stores the priority and adds the time."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        priority = _PRIORITY.get(record.levelno, 6 if record.levelno < logging.WARNING else 3)
        return f"<{priority}>{super().format(record)}"


class RedactingFormatter(logging.Formatter):
    """Wraps another formatter and replaces every secret in its output (exceptions included) with ``***``."""

    def __init__(self, inner: logging.Formatter, secrets: Sequence[str]) -> None:
        super().__init__()
        self.inner = inner
        self.secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

    def format(self, record: logging.LogRecord) -> str:
        text = self.inner.format(record)
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text


def under_journald(stream: object = None) -> bool:
    """Whether ``stream`` (stderr by default) is connected to the journal, as systemd tells via JOURNAL_STREAM."""
    expected = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat((stream or sys.stderr).fileno())  # type: ignore[attr-defined]
    except (OSError, AttributeError, ValueError):
        return False
    return bool(expected) and expected == f"{st.st_dev}:{st.st_ino}"


def setup(level: str = "info", fmt: str = "plain", file: str = "", secrets: Sequence[str] = ()) -> None:
    """Log to stderr (and ``file``, if given) at ``level``; raises OSError when ``file`` cannot be opened."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if file:
        handlers.append(logging.handlers.WatchedFileHandler(file, encoding="utf-8"))
    for handler in handlers:
        if fmt == "json":
            inner: logging.Formatter = JsonFormatter()
        elif isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler) \
                and under_journald(handler.stream):
            inner = JournalFormatter()
        else:
            inner = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        handler.setFormatter(RedactingFormatter(inner, secrets))
    root = logging.getLogger()
    for old in root.handlers:
        old.close()
    root.handlers[:] = handlers
    root.setLevel(level.upper())
    # aiohttp logs every request at INFO; the access log is not ours to flood journald with.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def configure(cfg: Config) -> None:
    """``setup`` from the ``[log]`` section, hiding every secret the configuration holds.

    A ``log.file`` that cannot be opened is a configuration error, named like any other.
    """
    try:
        setup(cfg.log.level, cfg.log.format, cfg.log.file, secret_values(cfg))
    except OSError as exc:
        raise ConfigError(f"log.file: cannot open {cfg.log.file}: {exc.strerror}") from None
