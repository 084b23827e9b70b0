"""The image's health check: GET /readyz of the daemon running in this container.

The collector answers on its API address (``collector.api``), the agent on ``agent.metrics_listen``; both are
read from the daemon's own command line, configuration file and environment, as the daemon read them. Exit
status 0 when /readyz answers 200, 1 otherwise (with the reason on stderr).
"""

from __future__ import annotations

import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path

from spikehound.cli import AGENT_FLAGS, COLLECTOR_FLAGS, build_parser
from spikehound.config import ConfigError, HostPort, load


def daemon_command() -> list[str] | None:
    """The arguments after ``spikehound`` of the collector or agent process in this container."""
    for proc in sorted(Path("/proc").glob("[0-9]*"), key=lambda p: int(p.name)):
        try:
            words = [w.decode(errors="replace") for w in (proc / "cmdline").read_bytes().split(b"\0") if w]
        except OSError:
            continue
        for i, word in enumerate(words[:3]):
            if Path(word).name == "spikehound" and len(words) > i + 1 and words[i + 1] in ("collector", "agent"):
                return words[i + 1:]
    return None


def readyz_url() -> str:
    command = daemon_command()
    if command is None:
        raise LookupError("no spikehound collector or agent process in this container")
    args = build_parser().parse_args(command)
    mapping = AGENT_FLAGS if args.command == "agent" else COLLECTOR_FLAGS
    cfg = load(args.config, flags={key: getattr(args, flag, None) for flag, key in mapping.items()})
    address: HostPort = cfg.agent.metrics_listen if args.command == "agent" else cfg.collector.api
    host = "127.0.0.1" if address.host in ("0.0.0.0", "") else "::1" if address.host == "::" else address.host
    tls = args.command == "collector" and bool(cfg.collector.tls_cert_file)
    return f"{'https' if tls else 'http'}://{HostPort(host, address.port)}/readyz"


def main() -> int:
    try:
        url = readyz_url()
        # The certificate names the service, not loopback: this check is about the answer, not the peer.
        context = ssl._create_unverified_context()
        with urllib.request.urlopen(url, timeout=4, context=context) as answer:
            return 0 if answer.status == 200 else 1
    except urllib.error.HTTPError as exc:
        print(f"healthcheck: {exc.url} answered {exc.code}: {exc.read()[:300]!r}", file=sys.stderr)
    except (LookupError, ConfigError, OSError, SystemExit) as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
