"""A host's resource flag completes a sparse service's weak evidence: on the same traffic, a CPU contention on a
service of a few calls a minute is found sooner with its node's CPU samples than from its requests alone; and a
flag that an open spike on that node already explains completes nothing else there."""

from __future__ import annotations

from harness.fault_patterns import run
from harness.scenarios.fault_patterns import chaos
from harness.scenarios.mesh_traffic import MeshFault, MeshTimeline
from harness.scenarios.traffic import Batch
from spikehound.units import NS

FAULT = MeshFault("cpu", "ts-travel2-service", onset_s=21 * 60.0, duration_s=210.0, size_ms=500.0)


class _SpansOnly(MeshTimeline):
    """The same timeline with its metric samples left out (the spans are identical)."""

    def batches(self):  # type: ignore[override]
        for batch in super().batches():
            yield Batch(batch.time_ns, batch.spans)


def _found_after_s(timeline: MeshTimeline) -> list[tuple[float, str | None]]:
    result = run(timeline)
    onset = timeline.start_ns + int(FAULT.onset_s * NS)
    return sorted(((s.detected_unix_nano - onset) / NS, s.causes[0].service if s.causes else None)
                  for s in result.spikes.values() if s.start_unix_nano >= onset - 10 * NS)


def test_a_cpu_fault_on_a_sparse_service_is_found_sooner_with_its_nodes_cpu_busy():
    with_cpu = _found_after_s(MeshTimeline(0, hours=0.45, faults=[FAULT]))
    requests_only = _found_after_s(_SpansOnly(0, hours=0.45, faults=[FAULT]))
    assert [service for _, service in with_cpu] == [service for _, service in requests_only] == ["ts-travel2-service"]
    assert with_cpu[0][0] < 120.0 < requests_only[0][0]  # within two minutes only with the node's CPU


def test_a_flag_on_the_node_of_an_open_spike_completes_no_other_service_there():
    # Chaos seed 202's second CPU fault on ts-assurance-service (onset at 3783 s): its node's CPU flag is that
    # spike's. ts-food-map-service, on the same node, had two slow calls while it lasted; counted as evidence
    # there too, the one flag opened a second spike for the one fault.
    timeline = chaos(202)
    onset_ns = timeline.start_ns + int(3783.3 * NS)
    spikes = run(timeline, until_ns=onset_ns + 150 * NS).spikes
    during = [(s.service, s.causes[0].service if s.causes else None)
              for s in spikes.values() if s.start_unix_nano >= onset_ns - 30 * NS]
    assert during == [("ts-gateway-service", "ts-assurance-service")], during
