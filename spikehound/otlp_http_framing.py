"""OTLP/HTTP framing, shared by the collector's and the agent's receivers: media types, gzip, error answers.

An OTLP/HTTP export request is protobuf or JSON, gzip-compressed or not; the
answer, and the ``google.rpc.Status`` of an error, is encoded like the
request. A receiver reads how a request is framed with :func:`request_framing`
and its body with :func:`read_body` (inflated here, under a size cap: aiohttp
inflates without one); both raise :class:`Refused`, which carries the answer
(415, 413 or 400) and the reason the receiver counts it under. Everything
after that (authentication, admission, decoding) is each receiver's own.

>>> framing = Framing(as_json=True, gzipped=False)
>>> response = status_response(429, "queue full", framing.as_json, retry_after=2)
>>> response.status, response.headers["Retry-After"], response.text
(429, '2', '{"code": 8, "message": "queue full"}')
"""

from __future__ import annotations

import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import PayloadEncodingError
from google.protobuf import json_format
from google.protobuf.message import Message
from google.rpc import code_pb2, status_pb2

from spikehound.otlp import PayloadError

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
# The media types OTLP/HTTP allows, and whether each is JSON.
MEDIA_TYPES = {PROTOBUF: False, "application/protobuf": False, JSON: True}
CONTENT_ENCODINGS = ("gzip", "identity", "")
# The google.rpc.Code of each error answer; UNKNOWN for any other status.
RPC_CODES = {400: code_pb2.INVALID_ARGUMENT, 413: code_pb2.INVALID_ARGUMENT, 415: code_pb2.INVALID_ARGUMENT,
             429: code_pb2.RESOURCE_EXHAUSTED, 503: code_pb2.UNAVAILABLE}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BodyTooLarge(ValueError):
    """The request body (after decompression) is larger than allowed."""


class Refused(Exception):
    """A request answered with an error before its content was read.

    ``reason`` is what receivers count it under: unsupported_media_type, unsupported_encoding, too_large or
    bad_payload.
    """

    def __init__(self, reason: str, response: web.Response) -> None:
        super().__init__(reason)
        self.reason = reason
        self.response = response


@dataclass(frozen=True, slots=True)
class Framing:
    """How a request's body is encoded: OTLP/JSON or protobuf, gzip-compressed or not."""

    as_json: bool
    gzipped: bool


PROFILES_PATH = "/v1development/profiles"  # OTLP/HTTP's path while the profiles signal is in development


def receiver_app(traces: Handler, metrics: Handler, max_request_bytes: int,
                 profiles: Handler | None = None) -> web.Application:
    """An application that takes ``POST /v1/traces`` and ``/v1/metrics`` (and ``/v1development/profiles`` when
    ``profiles`` is given) bodies of up to ``max_request_bytes``."""
    # aiohttp would inflate the body itself, without a size cap: read_body() does it with one.
    app = web.Application(client_max_size=max_request_bytes, handler_args={"auto_decompress": False})
    app.router.add_post("/v1/traces", traces)
    app.router.add_post("/v1/metrics", metrics)
    if profiles is not None:
        app.router.add_post(PROFILES_PATH, profiles)
    return app


def request_framing(request: web.Request, *, name_supported: bool) -> Framing:
    """The request's media type and compression; Refused (415) when either is not OTLP/HTTP's.

    ``name_supported`` adds the supported media types to the message refusing another (the collector does, the
    agent does not).
    """
    media = request.content_type
    if media not in MEDIA_TYPES:
        hint = f"; use {PROTOBUF} or {JSON}" if name_supported else ""
        # The request's own encoding is unknown, so the Status goes out as JSON.
        raise Refused("unsupported_media_type", web.json_response(
            {"code": code_pb2.INVALID_ARGUMENT, "message": f"unsupported Content-Type {media!r}{hint}"}, status=415))
    as_json = MEDIA_TYPES[media]
    encoding = request.headers.get("Content-Encoding", "identity").lower()
    if encoding not in CONTENT_ENCODINGS:
        raise Refused("unsupported_encoding",
                      status_response(415, f"unsupported Content-Encoding {encoding!r}; use gzip or none", as_json))
    return Framing(as_json=as_json, gzipped=encoding == "gzip")


async def read_body(request: web.Request, framing: Framing, max_bytes: int) -> bytes:
    """The request's body, inflated when gzipped; else Refused: 413 past ``max_bytes``, 400 for a broken gzip
    or chunked encoding (reason ``bad_payload``), 400 for a sender that hung up mid-upload (reason ``aborted``:
    routine for a client that timed out or was killed; the answer goes nowhere).
    """
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:  # past the application's client_max_size
        raise Refused("too_large", too_large_response(max_bytes, framing.as_json)) from None
    except ConnectionError:
        raise Refused("aborted", status_response(400, "the request body did not arrive", framing.as_json)) from None
    except PayloadEncodingError as exc:
        raise Refused("bad_payload", status_response(400, f"unreadable request body: {exc.message}",
                                                     framing.as_json)) from None
    if not framing.gzipped:
        return body
    try:
        return gunzip(body, max_bytes)
    except BodyTooLarge:
        raise Refused("too_large", too_large_response(max_bytes, framing.as_json)) from None
    except PayloadError as exc:
        raise Refused("bad_payload", status_response(400, str(exc), framing.as_json)) from None


def gunzip(body: bytes, limit: int) -> bytes:
    """Inflate a gzip body, refusing to grow past ``limit`` bytes (a small gzip bomb stays small).

    >>> import gzip
    >>> gunzip(gzip.compress(b"x" * 10), limit=100)
    b'xxxxxxxxxx'
    >>> gunzip(gzip.compress(b"x" * 1000), limit=100)
    Traceback (most recent call last):
    ...
    spikehound.otlp_http_framing.BodyTooLarge: decompressed body exceeds 100 bytes
    """
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise PayloadError(f"invalid gzip body: {exc}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise BodyTooLarge(f"decompressed body exceeds {limit} bytes")
    if not inflater.eof:
        raise PayloadError("invalid gzip body: truncated")
    return out


def too_large_response(max_bytes: int, as_json: bool) -> web.Response:
    """413 for a body over ``max_bytes``.

    >>> too_large_response(100, as_json=True).text
    '{"code": 3, "message": "request body exceeds 100 bytes"}'
    """
    return status_response(413, f"request body exceeds {max_bytes} bytes", as_json)


def status_response(http_status: int, message: str, as_json: bool, retry_after: int | None = None) -> web.Response:
    """An error answer: a ``google.rpc.Status`` encoded like the request, with ``Retry-After`` when given.

    >>> from google.rpc import status_pb2
    >>> status_pb2.Status.FromString(status_response(503, "storage down", as_json=False).body)
    code: 14
    message: "storage down"
    <BLANKLINE>
    """
    status = status_pb2.Status(code=RPC_CODES.get(http_status, code_pb2.UNKNOWN), message=message)
    response = message_response(status, as_json, http_status)
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    return response


def message_response(message: Message, as_json: bool, http_status: int = 200) -> web.Response:
    """``message`` as the body of an answer, in OTLP/JSON or protobuf.

    >>> from google.rpc import status_pb2
    >>> message_response(status_pb2.Status(), as_json=True).text, message_response(status_pb2.Status(), False).body
    ('{}', b'')
    """
    if as_json:
        return web.Response(status=http_status, text=json_format.MessageToJson(message, indent=None),
                            content_type=JSON)
    return web.Response(status=http_status, body=message.SerializeToString(), content_type=PROTOBUF)
