"""OTLP/gRPC receiver: TraceService and MetricsService on one grpc.aio server.

Overload answers RESOURCE_EXHAUSTED with a ``google.rpc.RetryInfo`` detail, and
a storage failure UNAVAILABLE, both retryable by OTLP exporters; a request
with nothing valid in it answers INVALID_ARGUMENT with the reasons.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from collector.ingest import Ingest, InvalidPayload, Overloaded, Unavailable, bearer_ok
from spikehound.config import HostPort
from spikehound.otlp import decode_metrics, decode_spans

log = logging.getLogger("spikehound.collector.grpc")

MAX_CONCURRENT_RPCS = 256  # beyond this grpc itself answers RESOURCE_EXHAUSTED


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str,
                 retry_after: int | None = None) -> NoReturn:
    if retry_after is None:
        await context.abort(code, message)
    detail = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED if code == grpc.StatusCode.RESOURCE_EXHAUSTED
                               else code_pb2.UNAVAILABLE, message=message)
    detail.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=Duration(seconds=retry_after)))
    await context.abort(code, message, trailing_metadata=(("grpc-status-details-bin", detail.SerializeToString()),))


class _Receiver:
    def __init__(self, ingest: Ingest, token: str) -> None:
        self.ingest = ingest
        self.token = token

    async def _check_auth(self, context: grpc.aio.ServicerContext) -> None:
        if not self.token:
            return
        header = dict(context.invocation_metadata() or ()).get("authorization")
        if not bearer_ok(header if isinstance(header, str) else None, self.token):
            self.ingest.telemetry.rejected_requests.labels("grpc", "unauthenticated").inc()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def _submit(self, decoded: Any, signal: str, context: grpc.aio.ServicerContext) -> tuple[int, str]:
        try:
            accepted = await self.ingest.submit(decoded, signal, "grpc")
        except InvalidPayload as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Overloaded as exc:
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), exc.retry_after)
        except Unavailable as exc:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(exc), exc.retry_after)
        return accepted.rejected, accepted.message


class TraceReceiver(_Receiver, trace_service_pb2_grpc.TraceServiceServicer):
    async def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
                     context: grpc.aio.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        await self._check_auth(context)
        rejected, message = await self._submit(decode_spans(request), "spans", context)
        response = trace_service_pb2.ExportTraceServiceResponse()
        if rejected:
            response.partial_success.rejected_spans = rejected
            response.partial_success.error_message = message
        return response


class MetricsReceiver(_Receiver, metrics_service_pb2_grpc.MetricsServiceServicer):
    async def Export(self, request: metrics_service_pb2.ExportMetricsServiceRequest,
                     context: grpc.aio.ServicerContext) -> metrics_service_pb2.ExportMetricsServiceResponse:
        await self._check_auth(context)
        rejected, message = await self._submit(decode_metrics(request), "metrics", context)
        response = metrics_service_pb2.ExportMetricsServiceResponse()
        if rejected:
            response.partial_success.rejected_data_points = rejected
            response.partial_success.error_message = message
        return response


async def start_grpc(ingest: Ingest, listen: HostPort, token: str,
                     max_message_bytes: int) -> tuple[grpc.aio.Server, int]:
    """Start the OTLP/gRPC server and return it with its bound port; OSError when it cannot bind."""
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", max_message_bytes),
                 ("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceReceiver(ingest, token), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(MetricsReceiver(ingest, token), server)
    address = str(listen)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot listen for OTLP/gRPC on {address}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot listen for OTLP/gRPC on {address}")
    await server.start()
    log.info("OTLP/gRPC listening on %s", HostPort(listen.host, port))
    return server, port
