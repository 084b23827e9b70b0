"""TLS on the collector's three listeners, mTLS, the agent's TLS forwarding, and the refusal of open OTLP.

Certificates are made per test module with trustme: the collector's CA, a separate CA for client certificates,
and a CA that nobody trusts. Handshakes are real, over loopback; senders are the OpenTelemetry SDK's exporters,
plain gRPC channels, ``requests`` and the agent as a child process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import requests
import trustme
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter

from harness.api_client import ApiClient
from harness.daemons import AgentProcess, CollectorThread, collector_config
from harness.waiting import eventually
from spikehound.collector.daemon import Collector
from spikehound.config import Config, ConfigError, load
from tests.support.sdk_traffic import send_spans, trace_request

TRACES = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
SPIKEHOUND = str(Path(sys.executable).parent / "spikehound")


@dataclass(frozen=True)
class Pki:
    """PEM files: the collector's CA and certificate, a client CA and a client, and a stranger's CA and client."""

    dir: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_ca: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # a client certificate from a CA the collector does not trust
    rogue_key: Path
    other_ca: Path  # trusted by nobody: a client that trusts only it must refuse the collector

    def read(self, name: str) -> bytes:
        return getattr(self, name).read_bytes()


def write_pair(cert: trustme.LeafCert, directory: Path, name: str) -> tuple[Path, Path]:
    cert.cert_chain_pems[0].write_to_path(str(directory / f"{name}.pem"))
    cert.private_key_pem.write_to_path(str(directory / f"{name}.key"))
    return directory / f"{name}.pem", directory / f"{name}.key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, client_ca, other = trustme.CA(), trustme.CA(), trustme.CA()
    for authority, name in ((ca, "ca"), (client_ca, "client-ca"), (other, "other-ca")):
        authority.cert_pem.write_to_path(str(d / f"{name}.pem"))
    server = write_pair(ca.issue_cert("127.0.0.1", "localhost"), d, "server")
    client = write_pair(client_ca.issue_cert("gpu-host-1.example.internal"), d, "client")
    rogue = write_pair(other.issue_cert("gpu-host-1.example.internal"), d, "rogue")
    return Pki(d, d / "ca.pem", *server, d / "client-ca.pem", *client, *rogue, d / "other-ca.pem")


@contextlib.contextmanager
def running(cfg: Config) -> Iterator[CollectorThread]:
    """A collector in this process. Before it stops, client sockets that the test left in reference cycles
    (``requests`` responses, exceptions) are collected, which closes them: at shutdown a TLS connection waits for
    its peer to close, and one still waiting when the event loop is gone ends as a ResourceWarning (an error here)."""
    with CollectorThread(cfg) as collector:
        try:
            yield collector
        finally:
            gc.collect()


def tls_settings(pki: Pki, **more: str) -> dict[str, str]:
    return {"collector__tls_cert_file": str(pki.server_cert), "collector__tls_key_file": str(pki.server_key), **more}


@pytest.fixture(scope="module")
def mtls(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CollectorThread]:
    """A collector serving TLS on all three ports and requiring client certificates on the OTLP ones."""
    db = tmp_path_factory.mktemp("mtls") / "spikehound.db"
    cfg = collector_config(f"sqlite:///{db}", **tls_settings(pki, collector__tls_client_ca_file=str(pki.client_ca)))
    with running(cfg) as collector:
        yield collector


def https(port: int, path: str = "") -> str:
    return f"https://127.0.0.1:{port}{path}"


def stored_spans(c: CollectorThread) -> float:
    return c.metric("spikehound_ingest_stored_total", signal="spans")


def ready(c: CollectorThread, pki: Pki) -> bool:
    return requests.get(https(c.collector.api_port, "/readyz"), verify=pki.ca, timeout=5).status_code == 200


def grpc_export(port: int, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    """One OTLP/gRPC export on a fresh channel: plaintext without ``credentials``; the status it ends with."""
    body, _ = trace_request("tls-probe")
    target = f"127.0.0.1:{port}"
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel:
        try:
            channel.unary_unary(TRACES)(body, timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


# --- senders over TLS and mTLS -------------------------------------------------------------------------------


def test_sdk_exporters_send_over_mtls_and_the_api_answers_over_https(pki, mtls):
    before = stored_spans(mtls)
    by_grpc = GrpcSpanExporter(endpoint=https(mtls.collector.grpc_port), credentials=grpc.ssl_channel_credentials(
        pki.read("ca"), pki.read("client_key"), pki.read("client_cert")))
    session = requests.Session()
    session.trust_env = False  # else a REQUESTS_CA_BUNDLE in the environment overrides the exporter's CA file
    by_http = HttpSpanExporter(endpoint=https(mtls.collector.http_port, "/v1/traces"), certificate_file=str(pki.ca),
                               client_certificate_file=str(pki.client_cert), client_key_file=str(pki.client_key),
                               session=session)
    sent = [send_spans(by_grpc, {"service.name": "tls-grpc"}, n=2), send_spans(by_http, {"service.name": "tls-http"},
                                                                                  n=2)]
    assert all(len(r.acked) == 6 and not r.failed for r in sent)
    assert stored_spans(mtls) - before == 12

    api = mtls.collector.api_port  # TLS without client certificates: people, Prometheus and the CLI use the token
    client = ApiClient(https(api), verify=pki.ca)
    services = client.get_json("/api/v1/services")["services"]
    assert {"tls-grpc", "tls-http"} <= {s["service"] for s in services}
    trace_id = next(iter(sent[0].acked))[0]
    assert len(client.get_json(f"/api/v1/traces/{trace_id}")["spans"]) == 3
    assert "# TYPE spikehound_ingest_stored_total counter" in requests.get(https(api, "/metrics"), verify=pki.ca,
                                                                          timeout=10).text


@pytest.mark.parametrize("client", ["plaintext", "no client certificate", "client certificate of another CA",
                                    "trusts another CA"])
def test_grpc_senders_without_the_right_certificates_are_refused_and_the_collector_carries_on(pki, mtls, client,
                                                                                              capfd):
    ca, key, cert = pki.read("ca"), pki.read("client_key"), pki.read("client_cert")
    credentials = {"plaintext": None,
                   "no client certificate": grpc.ssl_channel_credentials(ca),
                   "client certificate of another CA": grpc.ssl_channel_credentials(ca, pki.read("rogue_key"),
                                                                                     pki.read("rogue_cert")),
                   "trusts another CA": grpc.ssl_channel_credentials(pki.read("other_ca"), key, cert)}[client]
    before = stored_spans(mtls)

    assert grpc_export(mtls.collector.grpc_port, credentials) == grpc.StatusCode.UNAVAILABLE

    assert stored_spans(mtls) == before
    good = grpc.ssl_channel_credentials(ca, key, cert)
    assert grpc_export(mtls.collector.grpc_port, good) == grpc.StatusCode.OK  # still serving
    assert ready(mtls, pki)
    # gRPC says why in one line per failed handshake ("Handshake failed ... WRONG_VERSION_NUMBER"), no traceback;
    # the client's side, in this same process, may add its own.
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.count("Handshake failed") <= 2, err


@pytest.mark.parametrize("client", ["plaintext", "no client certificate", "client certificate of another CA",
                                    "trusts another CA"])
def test_http_senders_without_the_right_certificates_are_refused_and_the_collector_carries_on(pki, mtls, client,
                                                                                              caplog):
    body, _ = trace_request("tls-probe")
    port = mtls.collector.http_port
    url, verify, cert = https(port, "/v1/traces"), str(pki.ca), (str(pki.client_cert), str(pki.client_key))
    if client == "plaintext":
        url = f"http://127.0.0.1:{port}/v1/traces"
    elif client == "no client certificate":
        cert = None
    elif client == "client certificate of another CA":
        cert = (str(pki.rogue_cert), str(pki.rogue_key))
    else:
        verify = str(pki.other_ca)
    before = stored_spans(mtls)

    with pytest.raises(requests.exceptions.ConnectionError):
        requests.post(url, data=body, headers={"Content-Type": "application/x-protobuf"}, verify=verify, cert=cert,
                      timeout=10)

    assert stored_spans(mtls) == before
    answer = requests.post(https(port, "/v1/traces"), data=body, headers={"Content-Type": "application/x-protobuf"},
                           verify=str(pki.ca), cert=(str(pki.client_cert), str(pki.client_key)), timeout=10)
    assert answer.status_code == 200 and stored_spans(mtls) == before + 1
    assert ready(mtls, pki)
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


def test_the_api_refuses_plaintext_and_clients_that_do_not_trust_its_certificate(pki, mtls):
    api = mtls.collector.api_port
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(f"http://127.0.0.1:{api}/healthz", timeout=10)
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(https(api, "/healthz"), verify=str(pki.other_ca), timeout=10)
    assert ready(mtls, pki)


@pytest.fixture
def api_mtls(pki: Pki, tmp_path: Path) -> Iterator[CollectorThread]:
    """TLS everywhere, client certificates on the API port only; certificate files of its own, to renew them."""
    own = tmp_path / "tls"
    own.mkdir()
    for name in ("ca.pem", "server.pem", "server.key"):
        (own / name).write_bytes((pki.dir / name).read_bytes())
    cfg = collector_config(f"sqlite:///{tmp_path / 'spikehound.db'}",
                           collector__tls_cert_file=str(own / "server.pem"),
                           collector__tls_key_file=str(own / "server.key"),
                           collector__api_tls_client_ca_file=str(pki.client_ca))
    with running(cfg) as collector:
        yield collector


def test_the_api_requires_client_certificates_when_configured(pki, api_mtls):
    url = https(api_mtls.collector.api_port, "/api/v1/services")
    client = ApiClient(https(api_mtls.collector.api_port), verify=pki.ca,
                       cert=(str(pki.client_cert), str(pki.client_key)))
    assert client.get("/api/v1/services").ok
    for cert in (None, (str(pki.rogue_cert), str(pki.rogue_key))):
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(url, verify=pki.ca, cert=cert, timeout=10)
    # The OTLP ports serve TLS without asking for client certificates here.
    assert grpc_export(api_mtls.collector.grpc_port, grpc.ssl_channel_credentials(pki.read("ca"))) == \
        grpc.StatusCode.OK


def served_certificate(port: int, ca: Path, client: tuple[str, str] | None = None) -> bytes:
    """The DER certificate a listener presents in a fresh handshake (offering h2 and http/1.1, as its clients do)."""
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols(["h2", "http/1.1"])
    if client:
        context.load_cert_chain(*client)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def test_sighup_serves_a_renewed_certificate_on_every_port(pki, api_mtls, tmp_path):
    c = api_mtls.collector
    renewed_ca = trustme.CA()  # a new CA too, so that the old and the new certificate cannot be mistaken
    renewed_ca.cert_pem.write_to_path(str(tmp_path / "renewed-ca.pem"))
    leaf = renewed_ca.issue_cert("127.0.0.1", "localhost")
    client = (str(pki.client_cert), str(pki.client_key))
    ports = {c.grpc_port: None, c.http_port: None, c.api_port: client}
    before = {port: served_certificate(port, pki.ca, cert) for port, cert in ports.items()}

    leaf.cert_chain_pems[0].write_to_path(api_mtls.cfg.collector.tls_cert_file)
    leaf.private_key_pem.write_to_path(api_mtls.cfg.collector.tls_key_file)
    asyncio.run_coroutine_threadsafe(c.reload(api_mtls.cfg), api_mtls.loop).result(30)  # what SIGHUP does

    after = {port: served_certificate(port, tmp_path / "renewed-ca.pem", cert) for port, cert in ports.items()}
    assert all(after[port] != before[port] for port in ports)
    assert grpc_export(c.grpc_port, grpc.ssl_channel_credentials(renewed_ca.cert_pem.bytes())) == grpc.StatusCode.OK


# --- the agent ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_agent_forwards_over_mtls_once_it_has_its_client_certificate(pki, mtls, tmp_path):
    """Without a client certificate nothing gets through, and nothing is lost: the agent keeps it queued (and
    spools it when stopped); given the certificate, it forwards everything."""
    agent = AgentProcess(https(mtls.collector.grpc_port), tmp_path, interval=60,
                         env={"SPIKEHOUND_AGENT_COLLECTOR_CA_FILE": str(pki.ca),
                              "SPIKEHOUND_AGENT_DRAIN_SECONDS": "1"})
    before = stored_spans(mtls)
    try:
        agent.start()
        sent = send_spans(GrpcSpanExporter(endpoint=agent.grpc_endpoint, insecure=True),
                          {"service.name": "behind-the-agent"}, n=3)
        assert len(sent.acked) == 9  # the agent took them
        eventually(lambda: agent.metric("spikehound_agent_forward_failures_total", reason="unavailable") >= 2,
                   "refused handshakes counted as failures", 30)
        assert agent.running and stored_spans(mtls) == before
        assert agent.terminate() == 0

        agent.env.update({"SPIKEHOUND_AGENT_COLLECTOR_CERT_FILE": str(pki.client_cert),
                          "SPIKEHOUND_AGENT_COLLECTOR_KEY_FILE": str(pki.client_key)})
        agent.start()
        eventually(lambda: stored_spans(mtls) >= before + 9, "the spooled spans forwarded over mTLS", 30)
        assert agent.terminate() == 0
    finally:
        agent.kill()


# --- the refusal of unauthenticated OTLP beyond loopback ---------------------------------------------------------


def test_the_default_otlp_bind_without_a_token_refuses_to_start_and_says_what_to_do(tmp_path):
    done = subprocess.run([SPIKEHOUND, "collector", "--db", f"sqlite:///{tmp_path / 'x.db'}", "--api", "127.0.0.1:0"],
                          capture_output=True, text=True, timeout=60, env={"HOME": str(tmp_path), "PATH": "/usr/bin"})

    assert done.returncode == 2  # a configuration error: systemd does not restart into it
    (line,) = done.stderr.splitlines()
    assert line.startswith("spikehound: bad configuration: collector.otlp_grpc (default 0.0.0.0:4317): ")
    for way_out in ("loopback", "collector.otlp_token", "collector.tls_client_ca_file",
                    "collector.allow_unauthenticated_otlp = true"):
        assert way_out in line
    assert not (tmp_path / "x.db").exists()  # refused before anything was opened


@pytest.mark.parametrize("settings", [{"collector__otlp_token": "t0ken"},
                                      {"collector__allow_unauthenticated_otlp": "true"}, "mtls"])
def test_otlp_beyond_loopback_starts_with_a_token_client_certificates_or_an_explicit_allowance(pki, tmp_path,
                                                                                             settings):
    if settings == "mtls":
        settings = tls_settings(pki, collector__tls_client_ca_file=str(pki.client_ca))
    cfg = collector_config(f"sqlite:///{tmp_path / 'x.db'}", collector__otlp_grpc="0.0.0.0:0",
                           collector__otlp_http="0.0.0.0:0", **settings)
    with running(cfg) as collector:
        assert collector.collector.grpc_port and collector.collector.http_port


def test_the_same_bind_without_any_of_them_is_refused_in_process_too(tmp_path):
    cfg = collector_config(f"sqlite:///{tmp_path / 'x.db'}", collector__otlp_http="[::]:0")
    with pytest.raises(ConfigError, match=r"^collector\.otlp_http \(\[::\]:0\): OTLP beyond loopback"):
        asyncio.run(Collector(cfg).start())


# --- configuration errors: one line naming the key and the reason ------------------------------------------------


def cert_errors(pki: Pki, tmp: Path) -> list[tuple[dict[str, str], str]]:
    encrypted = tmp / "encrypted.key"
    encrypted.write_bytes(b"-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n")
    unreadable = tmp / "unreadable.key"
    unreadable.write_bytes(pki.read("server_key"))
    unreadable.chmod(0)
    pair = {"collector.tls_cert_file": str(pki.server_cert), "collector.tls_key_file": str(pki.server_key)}
    cases = [
        ({**pair, "collector.tls_cert_file": str(tmp / "missing.pem")},
         f"collector.tls_cert_file (from --tls-cert-file): cannot read {tmp / 'missing.pem'}: "
         "No such file or directory"),
        ({**pair, "collector.tls_key_file": str(pki.client_key)},
         f"collector.tls_key_file (from --tls-key-file): the key in {pki.client_key} does not belong to the "
         f"certificate in {pki.server_cert} (collector.tls_cert_file)"),
        ({**pair, "collector.tls_key_file": str(encrypted)},
         f"collector.tls_key_file (from --tls-key-file): {encrypted} is encrypted"),
        ({**pair, "collector.tls_key_file": str(pki.server_cert)},
         f"collector.tls_key_file (from --tls-key-file): {pki.server_cert} holds no PEM private key"),
        ({"collector.tls_cert_file": str(pki.server_cert)},
         "collector.tls_cert_file (from --tls-cert-file): a TLS certificate and its key go together; set "
         "collector.tls_key_file too"),
        ({"collector.tls_client_ca_file": str(pki.client_ca)},
         "collector.tls_client_ca_file (from --tls-client-ca-file): requiring client certificates needs TLS"),
        ({**pair, "collector.api_tls_client_ca_file": str(pki.server_key)},
         f"collector.api_tls_client_ca_file (from --api-tls-client-ca-file): {pki.server_key} holds no PEM CA "
         "certificate"),
        ({"agent.collector": "collector.example.internal:4317", "agent.collector_ca_file": str(pki.ca)},
         "agent.collector_ca_file (from --collector-ca-file): needs TLS to the collector, but agent.collector "
         "(collector.example.internal:4317) is not an https:// URL"),
        ({"agent.collector": "https://c:4317", "agent.collector_cert_file": str(pki.client_cert),
          "agent.collector_key_file": str(pki.server_key)}, "agent.collector_key_file (from --collector-key-file): "
         "the key in"),
    ]
    if os.geteuid() != 0:  # root reads any file
        cases.append(({**pair, "collector.tls_key_file": str(unreadable)},
                      f"collector.tls_key_file (from --tls-key-file): cannot read {unreadable}: Permission denied"))
    return cases


def test_bad_tls_files_are_one_line_naming_the_key_and_the_reason(pki, tmp_path):
    for flags, message in cert_errors(pki, tmp_path):
        with pytest.raises(ConfigError) as raised:
            load(env={}, flags=flags)
        assert str(raised.value).startswith(message) and "\n" not in str(raised.value), flags


def test_check_config_and_the_collector_refuse_a_key_that_does_not_match(pki, tmp_path):
    config = tmp_path / "collector.toml"
    config.write_text(f'[collector]\ntls_cert_file = "{pki.server_cert}"\ntls_key_file = "{pki.client_key}"\n')
    loopback = ["--otlp-grpc", "127.0.0.1:0", "--otlp-http", "127.0.0.1:0", "--api", "127.0.0.1:0"]
    for command in (["check-config", str(config)], ["collector", "--config", str(config), *loopback]):
        done = subprocess.run([SPIKEHOUND, *command], capture_output=True, text=True, timeout=60,
                              env={"HOME": str(tmp_path), "PATH": "/usr/bin"})
        assert done.returncode == 2
        assert done.stderr.splitlines() == [
            f"spikehound: bad configuration: collector.tls_key_file (from {config}): the key in {pki.client_key} does "
            f"not belong to the certificate in {pki.server_cert} (collector.tls_cert_file)"]
