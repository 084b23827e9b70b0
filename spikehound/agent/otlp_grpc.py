"""The agent's local OTLP/gRPC receiver (TraceService and MetricsService).

Requests arrive as raw bytes (no generated stubs on the hot path): they are
enriched and queued, and the answer is an Export response, empty unless
``partial_success`` reports spans or points too large to forward. A full
queue answers RESOURCE_EXHAUSTED, a disk that refuses the spool UNAVAILABLE,
both with a ``RetryInfo``. A request whose chain of agent ids holds this agent's own came back to it (a
member that is this agent through a name or a proxy, or an agent forwarding to this one): it is refused with
FAILED_PRECONDITION and ``LOOP_TRAILER``, which tells that forwarder to leave the member out (counted, never
queued again).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc
from google.rpc import code_pb2

from spikehound.agent.forwarder import INSTANCE_HEADER, LOOP_TRAILER, AgentChain
from spikehound.agent.intake import Intake, QueueUnavailable, export_response
from spikehound.agent.spool import Signal
from spikehound.config import HostPort
from spikehound.export_outcome import QueueFull
from spikehound.otlp import PayloadError, retry_trailers

log = logging.getLogger("spikehound.agent.grpc")

_SERVICES = {Signal.TRACES: "opentelemetry.proto.collector.trace.v1.TraceService",
             Signal.METRICS: "opentelemetry.proto.collector.metrics.v1.MetricsService"}
RETRY_AFTER_SECONDS = 1
# A fixed 4 MiB receive window instead of gRPC's probing one (starts at 64 KiB, grown by BDP pings): an SDK's
# 512-span request (about 75 KB) then arrives without a window update or ping in between, which saves the
# agent about 0.3 ms of CPU per request. The senders are local, so the window costs no memory that a
# large request would not take anyway.
RECEIVE_WINDOW_BYTES = 4 << 20


LOOP_MESSAGE = ("forwarding loop: this request already went through this agent (agent.collector names this "
                "agent through a name or a proxy, or an agent that forwards to this one)")


def _export(intake: Intake, signal: Signal,
            chain: AgentChain | None) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]:
    async def export(payload: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if chain is not None and any(key == INSTANCE_HEADER and isinstance(value, str) and chain.note(value)
                                     for key, value in context.invocation_metadata() or ()):
            intake.forward_loops += 1
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, LOOP_MESSAGE,
                                trailing_metadata=((LOOP_TRAILER, chain.instance),))
        try:
            accepted = intake.accept(signal, payload, "grpc", peer=context.peer())
        except PayloadError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFull as exc:
            trailers = retry_trailers(code_pb2.RESOURCE_EXHAUSTED, str(exc), RETRY_AFTER_SECONDS)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), trailing_metadata=trailers)
        except QueueUnavailable as exc:
            trailers = retry_trailers(code_pb2.UNAVAILABLE, str(exc), RETRY_AFTER_SECONDS)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc), trailing_metadata=trailers)
        # An empty ExportTraceServiceResponse / ExportMetricsServiceResponse unless something was rejected.
        return export_response(signal, accepted).SerializeToString() if accepted.rejected else b""

    return export


async def start_grpc(intake: Intake, listen: HostPort, max_message_bytes: int,
                     chain: AgentChain | None = None) -> tuple[grpc.aio.Server, int]:
    """The receiver on ``listen``; ``chain``: the agent's id (a request that carries it is refused) and the
    upstream agents it learns from what it receives."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.so_reuseport", 0), ("grpc.http2.bdp_probe", 0),
                                      ("grpc.http2.lookahead_bytes", RECEIVE_WINDOW_BYTES)])
    server.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler(service, {"Export": grpc.unary_unary_rpc_method_handler(
            _export(intake, signal, chain), request_deserializer=None, response_serializer=None)})
        for signal, service in _SERVICES.items()])
    try:
        port = server.add_insecure_port(str(listen))
    except RuntimeError as exc:
        raise OSError(f"cannot listen for OTLP/gRPC on {listen}: {exc}") from None
    await server.start()
    log.info("OTLP/gRPC listening on %s", HostPort(listen.host, port))
    return server, port
