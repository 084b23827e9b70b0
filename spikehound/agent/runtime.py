"""How the agent process runs: gRPC's transport, chosen before gRPC loads, and uvloop's event loop.

The agent makes a handful of small gRPC calls a second (two or so in from the
local model servers, two out to the collector). On such a light load most of
gRPC's CPU goes to waking its EventEngine threads, not to the bytes, and
gRPC's poll-based transport has no such threads to wake. So the agent asks
for that transport, unless the operator already set ``GRPC_EXPERIMENTS`` (any
value, even empty, is left alone). ``GRPC_VERBOSITY`` defaults to ``ERROR`` so
gRPC's informational lines (a GOAWAY at shutdown) stay out of the journal.

The event loop is uvloop's (libuv) rather than asyncio's own: it spends less
of the agent's CPU on each wake-up, for a little more resident memory.

>>> env = {}
>>> prefer_poll_transport(env)
True
>>> env["GRPC_EXPERIMENTS"]
'-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints'
>>> prefer_poll_transport({"GRPC_EXPERIMENTS": ""})
False
"""

from __future__ import annotations

import os
import sys
from collections.abc import Coroutine, MutableMapping
from typing import Any, TypeVar

T = TypeVar("T")

POLL_TRANSPORT = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"


def prefer_poll_transport(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Default the process to gRPC's poll-based transport; False if the operator chose otherwise, or too late.

    gRPC reads its experiments once, when it is loaded, so this does nothing
    once ``grpc`` is imported (as in a test that runs the agent in-process).
    """
    if environ is os.environ and "grpc" in sys.modules:
        return False
    environ.setdefault("GRPC_VERBOSITY", "ERROR")
    if "GRPC_EXPERIMENTS" in environ:
        return False
    environ["GRPC_EXPERIMENTS"] = POLL_TRANSPORT
    return True


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on a uvloop event loop."""
    import uvloop

    return uvloop.run(main)
