"""Smoke test for harness/pgserver.py: a real PostgreSQL server keeps committed rows across a restart."""

import psycopg
import pytest

try:
    from pgserver import PostgresServer, find_pg_bin
except ImportError:  # tests/ imported as a package
    from harness.pgserver import PostgresServer, find_pg_bin


@pytest.mark.postgres
def test_server_starts_and_keeps_data_across_restart(tmp_path):
    if find_pg_bin() is None:
        pytest.skip("PostgreSQL server binaries (initdb/pg_ctl) are not installed")
    server = PostgresServer(tmp_path)
    try:
        url = server.start()
        assert url.startswith("postgresql+psycopg://") and url.endswith("/spikehound_test")
        dsn = url.replace("+psycopg", "", 1)
        with psycopg.connect(dsn) as conn:
            conn.execute("CREATE TABLE smoke (id int PRIMARY KEY, note text)")
            conn.execute("INSERT INTO smoke VALUES (1, 'survives')")
        port = server.port

        server.restart()

        assert server.port == port
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT note FROM smoke WHERE id = 1").fetchone() == ("survives",)
    finally:
        server.stop()
    server.stop()  # idempotent
    assert server.workdir is None
