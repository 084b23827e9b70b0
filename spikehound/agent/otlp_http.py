"""The agent's local OTLP/HTTP receiver: ``POST /v1/traces`` and ``/v1/metrics``.

JSON bodies are converted to protobuf here, so the forward queue and the
collector only ever see protobuf. Errors follow the OTLP/HTTP specification
(400 unreadable, 413 too large, 415 unknown media type, 429 + Retry-After
when the queue is full, 503 + Retry-After when the disk refuses the spool);
spans or points too large to forward are reported in ``partial_success``.
The framing (media types, gzip, the error answers) is the collector's too:
``spikehound/otlp_http_framing.py``.
"""

from __future__ import annotations

from aiohttp import web

from spikehound.agent.intake import Intake, QueueUnavailable, export_response
from spikehound.agent.otlp_grpc import RETRY_AFTER_SECONDS
from spikehound.agent.spool import Signal
from spikehound.export_outcome import QueueFull
from spikehound.otlp import PayloadError
from spikehound.otlp_http_framing import (
    Refused,
    message_response,
    read_body,
    receiver_app,
    request_framing,
    status_response,
)


def http_app(intake: Intake, max_request_bytes: int) -> web.Application:
    async def handle(request: web.Request, signal: Signal) -> web.Response:
        try:
            framing = request_framing(request, name_supported=False)
            body = await read_body(request, framing, max_request_bytes)
        except Refused as refused:  # accept() counts the requests it cannot read; these never reach it
            intake.invalid_requests["http"] += 1
            return refused.response
        try:
            transport = request.transport
            peer = transport.get_extra_info("peername") if transport is not None else None
            accepted = intake.accept(signal, body, "http", json=framing.as_json,
                                     peer=peer if isinstance(peer, tuple) else None)
        except PayloadError as exc:
            return status_response(400, str(exc), framing.as_json)
        except QueueFull as exc:
            return status_response(429, str(exc), framing.as_json, retry_after=RETRY_AFTER_SECONDS)
        except QueueUnavailable as exc:
            return status_response(503, str(exc), framing.as_json, retry_after=RETRY_AFTER_SECONDS)
        # Empty unless partial_success reports what was too large to forward.
        return message_response(export_response(signal, accepted), framing.as_json)

    async def traces(request: web.Request) -> web.Response:
        return await handle(request, Signal.TRACES)

    async def metrics(request: web.Request) -> web.Response:
        return await handle(request, Signal.METRICS)

    return receiver_app(traces, metrics, max_request_bytes)
