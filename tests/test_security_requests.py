"""Requests a web page on another site makes a browser send: refused, counted, and the collector's own users
(its pages, curl, scripts, Prometheus) still served. A real collector, real HTTP requests with the headers
browsers send (Origin, Sec-Fetch-Site, Host under DNS rebinding)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from harness.api_client import client_of, get_json, request
from harness.daemons import CollectorThread, collector_config
from spikehound.config import ConfigError, load

SILENCE_EVERYTHING = b'{"matchers": {"service": "*"}, "duration_seconds": 315360000}'  # ten years of quiet
EVIL = "http://evil.example"


def refused(c: CollectorThread, reason: str) -> float:
    """``spikehound_api_refused_requests_total{reason}`` as a scrape of /metrics reads it."""
    text = requests.get(f"{c.api}/metrics", timeout=5).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "spikehound_api_refused_requests_total" and s.labels.get("reason") == reason)


def silences(c: CollectorThread) -> list[dict[str, object]]:
    return get_json(f"{c.api}/api/v1/silences", state="all")["silences"]


# (request headers a browser sends for another site's page, status, counter reason, words of the error)
CROSS_SITE = {
    "form or fetch, modern browser": ({"Content-Type": "text/plain", "Origin": EVIL, "Sec-Fetch-Site": "cross-site"},
                                      403, "cross_origin", "cross-origin request refused"),
    "form, browser without Sec-Fetch-Site": ({"Content-Type": "text/plain", "Origin": EVIL},
                                             403, "cross_origin", "cross-origin request refused"),
    "JSON from a sandboxed frame": ({"Content-Type": "application/json", "Origin": "null"},
                                    403, "cross_origin", "cross-origin request refused"),
    "JSON from a sibling site": ({"Content-Type": "application/json", "Origin": "http://other.localhost:8470",
                                  "Sec-Fetch-Site": "same-site"}, 403, "cross_origin", "cross-origin request refused"),
    "text/plain, Origin stripped": ({"Content-Type": "text/plain"}, 415, "media_type", "must be application/json"),
    "form encoding": ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "media_type",
                      "must be application/json"),
    "a blob without a type": ({}, 415, "media_type", "needs Content-Type: application/json"),
}


@pytest.mark.parametrize("case", list(CROSS_SITE))
def test_a_page_on_another_site_cannot_silence_alerts(sqlite_collector: CollectorThread, case: str):
    headers, status, reason, words = CROSS_SITE[case]
    r = request("POST", f"{sqlite_collector.api}/api/v1/silences", data=SILENCE_EVERYTHING, headers=headers)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]
    assert silences(sqlite_collector) == []
    assert refused(sqlite_collector, reason) == 1


def test_a_body_over_the_limit_is_refused_before_it_is_read(sqlite_collector: CollectorThread):
    r = request("POST", f"{sqlite_collector.api}/api/v1/silences", data=b"{" + b" " * (2 * 1024**2) + b"}",
                headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "exceeds" in r.json()["error"]
    assert refused(sqlite_collector, "too_large") == 1


def test_the_collectors_own_pages_curl_and_scripts_still_change_state(sqlite_collector: CollectorThread):
    c = sqlite_collector
    api, path = client_of(c.api), "/api/v1/silences"
    body = b'{"matchers": {"service": "gateway"}, "duration_seconds": 60}'
    own_origin = c.api  # what a browser on the collector's own page sends
    answers = [
        api.post(path, data=body, headers={"Content-Type": "application/json", "Origin": own_origin}),
        api.post(path, data=body, headers={"Content-Type": "application/json; charset=utf-8", "Origin": "null",
                                           "Sec-Fetch-Site": "same-origin"}),
        api.post(path, json={"matchers": {"service": "gateway"}, "duration_seconds": 60}),  # curl
    ]
    assert [r.status_code for r in answers] == [201, 201, 201], [r.text for r in answers]
    # Requests without a body need no Content-Type.
    assert api.delete(f"{path}/{answers[0].json()['id']}").status_code == 200
    assert api.post("/api/v1/alerts/outbox/12/retry").status_code == 404
    assert requests.post(f"{c.api}/ui/logout", timeout=5, allow_redirects=False,
                         headers={"Origin": "null", "Sec-Fetch-Site": "same-origin"}).status_code == 303
    # Pages keep their referrer for the collector itself, so browsers without Sec-Fetch-Site send a real
    # Origin with the login form instead of "null".
    assert requests.get(f"{c.api}/ui/login", timeout=5).headers["Referrer-Policy"] == "same-origin"
    assert requests.post(f"{c.api}/ui/logout", timeout=5, allow_redirects=False,
                         headers={"Origin": own_origin}).status_code == 303
    assert len(silences(c)) == 3
    assert refused(c, "cross_origin") == refused(c, "media_type") == 0


READS = ["/api/v1/services", "/api/v1/spikes", "/api/v1/openapi.json", "/api/services", "/ui/", "/metrics"]
DOCUMENTED = {"/api/v1/services", "/api/v1/spikes"}  # the reads the OpenAPI document describes


@pytest.mark.parametrize("path", READS)
def test_dns_rebinding_reads_nothing(sqlite_collector: CollectorThread, path: str):
    # evil.example now resolves to 127.0.0.1: the browser connects here but still names the attacker's site.
    if path in DOCUMENTED:
        r = request("GET", sqlite_collector.api + path, headers={"Host": "evil.example:8470"})
    else:
        r = requests.get(sqlite_collector.api + path, headers={"Host": "evil.example:8470"}, timeout=5)
    assert r.status_code == 421
    assert "collector.allowed_hosts" in r.json()["error"]
    assert refused(sqlite_collector, "host") == 1


def test_probes_and_scrapes_by_address_or_localhost_are_served(sqlite_collector: CollectorThread):
    c = sqlite_collector
    for path in ("/healthz", "/readyz"):  # probes send whatever name they were given
        assert requests.get(c.api + path, headers={"Host": "lb-probe.example:8470"}, timeout=5).status_code == 200
    for host in ("10.9.8.7:8470", "[fd00::7]:8470", "localhost", f"localhost:{c.collector.api_port}"):
        assert requests.get(f"{c.api}/metrics", headers={"Host": host}, timeout=5).status_code == 200, host
    assert refused(c, "host") == 0


def test_the_public_url_and_allowed_hosts_are_answered(tmp_path: Path):
    cfg = collector_config(f"sqlite:///{tmp_path / 'db.sqlite'}", collector__public_url="https://spikehound.example.com/",
                           collector__allowed_hosts=["spikehound.proxy.internal"])
    with CollectorThread(cfg) as c:
        api = client_of(c.api)
        for host in ("spikehound.example.com", "spikehound.proxy.internal:443", "SPIKEHOUND.PROXY.INTERNAL."):
            assert api.request("GET", "/api/v1/services", headers={"Host": host}).status_code == 200
        assert api.request("GET", "/api/v1/services", headers={"Host": "evil.example"}).status_code == 421
        # Behind a proxy that rewrites Host, the browser's Origin is the public URL's.
        made = api.post("/api/v1/silences", data=SILENCE_EVERYTHING, headers={
            "Content-Type": "application/json", "Origin": "https://spikehound.example.com"})
        assert made.status_code == 201, made.text
    anything = collector_config(f"sqlite:///{tmp_path / 'db2.sqlite'}", collector__allowed_hosts="*")
    with CollectorThread(anything) as c:
        assert request("GET", f"{c.api}/api/v1/services", headers={"Host": "any.example"}).status_code == 200


@pytest.mark.parametrize(("flags", "words"), [
    ({"collector.allowed_hosts": "https://spikehound.example.com/"},
     "collector.allowed_hosts (from --allowed-hosts): 'https://spikehound.example.com/' is not a host"),
    ({"collector.public_url": "spikehound.example.com"}, "collector.public_url (from --public-url): expected an http"),
])
def test_a_bad_host_setting_is_one_line_naming_it(flags, words):
    with pytest.raises(ConfigError, match="^" + re.escape(words)):
        load(env={}, flags={"storage.url": "sqlite:///:memory:", **flags})
