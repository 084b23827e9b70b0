"""The collector: OTLP receivers, ingest, the writer thread and the detectors it runs, alerts, the REST API and
the web pages (docs/architecture.md).

The CLI starts it (``daemon``), builds its detection settings (``detection``), replays stored spans through
the detectors (``replay``) and prints spike pages' addresses (``web``); the rest is the collector's own.
"""

import os

# The detection process is forked from the collector while its gRPC server serves exports, and never uses
# gRPC. grpcio's fork support (on by default) then skips its fork handlers ("other threads are currently
# calling into gRPC") and the child crashed within milliseconds on most forks under load (SIGSEGV, or SIGABRT
# in ev_epoll1): a killed detection process was not started again while the load lasted. Off, the child
# leaves gRPC's copy of its state alone. Set before any module of the collector imports grpc.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"

__all__ = ["daemon", "detection_driver", "replay", "web"]
