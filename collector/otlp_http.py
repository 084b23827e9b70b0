"""OTLP/HTTP receiver: ``POST /v1/traces`` and ``/v1/metrics``, protobuf or JSON, gzip or not.

Answers follow the OTLP/HTTP specification: the response (or the error
``google.rpc.Status``) is encoded like the request; overload is 429 and a
storage failure 503, both with ``Retry-After``; bad payloads are 400, an
unknown media type 415 and an oversized body 413, each with a message. A
``Content-Length`` over the limit is refused before any of the body is read;
a sender that hangs up mid-upload is counted in
``spikehound_ingest_aborted_requests_total`` and logged at debug level only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import PayloadEncodingError
from google.protobuf import json_format
from google.protobuf.message import Message
from google.rpc import status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from collector.ingest import Ingest, InvalidPayload, Overloaded, Unavailable, bearer_ok
from spikehound.otlp import (
    MEDIA_TYPES,
    BodyTooLarge,
    Decoded,
    PayloadError,
    count_items,
    decode_metrics,
    decode_spans,
    gunzip,
    parse_metrics_request,
    parse_trace_request,
)

log = logging.getLogger("spikehound.collector.http")

PROTOBUF = "application/x-protobuf"
JSON = "application/json"


class HttpReceiver:
    def __init__(self, ingest: Ingest, token: str, max_request_bytes: int) -> None:
        self.ingest = ingest
        self.token = token
        self.max_request_bytes = max_request_bytes

    def app(self) -> web.Application:
        # aiohttp would inflate the body itself, without a size cap: gunzip() does it with one.
        app = web.Application(client_max_size=self.max_request_bytes, handler_args={"auto_decompress": False})
        app.router.add_post("/v1/traces", self.traces)
        app.router.add_post("/v1/metrics", self.metrics)
        return app

    async def traces(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "spans", parse_trace_request, decode_spans,
                                  ExportTraceServiceResponse, "rejected_spans")

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "metrics", parse_metrics_request, decode_metrics,
                                  ExportMetricsServiceResponse, "rejected_data_points")

    async def _handle(self, request: web.Request, signal: str, parse: Callable[..., Any],
                      decode: Callable[..., Decoded], response_type: type[Message],
                      rejected_field: str) -> web.StreamResponse:
        counted = self.ingest.telemetry.rejected_requests
        if not bearer_ok(request.headers.get("Authorization"), self.token):
            counted.labels("http", "unauthenticated").inc()
            return web.json_response({"code": 16, "message": "missing or wrong bearer token"}, status=401)
        media = request.content_type
        if media not in MEDIA_TYPES:
            counted.labels("http", "unsupported_media_type").inc()
            return web.json_response({"code": 3, "message": f"unsupported Content-Type {media!r}; "
                                      f"use {PROTOBUF} or {JSON}"}, status=415)
        as_json = MEDIA_TYPES[media]
        encoding = request.headers.get("Content-Encoding", "identity").lower()
        if encoding not in ("gzip", "identity", ""):
            counted.labels("http", "unsupported_encoding").inc()
            return self._status(as_json, 415, f"unsupported Content-Encoding {encoding!r}; use gzip or none")
        too_large = f"request body exceeds {self.max_request_bytes} bytes"
        if request.content_length is not None and request.content_length > self.max_request_bytes:
            counted.labels("http", "too_large").inc()  # said up front: none of the body is read
            response = self._status(as_json, 413, too_large)
            response.force_close()  # the unread rest of the body is not worth keeping the connection for
            return response
        # The request's bytes are held from before its body is read until the answer: refused up front when the
        # announced length does not fit now (none of the body is read), and again when the body inflates.
        with self.ingest.admission("http") as admission:
            try:
                admission.need(request.content_length or 0)
            except Overloaded as exc:
                response = self._status(as_json, 429, str(exc), retry_after=exc.retry_after)
                response.force_close()  # the unread body is not worth keeping the connection for
                return response
            try:
                body = await request.read()
            except ConnectionError as exc:
                # The sender hung up mid-upload: routine for a client that timed out or was killed, so no
                # traceback; the answer below goes nowhere.
                self.ingest.telemetry.aborted_requests.labels("http").inc()
                log.debug("OTLP/HTTP sender %s hung up mid-upload: %s", request.remote, exc)
                return self._status(as_json, 400, "the request body did not arrive")
            except PayloadEncodingError as exc:  # a broken chunked encoding
                counted.labels("http", "bad_payload").inc()
                return self._status(as_json, 400, f"unreadable request body: {exc.message}")
            except web.HTTPRequestEntityTooLarge:
                counted.labels("http", "too_large").inc()
                return self._status(as_json, 413, too_large)
            try:
                if encoding == "gzip":
                    body = gunzip(body, self.max_request_bytes)
                admission.need(len(body))
                request_message = parse(body, json=as_json)
                self.ingest.check_room(signal, count_items(request_message))
                decoded = decode(request_message, None if as_json else body, limits=self.ingest.limits,
                                 not_after_ns=self.ingest.not_after_ns())
            except BodyTooLarge:
                counted.labels("http", "too_large").inc()
                return self._status(as_json, 413, too_large)
            except PayloadError as exc:
                counted.labels("http", "bad_payload").inc()
                return self._status(as_json, 400, str(exc))
            except Overloaded as exc:
                return self._status(as_json, 429, str(exc), retry_after=exc.retry_after)
            try:
                accepted = await self.ingest.submit(decoded, signal, "http", admission)
            except InvalidPayload as exc:
                return self._status(as_json, 400, str(exc))
            except Overloaded as exc:
                return self._status(as_json, 429, str(exc), retry_after=exc.retry_after)
            except Unavailable as exc:
                return self._status(as_json, 503, str(exc), retry_after=exc.retry_after)
        response = response_type()
        if accepted.rejected or accepted.message:  # a message alone is a warning: values were cut to the limits
            setattr(response.partial_success, rejected_field, accepted.rejected)
            response.partial_success.error_message = accepted.message
        return self._encode(response, as_json, 200)

    def _status(self, as_json: bool, http_status: int, message: str,
                retry_after: int | None = None) -> web.Response:
        grpc_code = {400: 3, 413: 3, 415: 3, 429: 8, 503: 14}.get(http_status, 2)
        response = self._encode(status_pb2.Status(code=grpc_code, message=message), as_json, http_status)
        if retry_after is not None:
            response.headers["Retry-After"] = str(retry_after)
        return response

    @staticmethod
    def _encode(message: Message, as_json: bool, http_status: int) -> web.Response:
        if as_json:
            text = json_format.MessageToJson(message, indent=None)
            return web.Response(status=http_status, text=text, content_type=JSON)
        return web.Response(status=http_status, body=message.SerializeToString(), content_type=PROTOBUF)
