"""Shared fixtures: databases (SQLite and a real PostgreSQL server) and running collectors."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from hypothesis import HealthCheck, settings

from tests.daemons import CollectorThread, collector_config
from tests.pgserver import PostgresServer, find_pg_bin

IN_CI = os.environ.get("CI") == "true"


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the session; each test that asks gets its own database."""
    if find_pg_bin() is None:
        if IN_CI:
            pytest.fail("PostgreSQL binaries are missing; CI must test against a real server")
        pytest.skip("PostgreSQL is not installed")
    server = PostgresServer()
    server.start()
    yield server
    server.stop()


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


# Hypothesis (tests/test_fuzz.py): derandomized in make test and CI, so a run is the same every time and a
# failure reproduces; HYPOTHESIS_PROFILE=dev draws new inputs each run. Nothing is written to .hypothesis/.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.large_base_example])
settings.register_profile("dev", parent=settings.get_profile("ci"), derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
