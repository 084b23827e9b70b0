"""The agent's local OTLP/gRPC receiver (TraceService and MetricsService).

Requests arrive as raw bytes (no generated stubs on the hot path): they are
enriched and queued, and the answer is an Export response, empty unless
``partial_success`` reports spans or points too large to forward. A full
queue answers RESOURCE_EXHAUSTED, a disk that refuses the spool UNAVAILABLE,
both with a ``RetryInfo``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc
from google.rpc import code_pb2

from spikehound.agent.intake import Intake, QueueFull, QueueUnavailable
from spikehound.agent.spool import Signal
from spikehound.config import HostPort
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


def _export(intake: Intake, signal: Signal) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]:
    async def export(payload: bytes, context: grpc.aio.ServicerContext) -> bytes:
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
        return accepted.response().SerializeToString() if accepted.rejected else b""

    return export


async def start_grpc(intake: Intake, listen: HostPort, max_message_bytes: int) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.so_reuseport", 0), ("grpc.http2.bdp_probe", 0),
                                      ("grpc.http2.lookahead_bytes", RECEIVE_WINDOW_BYTES)])
    server.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler(service, {"Export": grpc.unary_unary_rpc_method_handler(
            _export(intake, signal), request_deserializer=None, response_serializer=None)})
        for signal, service in _SERVICES.items()])
    try:
        port = server.add_insecure_port(str(listen))
    except RuntimeError as exc:
        raise OSError(f"cannot listen for OTLP/gRPC on {listen}: {exc}") from None
    await server.start()
    log.info("OTLP/gRPC listening on %s", HostPort(listen.host, port))
    return server, port
