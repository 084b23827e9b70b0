"""The agent's local OTLP/HTTP receiver: ``POST /v1/traces`` and ``/v1/metrics``.

JSON bodies are converted to protobuf here, so the forward queue and the
collector only ever see protobuf. Errors follow the OTLP/HTTP specification
(400 unreadable, 413 too large, 415 unknown media type, 429 + Retry-After
when the queue is full, 503 + Retry-After when the disk refuses the spool);
spans or points too large to forward are reported in ``partial_success``.
"""

from __future__ import annotations

from aiohttp import web
from google.protobuf import json_format
from google.rpc import status_pb2

from agent.intake import Intake, QueueFull, QueueUnavailable
from agent.otlp_grpc import RETRY_AFTER_SECONDS
from agent.spool import Signal
from spikehound.otlp import MEDIA_TYPES, BodyTooLarge, PayloadError, gunzip


def _status(code: int, message: str, http_status: int, as_json: bool, retry_after: int | None = None) -> web.Response:
    """A ``google.rpc.Status`` body, in the encoding of the request as OTLP/HTTP requires."""
    status = status_pb2.Status(code=code, message=message)
    if as_json:
        response = web.Response(status=http_status, text=json_format.MessageToJson(status, indent=None),
                                content_type="application/json")
    else:
        response = web.Response(status=http_status, body=status.SerializeToString(),
                                content_type="application/x-protobuf")
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    return response


def http_app(intake: Intake, max_request_bytes: int) -> web.Application:
    async def handle(request: web.Request, signal: Signal) -> web.Response:
        as_json = MEDIA_TYPES.get(request.content_type)
        if as_json is None:
            intake.invalid_requests["http"] += 1
            return web.json_response({"code": 3, "message": f"unsupported Content-Type {request.content_type!r}"},
                                     status=415)
        encoding = request.headers.get("Content-Encoding", "identity").lower()
        if encoding not in ("gzip", "identity", ""):
            intake.invalid_requests["http"] += 1
            return _status(3, f"unsupported Content-Encoding {encoding!r}; use gzip or none", 415, as_json)
        try:
            body = await request.read()
            if encoding == "gzip":
                try:
                    body = gunzip(body, max_request_bytes)
                except PayloadError:  # accept() counts the requests it cannot read; count a broken gzip too
                    intake.invalid_requests["http"] += 1
                    raise
            accepted = intake.accept(signal, body, "http", json=as_json)
        except (web.HTTPRequestEntityTooLarge, BodyTooLarge):
            intake.invalid_requests["http"] += 1
            return _status(3, f"request body exceeds {max_request_bytes} bytes", 413, as_json)
        except PayloadError as exc:
            return _status(3, str(exc), 400, as_json)
        except QueueFull as exc:
            return _status(8, str(exc), 429, as_json, retry_after=RETRY_AFTER_SECONDS)
        except QueueUnavailable as exc:
            return _status(14, str(exc), 503, as_json, retry_after=RETRY_AFTER_SECONDS)
        if accepted.rejected and as_json:
            return web.Response(text=json_format.MessageToJson(accepted.response(), indent=None),
                                content_type="application/json")
        if as_json:
            return web.json_response({})
        body = accepted.response().SerializeToString() if accepted.rejected else b""
        return web.Response(body=body, content_type="application/x-protobuf")

    async def traces(request: web.Request) -> web.Response:
        return await handle(request, Signal.TRACES)

    async def metrics(request: web.Request) -> web.Response:
        return await handle(request, Signal.METRICS)

    # aiohttp would inflate the body itself, without a size cap: gunzip() does it with one.
    app = web.Application(client_max_size=max_request_bytes, handler_args={"auto_decompress": False})
    app.router.add_post("/v1/traces", traces)
    app.router.add_post("/v1/metrics", metrics)
    return app
