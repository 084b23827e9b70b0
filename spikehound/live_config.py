"""What a reload (SIGHUP) may change in a running daemon, and what waits for a restart.

A daemon re-reads its configuration layers on SIGHUP. Keys that can change while data flows (log level and
format, retention caps) are copied into the running configuration, which the daemon's parts share, so the
next use sees them. Any other change (listen addresses, the database, queue sizes) is reported as needing a
restart and left as it was: half-applying it could drop data.

>>> from spikehound.config import load
>>> running = load(env={}, flags={"storage.url": "sqlite:///a.db"})
>>> new = load(env={}, flags={"storage.url": "sqlite:///b.db", "log.level": "debug"})
>>> change = apply_live(running, new, COLLECTOR_LIVE_KEYS, ignore_sections={"agent"})
>>> change.applied, change.need_restart, running.log.level, running.storage.url
(['log.level'], ['storage.url'], 'debug', 'sqlite:///a.db')
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from spikehound.config import AlertsConfig, Config, HostPort

LOG_KEYS = frozenset({"log.level", "log.format", "log.file"})
RETENTION_KEYS = frozenset({"storage.span_retention_hours", "storage.metric_retention_hours",
                            "storage.span_retention_max_bytes", "storage.metric_retention_max_points",
                            "storage.profile_retention_max_rows"})
# Receivers and routes are swapped by the collector's alerting; its outbox and alert groups stay.
ALERT_KEYS = frozenset(f"alerts.{f.name}" for f in dataclasses.fields(AlertsConfig))
COLLECTOR_LIVE_KEYS = LOG_KEYS | RETENTION_KEYS | ALERT_KEYS
AGENT_LIVE_KEYS = LOG_KEYS


@dataclass(slots=True)
class LiveChange:
    applied: list[str] = field(default_factory=list)  # keys now in effect
    need_restart: list[str] = field(default_factory=list)  # keys that changed but keep their running value

    def report(self, logger: logging.Logger) -> None:
        """One line of what now applies; a warning for each change that waits for a restart."""
        logger.info("configuration reloaded; now in effect: %s", ", ".join(self.applied) or "no changes")
        for key in self.need_restart:
            logger.warning("%s changed in the configuration; it takes effect at the next restart", key)


def flat_items(cfg: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every ``(section.key, value)`` of a configuration tree."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, HostPort):
            yield from flat_items(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def apply_live(running: Config, new: Config, live_keys: Collection[str],
               ignore_sections: Collection[str] = ()) -> LiveChange:
    """Copy the changed ``live_keys`` from ``new`` into ``running``; list the other changes."""
    old = dict(flat_items(running))
    change = LiveChange()
    for key, value in flat_items(new):
        if old.get(key) == value or key.partition(".")[0] in ignore_sections:
            continue
        if key in live_keys:
            section, _, name = key.rpartition(".")
            setattr(getattr(running, section) if section else running, name, value)
            change.applied.append(key)
        else:
            change.need_restart.append(key)
    return change
