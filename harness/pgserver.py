"""Throwaway PostgreSQL clusters for tests.

:class:`PostgresServer` runs ``initdb`` in a temporary directory, starts the server with ``pg_ctl`` on a free
port of 127.0.0.1 (its unix socket lives in the temp dir too, never in /var/run/postgresql) and hands back a
SQLAlchemy URL. Authentication is ``trust``: this is a test server that only listens on loopback.

PostgreSQL refuses to run as root. When the tests run as root (CI, containers) every PostgreSQL binary is run
as the ``postgres`` system user and the data directory is owned by that user; otherwise the binaries run as
the current user, who is then also the database superuser.

``fsync`` stays on by default, so that tests which kill or restart the server see real crash recovery. A server
that no test kills (the test session's shared one) passes ``durable=False``: no fsync and no full-page writes,
which makes ``CREATE DATABASE`` per test and the session's end cheap. ``stop()`` deletes the cluster, so it
shuts the server down without the final checkpoint either way.

Run ``python -m harness.pgserver`` in the repository root to start one by hand; it prints the URL and waits
for Ctrl-C.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import psycopg

from harness.ports import free_port

HOST = "127.0.0.1"
DEFAULT_DBNAME = "spikehound_test"
POSTGRES_OS_USER = "postgres"
# Unix socket paths are limited to 107 bytes; leave room for "/.s.PGSQL.NNNNN".
_MAX_SOCKET_DIR_LEN = 80


def find_pg_bin() -> Path | None:
    """Return the directory holding ``initdb``/``pg_ctl``/``postgres``, or None if there is none.

    Tries, in order: the newest ``/usr/lib/postgresql/<version>/bin`` (Debian/Ubuntu layout),
    ``pg_config --bindir`` and the directory of ``initdb`` on ``PATH``.
    """

    def version_key(path: Path) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", path.parent.name)) or (0,)

    debian = [p for p in Path("/usr/lib/postgresql").glob("*/bin") if (p / "initdb").is_file()]
    if debian:
        return max(debian, key=version_key)
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        if out and (Path(out) / "initdb").is_file():
            return Path(out)
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).resolve().parent
    return None


def _pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (zombies count as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PostgresServer:
    """A throwaway PostgreSQL cluster: ``start()`` it, use ``url``, ``stop()`` it.

    ``restart()`` stops and starts the server on the same data directory and port (the data survive);
    ``shutdown()`` only stops the server process so that a later ``start()`` resumes the same cluster, for
    tests of "database down" behaviour. ``stop()`` also deletes the cluster. Usable as a context manager.
    """

    def __init__(
        self,
        base_dir: Path | None = None,
        *,
        pg_bin: Path | None = None,
        dbname: str = DEFAULT_DBNAME,
        durable: bool = True,
    ) -> None:
        """Prepare (but do not create) a cluster.

        ``base_dir``: where to put the cluster's temp directory (default: a fresh one under /tmp). When
        running as root its ancestors are given o+x so that the ``postgres`` user can reach the cluster.
        ``pg_bin``: directory with the PostgreSQL binaries (default: :func:`find_pg_bin`).
        ``durable``: fsync and full-page writes on (crash recovery is real), or off for a server nobody kills.
        """
        self._base_dir = Path(base_dir) if base_dir is not None else None
        self._pg_bin = Path(pg_bin) if pg_bin is not None else None
        self.dbname = dbname
        self.durable = durable
        self._as_root = os.geteuid() == 0
        self.user = POSTGRES_OS_USER if self._as_root else pwd.getpwuid(os.geteuid()).pw_name
        self.port: int | None = None
        self.workdir: Path | None = None
        self._extra_socket_dir: Path | None = None
        self._running = False
        self._db_created = False

    # ------------------------------------------------------------------ paths and properties

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory (``PGDATA``)."""
        return self._require_workdir() / "data"

    @property
    def log_path(self) -> Path:
        """The server log written by ``pg_ctl -l``."""
        return self._require_workdir() / "postgres.log"

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the test database, ``postgresql+psycopg://USER@127.0.0.1:PORT/DBNAME``."""
        if self.port is None or not self._db_created:
            raise RuntimeError("PostgresServer.url is only available after start()")
        return f"postgresql+psycopg://{self.user}@{HOST}:{self.port}/{self.dbname}"

    @property
    def dsn(self) -> str:
        """libpq URL of the test database (for ``psycopg.connect``), ``postgresql://USER@HOST:PORT/DB``."""
        return self.url.replace("postgresql+psycopg://", "postgresql://", 1)

    @property
    def running(self) -> bool:
        """Whether this object believes the server process is up."""
        return self._running

    def _require_workdir(self) -> Path:
        if self.workdir is None:
            raise RuntimeError("PostgresServer has no cluster yet; call start() first")
        return self.workdir

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 60) -> str:
        """Create the cluster if needed, start the server, wait until it accepts connections.

        Returns the SQLAlchemy URL. Idempotent while running. Raises RuntimeError (with the tail of the
        server log) if the server does not come up within ``timeout`` seconds.
        """
        if self._running:
            return self.url
        if self.workdir is None:
            self._create_cluster(timeout)
        self._launch(timeout)
        if not self._db_created:
            self._create_database()
        return self.url

    def stop(self) -> None:
        """Stop the server and delete the cluster. Idempotent.

        The data are thrown away, so the server is stopped at once (``immediate``: no shutdown checkpoint, which
        on a cluster that saw a few hundred databases costs tens of seconds), SIGKILL as a fallback."""
        try:
            if self._running:
                self._halt("immediate")
        finally:
            with contextlib.suppress(Exception):
                atexit.unregister(self.stop)
            for path in (self.workdir, self._extra_socket_dir):
                if path is not None:
                    shutil.rmtree(path, ignore_errors=True)
            self.workdir = None
            self._extra_socket_dir = None
            self.port = None
            self._db_created = False

    def shutdown(self, mode: str = "fast") -> None:
        """Stop the server process but keep the cluster; ``start()`` brings it back on the same port.

        ``mode`` is a ``pg_ctl stop`` mode: ``smart``, ``fast`` or ``immediate`` (the latter is a crash as
        far as the data are concerned: the next start runs WAL recovery).
        """
        if self._running:
            self._halt(mode)

    def restart(self, mode: str = "fast", timeout: float = 60) -> None:
        """Stop and start the server on the same data directory and port; committed data survive.

        ``mode`` as for :meth:`shutdown`; ``immediate`` simulates a database crash.
        """
        if self.workdir is None:
            raise RuntimeError("restart() called before start()")
        self.shutdown(mode)
        self._launch(timeout)

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ internals

    def _bin(self, name: str) -> str:
        if self._pg_bin is None:
            self._pg_bin = find_pg_bin()
            if self._pg_bin is None:
                raise RuntimeError(
                    "PostgreSQL server binaries (initdb, pg_ctl) not found: looked in "
                    "/usr/lib/postgresql/*/bin, `pg_config --bindir` and PATH"
                )
        path = self._pg_bin / name
        if not path.is_file():
            raise RuntimeError(f"{path} does not exist")
        return str(path)

    def _owner_ids(self) -> tuple[int, int]:
        """uid/gid that the PostgreSQL processes run as."""
        if not self._as_root:
            return os.geteuid(), os.getegid()
        try:
            entry = pwd.getpwnam(POSTGRES_OS_USER)
        except KeyError:
            raise RuntimeError(
                f"running as root but there is no {POSTGRES_OS_USER!r} system user to run PostgreSQL as"
            ) from None
        return entry.pw_uid, entry.pw_gid

    @staticmethod
    def _setpriv(uid: int, gid: int) -> list[str]:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise RuntimeError("running as root needs util-linux's setpriv to run PostgreSQL as its own user")
        return [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]

    def _run(self, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """Run a PostgreSQL binary, as the ``postgres`` user when we are root."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(LC_ALL="C", LANG="C")
        if self._as_root:
            uid, gid = self._owner_ids()
            env.update(HOME=pwd.getpwuid(uid).pw_dir, USER=POSTGRES_OS_USER, LOGNAME=POSTGRES_OS_USER)
            # setpriv rather than subprocess's user=/group=: those force a real fork(), and a
            # fork() of a process whose gRPC threads are busy can crash the child (rc=-11)
            # before it execs. Without them Python spawns with vfork, which runs no fork handlers.
            args = [*self._setpriv(uid, gid), *args]
        return subprocess.run(
            args,
            cwd=self._require_workdir(),
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def _make_workdir(self) -> Path:
        if self._base_dir is not None:
            self._base_dir.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix="spikehound-pg-", dir=self._base_dir)).resolve()
        workdir.chmod(0o755)
        if self._as_root:
            # The postgres user must be able to traverse every ancestor of the cluster.
            for parent in workdir.parents:
                mode = parent.stat().st_mode
                if not mode & 0o001:
                    parent.chmod(mode | 0o001)
        return workdir

    def _create_cluster(self, timeout: float) -> None:
        uid, gid = self._owner_ids()
        self.workdir = self._make_workdir()
        self.port = free_port()
        data, sock, log = self.workdir / "data", self.workdir / "sock", self.workdir / "postgres.log"
        if len(str(sock)) > _MAX_SOCKET_DIR_LEN:
            self._extra_socket_dir = Path(tempfile.mkdtemp(prefix="shpg-", dir="/tmp"))
            sock = self._extra_socket_dir
        data.mkdir(mode=0o700, exist_ok=True)
        data.chmod(0o700)
        sock.mkdir(exist_ok=True)
        sock.chmod(0o755)
        log.touch()
        for path in (data, sock, log):
            os.chown(path, uid, gid)

        result = self._run(
            [
                self._bin("initdb"),
                "-D", str(data),
                "-U", self.user,
                "-A", "trust",
                "-E", "UTF8",
                "--no-locale",
                "--no-sync",  # only skips initdb's own final fsync; the server runs with fsync=on
            ],
            timeout=max(timeout, 120),
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"initdb failed (rc={result.returncode}):\n{result.stdout}\n{result.stderr}")

        (data / "pg_hba.conf").write_text(
            "# throwaway test cluster: trust on the unix socket and loopback only\n"
            "local all all trust\n"
            f"host all all {HOST}/32 trust\n"
        )
        settings = {
            "listen_addresses": f"'{HOST}'",
            "port": str(self.port),
            "unix_socket_directories": f"'{sock}'",
            "max_connections": "100",
            "shared_buffers": "32MB",
            "fsync": "on" if self.durable else "off",
            "synchronous_commit": "on",
            "full_page_writes": "on" if self.durable else "off",
            "logging_collector": "off",
            "log_min_messages": "warning",
            "log_line_prefix": "'%m [%p] '",
            "timezone": "'UTC'",
        }
        with (data / "postgresql.conf").open("a") as conf:
            conf.write("\n# --- spikehound test server ---\n")
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())

    def _launch(self, timeout: float) -> None:
        """Start the server on the existing cluster and wait until it accepts TCP connections."""
        deadline = time.monotonic() + timeout
        result = self._run(
            [
                self._bin("pg_ctl"), "start",
                "-D", str(self.data_dir),
                "-l", str(self.log_path),
                "-w", "-t", str(max(1, int(timeout))),
            ],
            timeout=timeout + 10,
        )  # fmt: skip
        if result.returncode != 0:
            self._running = self._postmaster_pid() is not None
            output = f"{result.stdout.strip()} {result.stderr.strip()}".strip()
            raise RuntimeError(
                f"pg_ctl start failed (rc={result.returncode}): {output}"
                f"\n--- tail of {self.log_path} ---\n{self.log_tail()}"
            )
        self._running = True
        atexit.register(self.stop)
        last_error: Exception | None = None
        while True:
            try:
                with psycopg.connect(
                    host=HOST, port=self.port, user=self.user, dbname="postgres", connect_timeout=2
                ) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError as exc:
                last_error = exc
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"PostgreSQL on {HOST}:{self.port} did not accept connections within {timeout}s: "
                    f"{last_error}\n--- tail of {self.log_path} ---\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def _create_database(self) -> None:
        with psycopg.connect(
            host=HOST, port=self.port, user=self.user, dbname="postgres", autocommit=True
        ) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.dbname,)).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{self.dbname}"')
        self._db_created = True

    def _postmaster_pid(self) -> int | None:
        try:
            first = (self.data_dir / "postmaster.pid").read_text().splitlines()[0]
            return int(first.strip())
        except (OSError, IndexError, ValueError):
            return None

    def _halt(self, mode: str) -> None:
        """Stop the server process with ``pg_ctl stop -m MODE``; SIGKILL it if that fails."""
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"unknown shutdown mode {mode!r}")
        try:
            result = self._run(
                [self._bin("pg_ctl"), "stop", "-D", str(self.data_dir), "-m", mode, "-w", "-t", "30"],
                timeout=40,
            )
            ok = result.returncode == 0
        except (OSError, subprocess.SubprocessError, RuntimeError):
            ok = False
        if not ok:
            pid = self._postmaster_pid()
            if pid is not None and _pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while _pid_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                # Backends exit on their own once they notice the postmaster is gone.
                time.sleep(0.5)
        self._running = False

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log (empty string if there is none)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except (OSError, RuntimeError):
            return ""
        return "\n".join(text.splitlines()[-lines:])


def main() -> None:
    """Start a throwaway server, print its URL and keep it up until Ctrl-C (or SIGTERM)."""
    server = PostgresServer()
    started = time.monotonic()
    url = server.start()
    print(f"PostgreSQL up in {time.monotonic() - started:.1f}s (data: {server.data_dir})")
    print(url, flush=True)

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    # Restore Ctrl-C even if SIGINT was ignored (e.g. started with `&` from a non-interactive shell).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        print("stopped")


if __name__ == "__main__":
    main()
