"""The collector: OTLP receivers, ingest, the writer thread and the detectors it runs, alerts, the REST API and
the web pages (docs/architecture.md).

The CLI starts it (``daemon``), builds its detection settings (``detection``), replays stored spans through
the detectors (``replay``) and prints spike pages' addresses (``web``); the rest is the collector's own.
"""

__all__ = ["daemon", "detection_driver", "replay", "web"]
