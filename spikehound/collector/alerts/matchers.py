"""Which spikes a route or a silence covers: shell-style patterns on the streams and on the causes.

For a route, a service pattern matches the spike's leading stream or any stream the spike moved (its
``affected``): a route for ``model-*`` takes the spike led by the gateway route whose calls into the
model server slowed. For a silence it matches the leading stream only: an outage moves every stream, and a
silence on one of them must not hide it (to silence what a service causes, match ``cause_service``).

Patterns are ``fnmatch`` globs, case-sensitive (``model-*``, ``POST /v1/*``);
a plain name matches only itself. Every non-empty field must match. The cause
fields must all hold for one and the same cause, anywhere in the spike's
ranked list: "a spike whose causes include a GPU utilization drop" is
``cause_kinds=("resource",), cause_resources=("hw.gpu.utilization",)``.

>>> from spikehound.model import Cause, CauseKind, Spike
>>> spike = Spike(id="s1", service="gateway", operation="POST /v1/predict", state="open", start_unix_nano=0,
...               end_unix_nano=None, p99_ns=300_000_000, baseline_p99_ns=100_000_000, causes=(
...     Cause(kind=CauseKind.SPAN, score=0.7, summary="resize", service="preprocess"),
...     Cause(kind=CauseKind.RESOURCE, score=0.2, summary="GPU idle", service="model-server",
...           resource="hw.gpu.utilization")))
>>> SpikeMatcher(services=("gate*",), cause_kinds=("resource",), cause_resources=("hw.gpu.*",)).matches(spike)
True
>>> SpikeMatcher(cause_kinds=("resource",), min_cause_score=0.5).matches(spike)
False
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from spikehound.model import Cause, Spike


def _any(value: str | None, patterns: tuple[str, ...]) -> bool:
    return value is not None and any(fnmatchcase(value, p) for p in patterns)


def _services(spike: Spike) -> list[str]:
    """The services of the spike's streams: its leader's, then those of the streams it moved."""
    return [spike.service, *(a.service for a in spike.affected)]


@dataclass(frozen=True, slots=True)
class SpikeMatcher:
    """Patterns on a spike: its ``service`` and ``operation``, and the fields of its causes.

    ``cause_kinds`` holds patterns on the values of :class:`spikehound.model.CauseKind`.
    """

    services: tuple[str, ...] = ()
    operations: tuple[str, ...] = ()
    cause_kinds: tuple[str, ...] = ()
    cause_services: tuple[str, ...] = ()
    cause_resources: tuple[str, ...] = ()
    min_cause_score: float = 0.0

    @property
    def on_causes(self) -> bool:
        return bool(self.cause_kinds or self.cause_services or self.cause_resources or self.min_cause_score > 0)

    def matches(self, spike: Spike, moved: bool = True) -> bool:
        """True when ``spike`` matches; ``moved=False`` matches services on the leading stream only."""
        # A service matches the stream that leads the spike or any stream it moved (a route whose calls
        # into the service slowed is about that service too).
        services = _services(spike) if moved else [spike.service]
        if self.services and not any(_any(s, self.services) for s in services):
            return False
        if self.operations and not _any(spike.operation, self.operations):
            return False
        return not self.on_causes or any(self._cause(c) for c in spike.causes)

    def _cause(self, c: Cause) -> bool:
        return ((not self.cause_kinds or _any(c.kind.value, self.cause_kinds))
                and (not self.cause_services or _any(c.service, self.cause_services))
                and (not self.cause_resources or _any(c.resource, self.cause_resources))
                and c.score >= self.min_cause_score)
