"""The database schema (SQLAlchemy Core tables), shared by SQLite and PostgreSQL.

Migrations in ``spikehound/storage/migrations`` create exactly these tables; a test
compares the two so that they cannot drift apart. Times are integers in
nanoseconds since the epoch (event time) unless the column says ``_at``
(arrival, wall clock). Ids are raw bytes; the API shows them as hex.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
)

metadata = MetaData()

# Spans are kept as they arrived: one block per export request (its OTLP encoding, holding only the
# spans that passed validation), found by trace id through trace_blocks. Writing one narrow index row
# per (trace, request) instead of one wide row per span is what lets ingest keep up with a fleet;
# reading a trace decodes its few blocks (upb parses a 512-span block in well under a millisecond).
span_blocks = Table(
    "span_blocks", metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("ingested_at", BigInteger, nullable=False),  # unix seconds; retention goes by arrival
    Column("span_count", Integer, nullable=False),
    Column("start_ns", BigInteger, nullable=False),  # earliest span start in the block
    Column("end_ns", BigInteger, nullable=False),  # latest span end in the block
    Column("payload", LargeBinary, nullable=False),  # ExportTraceServiceRequest
    Index("ix_span_blocks_ingested_at", "ingested_at"),
    Index("ix_span_blocks_end_ns", "end_ns"),  # blocks by event time: the service dependency graph
)

trace_blocks = Table(
    "trace_blocks", metadata,
    Column("trace_id", LargeBinary(16), nullable=False),
    Column("block_id", BigInteger, nullable=False),
    PrimaryKeyConstraint("trace_id", "block_id", name="pk_trace_blocks"),
    Index("ix_trace_blocks_block", "block_id"),  # retention deletes by block
)

# Trace search (the Jaeger query API): one row per (block, service), so a search by service, time and
# duration reads only blocks that can hold a match. A few rows per block, next to one per (trace, block).
span_block_services = Table(
    "span_block_services", metadata,
    Column("block_id", BigInteger, nullable=False),
    Column("service", String(255), nullable=False),
    Column("min_start_ns", BigInteger, nullable=False),  # earliest start of this service's spans in the block
    Column("max_start_ns", BigInteger, nullable=False),  # latest start
    Column("max_duration_ns", BigInteger, nullable=False),  # its longest span: minDuration skips the block
    PrimaryKeyConstraint("block_id", "service", name="pk_span_block_services"),
    Index("ix_span_block_services_search", "service", "max_start_ns"),
)

operations = Table(
    "operations", metadata,
    Column("service", String(255), nullable=False),
    Column("name", String(1024), nullable=False),
    Column("first_seen_at", BigInteger, nullable=False),
    PrimaryKeyConstraint("service", "name", name="pk_operations"),
)

hosts = Table(
    "hosts", metadata,
    Column("host", String(255), primary_key=True),
    Column("last_seen_at", BigInteger, nullable=False),  # unix ns, arrival
)

metric_series = Table(
    "metric_series", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("host", String(255), nullable=False),
    Column("name", String(255), nullable=False),
    Column("attributes", Text, nullable=False),  # canonical JSON (sorted keys)
    Column("kind", SmallInteger, nullable=False),
    Column("unit", String(64), nullable=False),
    UniqueConstraint("host", "name", "attributes", name="uq_metric_series_key"),
    Index("ix_metric_series_name", "name"),
)

metric_points = Table(
    "metric_points", metadata,
    Column("series_id", Integer, nullable=False),
    Column("t_ns", BigInteger, nullable=False),
    Column("value", Float, nullable=False),
    Column("ingested_at", BigInteger, nullable=False),
    UniqueConstraint("series_id", "t_ns", name="uq_metric_points_series_t"),
    Index("ix_metric_points_ingested_at", "ingested_at"),
)

# One row per closed window of a latency stream: an entry stream (peer_service empty) or the hop stream of
# peer_service's CLIENT spans calling service's operation (docs/detection.md).
latency_windows = Table(
    "latency_windows", metadata,
    Column("service", String(255), nullable=False),
    Column("operation", String(1024), nullable=False),
    Column("peer_service", String(255), nullable=False, server_default=""),
    Column("start_ns", BigInteger, nullable=False),
    Column("end_ns", BigInteger, nullable=False),
    Column("count", Integer, nullable=False),
    Column("p50_ns", BigInteger, nullable=False),
    Column("p95_ns", BigInteger, nullable=False),
    Column("p99_ns", BigInteger, nullable=False),
    Column("max_ns", BigInteger, nullable=False),
    PrimaryKeyConstraint("service", "operation", "peer_service", "start_ns", name="pk_latency_windows"),
    # /api/v1/latency?service= without an operation: the primary key alone would read the service's whole history.
    Index("ix_latency_windows_service_start", "service", "start_ns"),
    # Retention: the newest window, and the windows past storage.window_retention_days.
    Index("ix_latency_windows_start", "start_ns"),
)

spikes = Table(
    "spikes", metadata,
    Column("id", String(32), primary_key=True),
    Column("service", String(255), nullable=False),
    Column("operation", String(1024), nullable=False),
    Column("state", String(16), nullable=False),
    Column("start_ns", BigInteger, nullable=False),
    Column("end_ns", BigInteger),
    Column("p99_ns", BigInteger, nullable=False),
    Column("baseline_p99_ns", BigInteger, nullable=False),
    Column("exemplar_trace_ids", Text, nullable=False),  # JSON list of hex ids
    Column("detected_ns", BigInteger),  # event time (watermark) at which the detector opened it
    Column("peer_service", String(255)),  # set when a hop stream leads the spike: its caller
    Column("recurrence_of", String(32)),  # a return: the first spike of the chain (docs/detection.md)
    Column("occurrence", Integer, nullable=False, server_default="1"),  # 1 for a first spike, 2 for its return
    Column("first_start_ns", BigInteger),  # a return: the start of the chain's first spike
    Index("ix_spikes_start", "start_ns"),
    Index("ix_spikes_service_start", "service", "start_ns"),
    Index("ix_spikes_recurrence_of", "recurrence_of"),
)

# Every stream a spike moved (one incident, many streams), with its own numbers; rank 0 leads the spike.
spike_streams = Table(
    "spike_streams", metadata,
    Column("spike_id", String(32), nullable=False),
    Column("rank", SmallInteger, nullable=False),
    Column("service", String(255), nullable=False),
    Column("operation", String(1024), nullable=False),
    Column("peer_service", String(255)),
    Column("start_ns", BigInteger, nullable=False),
    Column("last_anomalous_end_ns", BigInteger, nullable=False),
    Column("p99_ns", BigInteger, nullable=False),
    Column("baseline_p99_ns", BigInteger, nullable=False),
    Column("evidence", Float, nullable=False),  # -log10 odds against normal
    Column("slow_requests", Integer, nullable=False),
    PrimaryKeyConstraint("spike_id", "rank", name="pk_spike_streams"),
    Index("ix_spike_streams_service", "service"),  # /api/v1/spikes?service= finds the spikes that moved it
)

causes = Table(
    "causes", metadata,
    Column("spike_id", String(32), nullable=False),
    Column("rank", SmallInteger, nullable=False),
    Column("kind", String(16), nullable=False),
    Column("service", String(255)),
    Column("operation", String(1024)),
    Column("peer_service", String(255)),
    Column("host", String(255)),
    Column("resource", String(255)),
    Column("score", Float, nullable=False),
    Column("baseline", Float),
    Column("observed", Float),
    Column("unit", String(32)),
    Column("summary", Text, nullable=False),
    PrimaryKeyConstraint("spike_id", "rank", name="pk_causes"),
)

# The detectors' learned state (baselines, open spikes, normal-trace reservoirs), saved periodically and at
# shutdown so that a restarted collector neither re-learns for an hour nor forgets a spike in progress.
detector_checkpoints = Table(
    "detector_checkpoints", metadata,
    Column("name", String(64), primary_key=True),
    Column("saved_at", BigInteger, nullable=False),  # unix seconds, wall clock
    Column("format", Integer, nullable=False),  # bumped when the state layout changes; older ones are ignored
    Column("state", LargeBinary, nullable=False),
    # Where storage stood at the save (the highest span_blocks.id, the latest metric_points.ingested_at):
    # after a SIGKILL what was committed later is fed to the restored detectors. NULL: saved before 0006.
    Column("span_block_id", BigInteger, nullable=True),
    Column("points_ingested_at", BigInteger, nullable=True),
)

# Alerts: the durable outbox of notifications (written in the same transaction as the routing state that made
# them, so a restart neither loses nor repeats one), the routing state per alert group, and silences.
alert_outbox = Table(
    "alert_outbox", metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("idempotency_key", String(64), nullable=False),  # sent as Idempotency-Key; receivers dedupe on it
    Column("receiver", String(255), nullable=False),
    Column("route", String(255), nullable=False),
    Column("group_id", String(64), nullable=False),
    Column("status", String(16), nullable=False),  # firing | resolved
    Column("body", LargeBinary, nullable=False),  # the request body, rendered once: every attempt sends the same
    Column("created_at", BigInteger, nullable=False),  # unix ns, wall clock
    Column("state", String(16), nullable=False),  # pending | delivered | dead
    Column("attempts", Integer, nullable=False),
    Column("next_attempt_at", BigInteger, nullable=False),  # unix ns
    Column("last_error", Text),
    Column("delivered_at", BigInteger),  # unix ns
    UniqueConstraint("idempotency_key", name="uq_alert_outbox_key"),
    Index("ix_alert_outbox_state_id", "state", "id"),  # the delivery loop's and the API's reads
)

alert_groups = Table(
    "alert_groups", metadata,
    Column("id", String(64), primary_key=True),
    Column("route", String(255), nullable=False),
    Column("state", Text, nullable=False),  # JSON: its alerts, what was last sent and when
    Column("updated_at", BigInteger, nullable=False),  # unix ns, wall clock
)

silences = Table(
    "silences", metadata,
    Column("id", String(32), primary_key=True),
    Column("matchers", Text, nullable=False),  # JSON: {"service": "gateway", "cause_kind": "resource", ...}
    Column("comment", Text, nullable=False),
    Column("created_by", String(255), nullable=False),
    Column("starts_at", BigInteger, nullable=False),  # unix ns
    Column("ends_at", BigInteger, nullable=False),  # unix ns; DELETE sets it to now (expired, still listed)
    Column("created_at", BigInteger, nullable=False),
    Index("ix_silences_ends_at", "ends_at"),
)

# Sampling profiles (docs/profiles.md). A call stack is stored once, found by the digest of its frames; each
# (process, window, stack) the agent's profiler counted is one narrow row, so a process that runs the same
# few hundred stacks all day adds a few dozen bytes a stack and window.
profile_stacks = Table(
    "profile_stacks", metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("digest", LargeBinary(16), nullable=False),  # BLAKE2b of the frames' JSON
    Column("frames", Text, nullable=False),  # JSON [[function, file, line], ...], root first
    UniqueConstraint("digest", name="uq_profile_stacks_digest"),
)

profile_samples = Table(
    "profile_samples", metadata,
    Column("stack_id", BigInteger, nullable=False),
    Column("host", String(255), nullable=False),
    Column("service", String(255), nullable=False),  # "" when the agent could not tell
    Column("pid", Integer, nullable=False),
    Column("process", String(255), nullable=False),
    Column("kind", String(8), nullable=False),  # cpu | wall
    Column("start_ns", BigInteger, nullable=False),
    Column("end_ns", BigInteger, nullable=False),
    Column("period_ns", BigInteger, nullable=False),
    Column("samples", Integer, nullable=False),
    Column("ingested_at", BigInteger, nullable=False),  # unix seconds; retention goes by arrival
    # A retried export (its answer lost) is stored once; two processes whose pid was not sent (0) stay apart.
    UniqueConstraint("host", "service", "process", "pid", "kind", "start_ns", "stack_id",
                     name="uq_profile_samples_key"),
    Index("ix_profile_samples_service", "service", "start_ns"),
    Index("ix_profile_samples_host", "host", "start_ns"),
    Index("ix_profile_samples_ingested_at", "ingested_at"),
    Index("ix_profile_samples_stack", "stack_id"),
)


# Scale-out (docs/scale-out.md): collectors sharing one PostgreSQL. Each commit of a member that holds data is
# one feed row, numbered by that member in its commit order (its one writer thread commits one batch at a time),
# so the detection leader reads every member's data exactly once, in order, by a cursor per member.
cluster_feed = Table(
    "cluster_feed", metadata,
    Column("member", String(64), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("block_ids", Text, nullable=False),  # JSON list of the span_blocks ids committed
    Column("points", LargeBinary, nullable=True),  # the metric points committed (storage/cluster.py's packing)
    # When it was written, on the database's clock (one clock for every member): the leader feeds the members'
    # rows to the detectors in this order, the order one collector would have received them in.
    Column("written_ns", BigInteger, nullable=False),
    PrimaryKeyConstraint("member", "seq", name="pk_cluster_feed"),
)

# Every collector of a cluster, as it last said it was alive (times from the database's clock: collectors'
# clocks may disagree, the database's is one).
cluster_members = Table(
    "cluster_members", metadata,
    Column("member", String(64), primary_key=True),
    Column("started_at", BigInteger, nullable=False),  # unix ns, database clock
    Column("heartbeat_at", BigInteger, nullable=False),  # unix ns, database clock
    Column("fed_seq", BigInteger, nullable=False),  # its last feed row committed
    Column("api_url", String(255), nullable=False),
    # A random token of the process that runs as this member now: a second process given the same name is
    # refused at start, and its heartbeats would not count.
    Column("instance", String(32), nullable=False, server_default=""),
    # The backend process id of the leader's session, on the leader's row only: a follower that finds the lock
    # held by a member whose heartbeats stopped (a hung process keeps its session) ends that session.
    Column("leader_pid", BigInteger, nullable=True),
)

# Where the detection leader's checkpoint stands in each member's feed (saved with the checkpoint).
cluster_cursors = Table(
    "cluster_cursors", metadata,
    Column("member", String(64), primary_key=True),
    Column("seq", BigInteger, nullable=False),
)
