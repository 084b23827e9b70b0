"""TLS for the collector's three listeners: one certificate and key for OTLP/gRPC, OTLP/HTTP and the API.

``collector.tls_client_ca_file`` makes the OTLP receivers require a client certificate signed by one of its CAs
(mTLS); ``collector.api_tls_client_ca_file`` does the same for the API port. The configuration checked the files
(``spikehound.config``), so reading them here only fails if they changed in between. ``reload`` (SIGHUP) re-reads
the certificate and key, a renewal: connections made from then on get the new ones, open ones keep theirs.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import grpc

from spikehound.config import CollectorConfig

log = logging.getLogger("spikehound.collector.tls")


class ServerTls:
    """The certificate the collector serves, as gRPC credentials and as aiohttp ``SSLContext``\\ s."""

    def __init__(self, c: CollectorConfig) -> None:
        self.cert_file, self.key_file = c.tls_cert_file, c.tls_key_file
        self.otlp_client_ca_file = c.tls_client_ca_file
        self._otlp_client_ca = Path(c.tls_client_ca_file).read_bytes() if c.tls_client_ca_file else None
        self._pair = self._read_pair()
        self._contexts: list[ssl.SSLContext] = []
        self._pending: grpc.ServerCertificateConfiguration | None = None  # for gRPC's next handshake

    @classmethod
    def from_config(cls, c: CollectorConfig) -> ServerTls | None:
        """TLS as configured, or None for plain TCP."""
        return cls(c) if c.tls_cert_file else None

    def _read_pair(self) -> tuple[bytes, bytes]:
        return Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes()

    def _grpc_configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([self._pair], root_certificates=self._otlp_client_ca)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Credentials for the OTLP/gRPC port; client certificates required when a client CA is configured."""
        return grpc.dynamic_ssl_server_credentials(self._grpc_configuration(), self._next_configuration,
                                                   require_client_authentication=self._otlp_client_ca is not None)

    def _next_configuration(self) -> grpc.ServerCertificateConfiguration | None:
        # gRPC asks before each handshake, from its own thread; None keeps the current certificate.
        pending, self._pending = self._pending, None
        return pending

    def http_context(self, client_ca_file: str = "") -> ssl.SSLContext:
        """A server context for an aiohttp site; client certificates required when ``client_ca_file`` is given."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)  # TLS 1.2 or newer, strong ciphers
        context.load_cert_chain(self.cert_file, self.key_file)
        if client_ca_file:
            context.load_verify_locations(cafile=client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
        self._contexts.append(context)
        return context

    def reload(self) -> bool:
        """Re-read the certificate and key for new connections; True when they changed.

        Raises OSError or ssl.SSLError, and keeps serving the old pair, when the files are not a usable pair.
        """
        pair = self._read_pair()
        if pair == self._pair:
            return False
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert_file, self.key_file)  # a test
        for context in self._contexts:
            context.load_cert_chain(self.cert_file, self.key_file)
        self._pair = pair
        self._pending = self._grpc_configuration()
        return True


def describe(tls: ServerTls | None, client_ca_file: str) -> str:
    """How a listener is secured, for its "listening on" line."""
    if tls is None:
        return ""
    return " (TLS, client certificates required)" if client_ca_file else " (TLS)"
