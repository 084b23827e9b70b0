"""The fault-pattern scorer reads recall against what could be found: a fault with fewer than two requests
through its service in its first two minutes is unreachable in time (one slow request is a lone stall)."""

from __future__ import annotations

from harness.fault_patterns import PatternRun, score
from harness.scenarios.mesh_traffic import MeshFault, MeshTimeline
from spikehound.units import NS


def test_a_fault_with_one_request_into_its_service_in_two_minutes_is_unreachable_and_named_so():
    sparse = MeshFault("delay", "ts-notification-service", onset_s=1200.0, duration_s=200.0, size_ms=1500.0)
    busy = MeshFault("delay", "ts-order-service", onset_s=2400.0, duration_s=200.0, size_ms=1500.0)
    timeline = MeshTimeline(1, hours=1.0, faults=[sparse, busy])

    def at(seconds: float) -> int:
        return timeline.start_ns + int(seconds * NS)

    run = PatternRun(timeline, spikes={}, first={}, requests_into={
        # one request in the sparse fault's first two minutes (the second came 130 s in), three in the busy one's
        "ts-notification-service": [at(1190.0), at(1250.0), at(1330.0)],
        "ts-order-service": [at(2401.0), at(2430.0), at(2519.0)],
    })

    scored = score([run])

    line = scored.line()
    assert (scored.faults, scored.reachable, line["reachable"]) == (2, 1, 0.5)
    assert line["recall"] == 0.0 and line["recall_of_reachable"] == 0.0
    missed = [note for note in scored.notes if note.startswith("missed")]
    assert len(missed) == 2
    assert missed[0].endswith("(1 request(s) into it in 2 min)") and "request(s)" not in missed[1]
