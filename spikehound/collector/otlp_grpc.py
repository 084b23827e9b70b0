"""OTLP/gRPC receiver: TraceService, MetricsService and ProfilesService on one grpc.aio server.

Requests arrive as bytes and are parsed here, so that unreadable protobuf
answers INVALID_ARGUMENT with a message (grpc's own decoding would answer
UNKNOWN). Overload answers RESOURCE_EXHAUSTED and a storage failure
UNAVAILABLE, both with a ``google.rpc.RetryInfo`` and both retried by OTLP
exporters; a request with nothing valid in it answers INVALID_ARGUMENT.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message
from google.rpc import code_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import ExportProfilesServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from spikehound.collector.ingest import Admission, Ingest, InvalidPayload, Overloaded, Unavailable
from spikehound.collector.profiles_ingest import ProfileIngest
from spikehound.collector.rest.auth import bearer_ok
from spikehound.config import HostPort
from spikehound.export_outcome import Accepted
from spikehound.otlp import (
    Decoded,
    PayloadError,
    count_items,
    decode_metrics,
    decode_spans,
    parse_metrics_request,
    parse_trace_request,
    retry_trailers,
)

log = logging.getLogger("spikehound.collector.grpc")

TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
METRICS_SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"
PROFILES_SERVICE = "opentelemetry.proto.collector.profiles.v1development.ProfilesService"
MAX_CONCURRENT_RPCS = 256  # beyond this grpc itself answers RESOURCE_EXHAUSTED


class _Export:
    """One service's Export method: bytes in, response message out."""

    def __init__(self, ingest: Ingest, token: str, signal: str, parse: Callable[[bytes], Any],
                 decode: Callable[..., Decoded], response: type[Message], rejected_field: str) -> None:
        self.ingest, self.token, self.signal = ingest, token, signal
        self.parse, self.decode, self.response, self.rejected_field = parse, decode, response, rejected_field

    async def export(self, body: bytes, context: grpc.aio.ServicerContext) -> Message:
        async def take(admission: Admission) -> Accepted:
            admission.need(len(body))
            request = self.parse(body)
            self.ingest.check_room(self.signal, count_items(request))
            decoded = self.decode(request, body, limits=self.ingest.limits, not_after_ns=self.ingest.not_after_ns())
            del request  # its parse (several times the body) is not held through the wait for the commit
            return await self.ingest.submit(decoded, self.signal, "grpc", admission)

        return await _answer(self.ingest, self.token, context, self.response, self.rejected_field, take)


class _ProfilesExport:
    """ProfilesService's Export: admitted like the others, then written on its own (profiles_ingest.py)."""

    def __init__(self, profiles: ProfileIngest, token: str) -> None:
        self.profiles, self.token = profiles, token

    async def export(self, body: bytes, context: grpc.aio.ServicerContext) -> Message:
        async def take(admission: Admission) -> Accepted:
            with self.profiles.admit("grpc") as in_flight:
                admission.need(len(body))
                decoded = await self.profiles.decode_body(body, admission, in_flight)  # on a worker thread
                return await self.profiles.submit(decoded, "grpc", admission, in_flight)

        # rejected_profiles counts samples, as the HTTP answer says
        return await _answer(self.profiles.ingest, self.token, context, ExportProfilesServiceResponse,
                             "rejected_profiles", take)


async def _answer(ingest: Ingest, token: str, context: grpc.aio.ServicerContext, response_type: type[Message],
                  rejected_field: str, take: Callable[[Admission], Awaitable[Accepted]]) -> Message:
    """What every Export does around ``take`` (which decodes and stores a request with its bytes held): the
    token, the storage check, the byte budget, refusals as statuses, partial success."""
    # Refusals set the status and return instead of context.abort(): abort raises, and the exception's
    # traceback holds the caller's frame, whose ``body`` (up to max_request_bytes) then lives until the cyclic
    # garbage collector runs, which the collector's thresholds make rare: a flood of refused 16 MB exports
    # during an outage grew memory by gigabytes.
    counted = ingest.telemetry.rejected_requests
    if not _authorized(context, token):
        counted.labels("grpc", "unauthenticated").inc()
        return _refuse(context, grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token", None,
                       response_type())
    # The body's bytes are held from before decoding (which takes about twice as much again) to the answer.
    with ingest.admission("grpc") as admission:
        try:
            ingest.check_storage("grpc")
            accepted = await take(admission)
        except PayloadError as exc:
            counted.labels("grpc", "bad_payload").inc()
            return _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc), None, response_type())
        except InvalidPayload as exc:
            return _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc), None, response_type())
        except Overloaded as exc:
            return _refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), exc.retry_after, response_type())
        except Unavailable as exc:
            return _refuse(context, grpc.StatusCode.UNAVAILABLE, str(exc), exc.retry_after, response_type())
    response = response_type()
    if accepted.rejected or accepted.message:  # a message alone is a warning: values were cut to the limits
        setattr(response.partial_success, rejected_field, accepted.rejected)  # type: ignore[attr-defined]
        response.partial_success.error_message = accepted.message  # type: ignore[attr-defined]
    return response


def _authorized(context: grpc.aio.ServicerContext, token: str) -> bool:
    """Whether the call carries ``token`` as its bearer token (always, when no token is configured)."""
    if not token:
        return True
    header = dict(context.invocation_metadata() or ()).get("authorization")
    return bearer_ok(header if isinstance(header, str) else None, token)


def _refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, retry_after: int | None,
            response: Message) -> Message:
    """Answer ``code`` (the empty ``response`` is not sent with it); with ``retry_after``, a RetryInfo too."""
    if retry_after is not None:
        exhausted = code == grpc.StatusCode.RESOURCE_EXHAUSTED
        rpc_code = code_pb2.RESOURCE_EXHAUSTED if exhausted else code_pb2.UNAVAILABLE
        context.set_trailing_metadata(retry_trailers(rpc_code, message, retry_after))
    context.set_code(code)
    context.set_details(message)
    return response


def _handler(service: str, export: Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Message]]
             ) -> grpc.GenericRpcHandler:
    method = grpc.unary_unary_rpc_method_handler(export, request_deserializer=None,
                                                 response_serializer=lambda m: m.SerializeToString())
    return grpc.method_handlers_generic_handler(service, {"Export": method})


async def start_grpc(ingest: Ingest, listen: HostPort, token: str, max_message_bytes: int,
                     credentials: grpc.ServerCredentials | None = None,
                     secured: str = "", profiles: ProfileIngest | None = None) -> tuple[grpc.aio.Server, int]:
    """Start the OTLP/gRPC server and return it with its bound port; OSError when it cannot bind.

    With ``credentials`` it takes TLS only; ``secured`` says how, in the "listening on" line. ProfilesService
    is served when ``profiles`` is given.
    """
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", max_message_bytes),
                 ("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
    handlers = [
        _handler(TRACE_SERVICE, _Export(ingest, token, "spans", parse_trace_request, decode_spans,
                                        ExportTraceServiceResponse, "rejected_spans").export),
        _handler(METRICS_SERVICE, _Export(ingest, token, "metrics", parse_metrics_request, decode_metrics,
                                          ExportMetricsServiceResponse, "rejected_data_points").export),
    ]
    if profiles is not None:
        handlers.append(_handler(PROFILES_SERVICE, _ProfilesExport(profiles, token).export))
    server.add_generic_rpc_handlers(tuple(handlers))
    address = str(listen)
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot listen for OTLP/gRPC on {address}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot listen for OTLP/gRPC on {address}")
    await server.start()
    log.info("OTLP/gRPC listening on %s%s", HostPort(listen.host, port), secured)
    return server, port
