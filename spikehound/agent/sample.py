"""The one reading type every agent sampler returns; the exporter turns these into OTLP metric points.

>>> Sample("hw.power", 412.5, "W", {"hw.id": "GPU-1"})
Sample(name='hw.power', value=412.5, unit='W', attributes={'hw.id': 'GPU-1'}, kind=<Kind.GAUGE: 'gauge'>)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Kind(enum.Enum):
    """How a reading is exported: a GAUGE is a point-in-time value, a COUNTER a cumulative monotonic total."""

    GAUGE = "gauge"
    COUNTER = "counter"


@dataclass(slots=True, frozen=True)
class Sample:
    """One reading: semantic-convention metric name, value, UCUM unit, data-point attributes and kind."""

    name: str
    value: float
    unit: str
    attributes: dict[str, str | int | float | bool]
    kind: Kind = Kind.GAUGE
