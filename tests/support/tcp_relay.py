"""A TCP relay on loopback: what a proxy or a load balancer in front of a collector does to its bytes."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading


class _Pipe(socketserver.BaseRequestHandler):
    server: TcpRelay

    def handle(self) -> None:
        with socket.create_connection(("127.0.0.1", self.server.target_port), timeout=10) as upstream:
            upstream.settimeout(None)
            back = threading.Thread(target=_copy, args=(upstream, self.request), daemon=True)
            back.start()
            _copy(self.request, upstream)
            back.join(10)


def _copy(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


class TcpRelay(socketserver.ThreadingTCPServer):
    """Listens on a free loopback port and copies every connection to and from ``target_port``."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        super().__init__(("127.0.0.1", 0), _Pipe)
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="tcp-relay", daemon=True)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def __enter__(self) -> TcpRelay:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
