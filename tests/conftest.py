"""Shared fixtures: databases (SQLite and a real PostgreSQL server) and running collectors."""

from __future__ import annotations

import functools
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from sqlalchemy import Engine, event
from xdist.scheduler import LoadScopeScheduling

from harness.daemons import CollectorThread, collector_config
from harness.pgserver import PostgresServer, find_pg_bin
from spikehound.model import ProfileStack
from spikehound.storage.engine import make_engine
from spikehound.storage.migrate import upgrade
from spikehound.storage.reader import Reader
from spikehound.storage.writer import WriteBatch, Writer
from tests.support.ci import IN_CI
from tests.support.storage_data import NOW, SPIKES, T0, S, make_span, point, window


def _postgres_server(*, durable: bool) -> Iterator[PostgresServer]:
    if find_pg_bin() is None:
        if IN_CI:
            pytest.fail("PostgreSQL binaries are missing; CI must test against a real server")
        pytest.skip("PostgreSQL is not installed")
    server = PostgresServer(durable=durable)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the session (for each xdist worker); each test that asks gets its own database.
    Nothing kills it, so it runs without fsync."""
    yield from _postgres_server(durable=False)


@pytest.fixture(scope="module")
def own_pg_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server of one test module's own, for tests that stop and restart it (fsync on: a crash
    recovers for real)."""
    yield from _postgres_server(durable=True)


@pytest.fixture
def pg_url(pg_server: PostgresServer) -> str:
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return pg_server.url.rsplit("/", 1)[0] + f"/{name}"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Every storage and API test runs on both databases."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'spikehound.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def collector(db_url: str) -> Iterator[CollectorThread]:
    with CollectorThread(collector_config(db_url)) as running:
        yield running


@pytest.fixture
def sqlite_collector(tmp_path: Path) -> Iterator[CollectorThread]:
    with CollectorThread(collector_config(f"sqlite:///{tmp_path / 'spikehound.db'}")) as running:
        yield running


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """A migrated database of each kind (SQLite, then PostgreSQL)."""
    eng = make_engine(db_url)
    upgrade(eng)
    yield eng
    eng.dispose()


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Reader, list[tuple[str, Any]]]]:
    """A reader over a small SQLite database of every kind of record, and the SQL statements it runs (for
    their query plans: tests/test_storage.py, tests/test_web_pages.py)."""
    eng = make_engine(f"sqlite:///{Path(tmp_path_factory.mktemp('plans')) / 'plans.db'}")
    upgrade(eng)
    writer = Writer(eng)
    for s in (1, 2, 3):  # every trace spread over three requests
        writer.write(WriteBatch(spans=[make_span(t, s, s - 1 if s > 1 else None, name=f"op-{s}")
                                       for t in range(1, 30)]), now_ns=NOW)
    writer.write(WriteBatch(
        points=[point(T0 + i * S, float(i), host=f"gpu-{i % 3}", attributes={"hw.id": f"GPU-{i % 2}"})
                for i in range(60)],
        windows=[window(T0 + i * 10 * S, 10, operation=f"op-{i % 3}") for i in range(60)],
        spikes=SPIKES), now_ns=NOW)
    writer.write_profiles([ProfileStack(host="gpu-1", service="preprocess", pid=1, process="python3",
                                        start_unix_nano=T0 + i * 10 * S, end_unix_nano=T0 + (i + 1) * 10 * S,
                                        frames=(("main", "app.py", 1), (f"f{i % 4}", "app.py", 2)), samples=5)
                           for i in range(60)], now_ns=NOW)
    statements: list[tuple[str, Any]] = []

    @event.listens_for(eng, "before_cursor_execute")
    def _capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        statements.append((statement, parameters))

    yield Reader(eng), statements
    eng.dispose()


# Hypothesis (tests/test_fuzz.py): derandomized in make test and CI, so a run is the same every time and a
# failure reproduces; HYPOTHESIS_PROFILE=dev draws new inputs each run. Nothing is written to .hypothesis/.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.large_base_example])
settings.register_profile("dev", parent=settings.get_profile("ci"), derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# make test runs on pytest-xdist workers. A test goes to whichever worker is free, except that the tests of a
# module with a module- or class-scoped fixture (a demo run, a scenario suite, a browser, a module's own
# PostgreSQL server) all go to one worker, so that the fixture is built once. The modules that take a minute or
# more (measured with --durations=0) go first, longest first, so that none of them starts last and keeps one
# worker busy after the others are done. Only the order depends on this list.
LONGEST_FIRST = (
    "test_scale_out.py", "test_demo.py", "test_soak.py", "test_detection_suite.py", "test_image.py", "test_agent.py",
    "test_detection_live.py", "test_storage_faults.py", "test_cluster.py", "test_detection_continuity.py",
    "test_detection_process.py", "test_web_browser.py", "test_alert_live.py", "test_web_pages.py",
    "test_fuzz.py", "test_profiler.py", "test_ingest_sdk.py", "test_distribution.py",
)
# What marks a module whose tests share a fixture: its own wider-scoped fixtures, or conftest's.
_SHARED = re.compile(r'scope="(module|class|package)"|\b(planned|own_pg_server)\b')


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Iterator[None]:
    """Longest modules first; after any shuffle (pytest-randomly wraps inside this, being registered earlier),
    a test marked ``ends_shared_fixture`` moves behind the rest of its module, since it ends what they share."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    yield
    for item in [item for item in items if item.get_closest_marker("ends_shared_fixture")]:
        items.remove(item)
        same_module = [i for i, other in enumerate(items) if other.path == item.path]
        items.insert(same_module[-1] + 1 if same_module else len(items), item)


@functools.cache
def _shares_fixtures(module: Path) -> bool:
    return module.is_file() and bool(_SHARED.search(module.read_text()))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Test by test, but a module that shares a fixture as one unit, in collection order (LONGEST_FIRST)."""
    config.option.loadscopereorder = False  # xdist would order the units by their number of tests

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if _shares_fixtures(config.rootpath / module) else nodeid

    return SharedFixtureScheduling(config, log)
