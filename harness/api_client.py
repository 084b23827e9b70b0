"""A client of the collector's REST API that holds every answer to the OpenAPI document the collector serves.

The document (``GET /api/v1/openapi.json``) is OpenAPI 3.1, whose schemas are JSON Schema 2020-12 with
``#/components/...`` references; the whole document is one resource of a ``referencing`` registry, so those
references resolve wherever they are. An answer whose status the operation does not list, or whose JSON body
its schema refuses, fails the test with the operation, the status and every place the body differs.

>>> ApiClient.operation_path({"/api/v1/spikes": {}, "/api/v1/spikes/{spike_id}": {}}, "/api/v1/spikes/a1")
'/api/v1/spikes/{spike_id}'
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import requests
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from harness.waiting import eventually

DOCUMENT_PATH = "/api/v1/openapi.json"
DOCUMENT_URI = "urn:spikehound:openapi"  # where the document's own "#/components/..." references point

# Operations ("METHOD", "/path/template") whose answers are not validated, each with the mismatch that stops it.
UNVALIDATED: dict[tuple[str, str], str] = {}


class ApiClient:
    """GETs (and other requests) to one collector's API, each answer checked against its served document."""

    def __init__(self, base_url: str, *, headers: Mapping[str, str] | None = None, timeout: float = 10,
                 session: requests.Session | None = None, **defaults: Any) -> None:
        """``session`` sends every request (its connection pool, cookies, ``trust_env``), by default a fresh
        connection each; ``defaults`` go with every request, the document's too (``verify=`` a CA file,
        ``cert=`` a client certificate)."""
        self.base_url = base_url.rstrip("/")
        self.headers = dict(headers or {})
        self.timeout = timeout
        self.session = session
        self.defaults = defaults

    def _send(self, method: str, url: str, **kwargs: Any) -> requests.Response:
        kwargs = {**self.defaults, "timeout": self.timeout, **kwargs}
        return (self.session or requests).request(method, url, **kwargs)

    @functools.cached_property
    def document(self) -> dict[str, Any]:
        """The OpenAPI document this collector serves (fetched once)."""
        r = self._send("GET", self.base_url + DOCUMENT_PATH, headers=self.headers)
        r.raise_for_status()
        return r.json()

    @functools.cached_property
    def _registry(self) -> Registry:
        return Registry().with_resource(DOCUMENT_URI, Resource(contents=self.document, specification=DRAFT202012))

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        """Send ``method path`` (``kwargs`` as for ``requests.request``: a raw ``data`` body, ``headers`` over
        the client's, ``params``) and check the answer, whatever its status: see ``validate``."""
        kwargs["headers"] = {**self.headers, **kwargs.get("headers", {})}
        response = self._send(method, self.base_url + path, **kwargs)
        self.validate(method, path, response)
        return response

    def get(self, path: str, **params: Any) -> requests.Response:
        """GET ``path`` with query ``params``, the answer checked whatever its status."""
        return self.request("GET", path, params=params or None)

    def post(self, path: str, **kwargs: Any) -> requests.Response:
        """POST ``path`` (``json=``, or ``data=`` with ``headers=``), the answer checked whatever its status."""
        return self.request("POST", path, **kwargs)

    def delete(self, path: str, **kwargs: Any) -> requests.Response:
        """DELETE ``path``, the answer checked whatever its status."""
        return self.request("DELETE", path, **kwargs)

    def get_json(self, path: str, expect: int = 200, **params: Any) -> Any:
        """The JSON body of GET ``path`` with query ``params``, which must answer ``expect`` as documented."""
        response = self.get(path, **params)
        assert response.status_code == expect, \
            f"GET {path} {params or ''} answered {response.status_code}, not {expect}: {response.text[:500]}"
        return response.json()

    def wait_json(self, path: str, ready: Callable[[Any], Any], timeout: float = 60, *, what: str | None = None,
                  **params: Any) -> Any:
        """The first documented 200 body of GET ``path`` that ``ready`` accepts, polled until ``timeout``; the
        failure names ``what`` (by default, the request)."""

        def answer() -> Any:
            response = self.get(path, **params)
            body = response.json() if response.status_code == 200 else None
            return body if body is not None and ready(body) else None

        return eventually(answer, what or f"GET {path} {params or ''} to answer as awaited", timeout)

    # --- the document's side ------------------------------------------------------------------------------

    @staticmethod
    def operation_path(paths: Mapping[str, Any], path: str) -> str | None:
        """The document's path template that ``path`` (query string and all) is an instance of; a literal
        path wins over a template, as in the router."""
        path = urlsplit(path).path
        if path in paths:
            return path
        for template in paths:
            pattern = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template))
            if re.fullmatch(pattern, path):
                return template
        return None

    def _follow(self, node: dict[str, Any], pointer: str) -> tuple[dict[str, Any], str]:
        """``node`` (found at ``pointer``) with its ``$ref`` chain followed (a response in
        ``#/components/responses``), and the pointer of where it ended."""
        while "$ref" in node:
            pointer = node["$ref"].removeprefix("#")  # the document's references are all its own
            node = self._registry.resolver(DOCUMENT_URI).lookup(node["$ref"]).contents
        return node, pointer

    def validate(self, method: str, path: str, response: requests.Response) -> None:
        """Fail unless the operation for ``method path`` lists the answer's status and, for a JSON answer, its
        schema for that status accepts the body."""
        where = f"{method.upper()} {path}"
        template = self.operation_path(self.document["paths"], path)
        assert template is not None, f"{where}: no such path in the served OpenAPI document"
        operation = self.document["paths"][template].get(method.lower())
        assert operation is not None, f"{where}: the document has no {method.upper()} operation on {template}"
        if (method.upper(), template) in UNVALIDATED:
            return
        responses = operation.get("responses", {})
        status = str(response.status_code)
        key = next((k for k in (status, f"{status[0]}XX", "default") if k in responses), None)
        assert key is not None, \
            f"{where} answered {status}, which {method.upper()} {template} does not list ({sorted(responses)})"
        if not response.headers.get("Content-Type", "").startswith("application/json"):
            return
        answer, pointer = self._follow(responses[key], "".join(
            "/" + part.replace("~", "~0").replace("/", "~1") for part in
            ("paths", template, method.lower(), "responses", key)))
        if "application/json" not in answer.get("content", {}):
            return  # a documented answer with no JSON schema: nothing to hold the body to
        pointer += "/content/application~1json/schema"
        validator = Draft202012Validator({"$ref": f"{DOCUMENT_URI}#{pointer}"}, registry=self._registry)
        errors = sorted(validator.iter_errors(response.json()), key=lambda e: e.json_path)
        assert not errors, f"{where} answered {status} with a body unlike the document (#{pointer}):\n" + \
            "\n".join(f"  at {e.json_path}: {e.message[:300]}" for e in errors[:10]) + \
            (f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else "") + \
            f"\nbody: {json.dumps(response.json())[:1000]}"


@functools.lru_cache(maxsize=64)
def client_of(base_url: str) -> ApiClient:
    """One client per collector address, so its document is fetched once (every collector serves the same)."""
    return ApiClient(base_url)


def _split(url: str) -> tuple[ApiClient, str]:
    parts = urlsplit(url)
    return client_of(f"{parts.scheme}://{parts.netloc}"), parts.path + (f"?{parts.query}" if parts.query else "")


def get_json(url: str, expect: int = 200, **params: Any) -> Any:
    """``ApiClient.get_json`` by full URL (``f"{collector.api}/api/v1/spikes"``)."""
    client, path = _split(url)
    return client.get_json(path, expect, **params)


def wait_json(url: str, ready: Callable[[Any], Any], timeout: float = 60, *, what: str | None = None,
              **params: Any) -> Any:
    """``ApiClient.wait_json`` by full URL."""
    client, path = _split(url)
    return client.wait_json(path, ready, timeout, what=what, **params)


def request(method: str, url: str, **kwargs: Any) -> requests.Response:
    """``ApiClient.request`` by full URL: any status, the answer checked against the document."""
    client, path = _split(url)
    return client.request(method, path, **kwargs)


def list_spikes(api: str, **params: Any) -> list[dict[str, Any]]:
    """The spikes ``GET /api/v1/spikes`` lists (``params``: its query) of the collector at ``api``."""
    return get_json(f"{api}/api/v1/spikes", **params)["spikes"]
