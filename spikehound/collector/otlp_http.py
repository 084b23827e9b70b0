"""OTLP/HTTP receiver: ``POST /v1/traces``, ``/v1/metrics`` and ``/v1development/profiles``, protobuf or JSON,
gzip or not.

Answers follow the OTLP/HTTP specification: the response (or the error
``google.rpc.Status``) is encoded like the request; overload is 429 and a
storage failure 503, both with ``Retry-After``; bad payloads are 400, an
unknown media type 415 and an oversized body 413, each with a message. A
``Content-Length`` over the limit is refused before any of the body is read;
a sender that hangs up mid-upload is counted in
``spikehound_ingest_aborted_requests_total`` and logged at debug level only.
The framing (media types, gzip, the error answers) is the agent's too:
``spikehound/otlp_http_framing.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from google.protobuf.message import Message
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import ExportProfilesServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from spikehound.collector.ingest import Admission, Ingest, InvalidPayload, Overloaded, Unavailable
from spikehound.collector.profiles_ingest import ProfileIngest
from spikehound.collector.rest.auth import bearer_ok
from spikehound.otlp import (
    Decoded,
    PayloadError,
    count_items,
    decode_metrics,
    decode_spans,
    parse_metrics_request,
    parse_trace_request,
)
from spikehound.otlp_http_framing import (
    Framing,
    Refused,
    message_response,
    read_body,
    receiver_app,
    request_framing,
    status_response,
    too_large_response,
)

log = logging.getLogger("spikehound.collector.http")


class HttpReceiver:
    """The collector's OTLP/HTTP handlers; profiles are taken when ``profiles`` is given."""

    def __init__(self, ingest: Ingest, token: str, max_request_bytes: int,
                 profiles: ProfileIngest | None = None) -> None:
        self.ingest = ingest
        self.token = token
        self.max_request_bytes = max_request_bytes
        self.profiles_ingest = profiles

    def app(self) -> web.Application:
        return receiver_app(self.traces, self.metrics, self.max_request_bytes,
                            profiles=self.profiles if self.profiles_ingest is not None else None)

    async def traces(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "spans", parse_trace_request, decode_spans,
                                  ExportTraceServiceResponse, "rejected_spans")

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "metrics", parse_metrics_request, decode_metrics,
                                  ExportMetricsServiceResponse, "rejected_data_points")

    async def profiles(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1development/profiles``: admitted like the others, then written on its own
        (spikehound/collector/profiles_ingest.py)."""
        profiles = self.profiles_ingest
        assert profiles is not None, "routed only with a ProfileIngest"
        framing = self._framing(request)
        if isinstance(framing, web.StreamResponse):
            return framing
        as_json = framing.as_json
        body: bytes | web.StreamResponse | None = None
        with self.ingest.admission("http") as admission:
            try:
                self.ingest.check_storage("http")
                with profiles.admit("http") as in_flight:
                    body = await self._body(request, framing, admission)
                    if isinstance(body, web.StreamResponse):
                        return body
                    admission.need(len(body))
                    decoded = await profiles.decode_body(body, admission, in_flight, json=as_json)  # worker thread
                    accepted = await profiles.submit(decoded, "http", admission, in_flight)
            except PayloadError as exc:
                self.ingest.telemetry.rejected_requests.labels("http", "bad_payload").inc()
                return status_response(400, str(exc), as_json)
            except InvalidPayload as exc:
                return status_response(400, str(exc), as_json)
            except (Overloaded, Unavailable) as exc:
                response = status_response(429 if isinstance(exc, Overloaded) else 503, str(exc), as_json,
                                           retry_after=exc.retry_after)
                if body is None:
                    response.force_close()  # refused before its body was read: not worth keeping the connection
                return response
        response = ExportProfilesServiceResponse()
        if accepted.rejected or accepted.message:  # a message alone is a warning: values were cut to the limits
            response.partial_success.rejected_profiles = accepted.rejected  # samples refused
            response.partial_success.error_message = accepted.message
        return message_response(response, as_json)

    def _framing(self, request: web.Request) -> Framing | web.StreamResponse:
        """The request's framing, or the answer refusing it: no token, a media type or encoding OTLP does not
        have, an announced length over the limit (none of the body is read)."""
        counted = self.ingest.telemetry.rejected_requests
        if not bearer_ok(request.headers.get("Authorization"), self.token):
            counted.labels("http", "unauthenticated").inc()
            return web.json_response({"code": 16, "message": "missing or wrong bearer token"}, status=401)
        try:
            framing = request_framing(request, name_supported=True)
        except Refused as refused:
            counted.labels("http", refused.reason).inc()
            return refused.response
        if request.content_length is not None and request.content_length > self.max_request_bytes:
            counted.labels("http", "too_large").inc()  # said up front: none of the body is read
            response = too_large_response(self.max_request_bytes, framing.as_json)
            response.force_close()  # the unread rest of the body is not worth keeping the connection for
            return response
        return framing

    async def _body(self, request: web.Request, framing: Framing, admission: Admission) -> bytes | web.StreamResponse:
        """The body, inflated, with its announced length held in the budget first; or the answer refusing it."""
        admission.need(request.content_length or 0)  # Overloaded before any of the body is read
        try:
            return await read_body(request, framing, self.max_request_bytes)
        except Refused as refused:
            if refused.reason == "aborted":  # no traceback: a sender that timed out or was killed
                self.ingest.telemetry.aborted_requests.labels("http").inc()
                log.debug("OTLP/HTTP sender %s hung up mid-upload", request.remote)
            else:
                self.ingest.telemetry.rejected_requests.labels("http", refused.reason).inc()
            return refused.response

    async def _handle(self, request: web.Request, signal: str, parse: Callable[..., Any],
                      decode: Callable[..., Decoded], response_type: type[Message],
                      rejected_field: str) -> web.StreamResponse:
        counted = self.ingest.telemetry.rejected_requests
        framing = self._framing(request)
        if isinstance(framing, web.StreamResponse):
            return framing
        as_json = framing.as_json
        # The request's bytes are held from before its body is read until the answer: refused up front when the
        # announced length does not fit now (none of the body is read), and again when the body inflates.
        with self.ingest.admission("http") as admission:
            try:
                self.ingest.check_storage("http")
                body = await self._body(request, framing, admission)
            except (Overloaded, Unavailable) as exc:
                response = status_response(429 if isinstance(exc, Overloaded) else 503, str(exc), as_json,
                                           retry_after=exc.retry_after)
                response.force_close()  # the unread body is not worth keeping the connection for
                return response
            if isinstance(body, web.StreamResponse):
                return body
            try:
                admission.need(len(body))
                request_message = parse(body, json=as_json)
                self.ingest.check_room(signal, count_items(request_message))
                decoded = decode(request_message, None if as_json else body, limits=self.ingest.limits,
                                 not_after_ns=self.ingest.not_after_ns())
            except PayloadError as exc:
                counted.labels("http", "bad_payload").inc()
                return status_response(400, str(exc), as_json)
            except Overloaded as exc:
                return status_response(429, str(exc), as_json, retry_after=exc.retry_after)
            del request_message  # its parse (several times the body) is not held through the wait for the commit
            try:
                accepted = await self.ingest.submit(decoded, signal, "http", admission)
            except InvalidPayload as exc:
                return status_response(400, str(exc), as_json)
            except Overloaded as exc:
                return status_response(429, str(exc), as_json, retry_after=exc.retry_after)
            except Unavailable as exc:
                return status_response(503, str(exc), as_json, retry_after=exc.retry_after)
        response = response_type()
        if accepted.rejected or accepted.message:  # a message alone is a warning: values were cut to the limits
            setattr(response.partial_success, rejected_field, accepted.rejected)
            response.partial_success.error_message = accepted.message
        return message_response(response, as_json)
