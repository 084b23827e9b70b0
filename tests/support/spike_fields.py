"""Every field of a spike as the API lists it, comparable across runs (the causes' scores rounded)."""

from __future__ import annotations

from typing import Any


def spike_fields(spike: dict[str, Any]) -> tuple[Any, ...]:
    """What must not differ between two collectors that found the same spike."""
    causes = tuple((c["kind"], c["service"], c["operation"], c["peer_service"], c["host"], c["resource"],
                    round(c["score"], 6)) for c in spike["causes"])
    return (spike["id"], spike["service"], spike["operation"], spike["state"], spike["start"], spike["end"],
            spike["p99_ms"], spike["baseline_p99_ms"], causes, tuple(spike["exemplar_trace_ids"]),
            tuple(tuple(sorted(a.items())) for a in spike["affected_streams"]))
