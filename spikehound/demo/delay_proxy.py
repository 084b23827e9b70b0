"""A delaying TCP proxy: the network hop between the demo's gateway and its model server.

::

    python -m spikehound.demo.delay_proxy --listen 127.0.0.1:P --upstream 127.0.0.1:Q --control 127.0.0.1:C

Bytes pass through unchanged. While the fault is on (``POST /fault``
``{"on": true}`` on the control port), every chunk travelling towards the
upstream is delivered ``--delay-ms`` after it arrived (a delay line, in
order: chunks in flight overlap, as ``tc qdisc ... netem delay`` holds the
packets of a congested link), without needing root. Neither
side knows: the gateway's CLIENT span grows, the model server's SERVER span
does not, which is how a slow network hop looks in traces.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

from aiohttp import web

from spikehound.config import HostPort


class DelayProxy:
    def __init__(self, upstream: HostPort, delay_ms: float) -> None:
        self.upstream = upstream
        self.delay_ms = delay_ms
        self.fault = False
        self.connections = 0

    async def handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(self.upstream.host, self.upstream.port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(self._pipe(client_reader, up_writer, delayed=True),
                             self._pipe(up_reader, client_writer, delayed=False))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delayed: bool) -> None:
        line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()  # (deliver at, bytes), in arrival order
        sender = asyncio.create_task(self._deliver(line, writer))
        loop = asyncio.get_running_loop()
        try:
            while data := await reader.read(65536):
                hold = self.delay_ms / 1000 if delayed and self.fault else 0.0
                line.put_nowait((loop.time() + hold, data))
        except (ConnectionError, OSError):
            pass
        line.put_nowait((0.0, b""))  # end of stream, after what is still on the line
        await sender

    async def _deliver(self, line: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                due, data = await line.get()
                if not data:
                    break
                await asyncio.sleep(max(0.0, due - loop.time()))
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                writer.close()

    def control_app(self) -> web.Application:
        async def fault(request: web.Request) -> web.Response:
            try:
                body = await request.json()
            except ValueError:
                return web.json_response({"error": "body is not JSON"}, status=400)
            self.fault = bool(body.get("on"))
            return web.json_response({"service": "delay-proxy", "fault": self.fault, "delay_ms": self.delay_ms})

        async def healthz(_request: web.Request) -> web.Response:
            return web.json_response({"status": "ok", "fault": self.fault, "connections": self.connections})

        app = web.Application()
        app.router.add_post("/fault", fault)
        app.router.add_get("/healthz", healthz)
        return app


async def run(listen: HostPort, upstream: HostPort, control: HostPort, delay_ms: float) -> None:
    proxy = DelayProxy(upstream, delay_ms)
    server = await asyncio.start_server(proxy.handle, listen.host, listen.port)
    runner = web.AppRunner(proxy.control_app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, control.host, control.port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = os.getppid()
    while not stop.is_set() and os.getppid() == parent:  # do not outlive the demo
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    server.close()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spikehound.demo.delay_proxy", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=HostPort.parse, required=True, metavar="HOST:PORT")
    parser.add_argument("--upstream", type=HostPort.parse, required=True, metavar="HOST:PORT")
    parser.add_argument("--control", type=HostPort.parse, required=True, metavar="HOST:PORT")
    parser.add_argument("--delay-ms", type=float, default=50.0, help="delay per chunk towards the upstream")
    args = parser.parse_args(argv)
    asyncio.run(run(args.listen, args.upstream, args.control, args.delay_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
