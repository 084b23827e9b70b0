"""The regression gate: compare a candidate's latency profile with a baseline's.

For every entry operation on both sides: p50/p95/p99 and request counts, and
the change of each with a bootstrap confidence interval (``spikehound.detectors.bootstrap``);
the same for every stage of the operation's critical path (the time a span, or
a network hop, held the path).

The verdict, as ``spikehound compare`` exits:

* **1, regression**: for some operation the whole confidence interval of the
  relative p99 change lies above ``max_regression``: the data support a p99
  regression larger than allowed. The message names the operation and the
  stage whose p99 grew most (among those whose growth is itself supported).
* **2, insufficient**: no operation has ``min_requests`` on both sides, so
  nothing could be judged; the reasons say which side lacks what.
* **0, ok**: every operation that could be judged is within the allowance.

Operations found on one side only, or with too few requests, are listed as
not judged. The random draws come from ``seed``, so the same data give the
same answer.

>>> from spikehound.detectors.profile import OperationProfile, Profile
>>> from spikehound.detectors.bootstrap import OrderStatistics
>>> def side(ms):
...     return Profile({("gw", "GET /"): OperationProfile("gw", "GET /", OrderStatistics.of([m * 1e6 for m in ms]))})
>>> same = compare(side(range(1, 401)), side(range(1, 401)))
>>> same.exit_code, same.message
(0, 'no p99 regression beyond 5% in 1 operation')
>>> slower = compare(side(range(1, 401)), side(range(11, 411)))
>>> slower.exit_code, slower.operations[0].delta["p99"].relative > 0.02
(0, True)
>>> much = compare(side(range(1, 401)), side([m * 1.5 for m in range(1, 401)]))
>>> much.exit_code, much.message.splitlines()[0]
(1, 'p99 regression in 1 operation:')
>>> compare(side(range(1, 401)), side(range(1, 11))).message
'too little data to judge: gw GET /: the candidate has 10 requests, fewer than 100'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spikehound.detectors.bootstrap import DEFAULT_REPLICATES, Delta, OrderStatistics, delta
from spikehound.detectors.path_time import Stage
from spikehound.detectors.profile import Profile
from spikehound.units import MS

__all__ = ["QUANTILES", "CompareOptions", "Comparison", "OperationComparison", "StageComparison", "compare",
           "comparison_report"]

QUANTILES = (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))


@dataclass(frozen=True, slots=True)
class CompareOptions:
    max_regression: float = 0.05  # the p99 may grow by this fraction before the gate fails
    min_requests: int = 100  # per side, before an operation's p99 is judged
    confidence: float = 0.95  # of the bootstrap intervals
    replicates: int = DEFAULT_REPLICATES
    seed: int = 0
    service: str | None = None  # judge only this service's operations
    operation: str | None = None  # and only this operation


def _quantiles(sample: OrderStatistics | None) -> dict[str, float | None]:
    return {name: (sample.quantile(q) if sample is not None else None) for name, q in QUANTILES}


@dataclass(slots=True)
class StageComparison:
    stage: Stage
    baseline_count: int
    candidate_count: int
    baseline: dict[str, float | None]  # ns per quantile name
    candidate: dict[str, float | None]
    delta: dict[str, Delta] = field(default_factory=dict)  # empty unless the stage is on both sides

    @property
    def grew_ns(self) -> float:
        """The p99 growth: the delta's point estimate, or the whole p99 of a stage new to the path."""
        if "p99" in self.delta:
            return self.delta["p99"].point
        if self.baseline_count == 0:
            return self.candidate["p99"] or 0.0  # new on the path
        return -(self.baseline["p99"] or 0.0)  # gone from the path

    @property
    def growth_supported(self) -> bool:
        if "p99" in self.delta:
            return self.delta["p99"].low > 0
        return self.baseline_count == 0 and self.candidate_count > 0


@dataclass(slots=True)
class OperationComparison:
    service: str
    operation: str
    baseline_count: int
    candidate_count: int
    baseline: dict[str, float | None]
    candidate: dict[str, float | None]
    delta: dict[str, Delta] = field(default_factory=dict)
    judged: bool = False
    reason: str | None = None  # why it was not judged
    regression: bool = False
    stages: list[StageComparison] = field(default_factory=list)
    grew: StageComparison | None = None  # the stage whose p99 grew most

    @property
    def name(self) -> str:
        return f"{self.service} {self.operation}"


@dataclass(slots=True)
class Comparison:
    options: CompareOptions
    operations: list[OperationComparison]
    exit_code: int  # 0 ok, 1 regression, 2 too little data
    message: str

    @property
    def verdict(self) -> str:
        return {0: "ok", 1: "regression", 2: "insufficient"}[self.exit_code]

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "exit_code": self.exit_code, "message": self.message,
                "max_regression": self.options.max_regression, "min_requests": self.options.min_requests,
                "confidence": self.options.confidence, "seed": self.options.seed,
                "operations": [_operation_json(op) for op in self.operations]}


def compare(baseline: Profile, candidate: Profile, options: CompareOptions | None = None) -> Comparison:
    """Compare two profiles (see the module docstring for the verdict)."""
    options = options or CompareOptions()
    rng = np.random.default_rng(options.seed)
    keys = sorted(set(baseline.operations) | set(candidate.operations))
    keys = [k for k in keys if (options.service is None or k[0] == options.service)
            and (options.operation is None or k[1] == options.operation)]
    ops = [_compare_operation(key, baseline, candidate, options, rng) for key in keys]
    return Comparison(options, ops, *_verdict(ops, options, baseline, candidate))


def comparison_report(comparison: Comparison, baseline: Profile, candidate: Profile) -> dict[str, Any]:
    """The JSON answer of ``GET /api/v1/compare`` and ``spikehound compare --format json``."""
    def side(p: Profile) -> dict[str, Any]:
        return {**p.meta, "operations": len(p.operations), "path_traces": p.path_traces}

    return {**comparison.to_json(), "baseline": side(baseline), "candidate": side(candidate)}


def _compare_operation(key: tuple[str, str], baseline: Profile, candidate: Profile, options: CompareOptions,
                       rng: np.random.Generator) -> OperationComparison:
    b, c = baseline.operations.get(key), candidate.operations.get(key)
    b_n, c_n = (b.latency.n if b else 0), (c.latency.n if c else 0)
    op = OperationComparison(key[0], key[1], b_n, c_n, _quantiles(b.latency if b else None),
                             _quantiles(c.latency if c else None))
    if b is None or c is None:
        op.reason = f"only in the {'candidate' if b is None else 'baseline'}"
        return op
    short = [f"the {name} has {n} requests" for name, n in (("baseline", b_n), ("candidate", c_n))
             if n < options.min_requests]
    if short:
        op.reason = f"{' and '.join(short)}, fewer than {options.min_requests}"
        return op
    op.judged = True
    op.delta = _deltas(b.latency, c.latency, rng, options)
    p99 = op.delta["p99"]
    op.regression = p99.relative_low is not None and p99.relative_low > options.max_regression
    for stage in sorted(set(b.stages) | set(c.stages)):
        bs, cs = b.stages.get(stage), c.stages.get(stage)
        sc = StageComparison(stage, bs.n if bs else 0, cs.n if cs else 0, _quantiles(bs), _quantiles(cs))
        if bs is not None and cs is not None:
            sc.delta = _deltas(bs, cs, rng, options)
        op.stages.append(sc)
    if op.stages:
        supported = [s for s in op.stages if s.growth_supported]
        op.grew = max(supported or op.stages, key=lambda s: s.grew_ns)
        if op.grew.grew_ns <= 0:
            op.grew = None
    return op


def _deltas(b: OrderStatistics, c: OrderStatistics, rng: np.random.Generator,
            options: CompareOptions) -> dict[str, Delta]:
    return {name: delta(b, c, q, rng, confidence=options.confidence, replicates=options.replicates)
            for name, q in QUANTILES}


def _ms(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / MS:.1f} ms"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.0f}%"


def regression_sentence(op: OperationComparison, options: CompareOptions) -> str:
    """One line naming the operation, its p99 change and the stage that grew."""
    p99 = op.delta["p99"]
    line = (f"{op.name}: p99 {_ms(op.baseline['p99'])} -> {_ms(op.candidate['p99'])} "
            f"({_pct(p99.relative)}, {options.confidence:.0%} CI {_pct(p99.relative_low)} to "
            f"{_pct(p99.relative_high)}; allowed {_pct(options.max_regression)})")
    if op.grew is not None:
        g = op.grew
        line += (f"; the span that grew: {g.stage.label} (p99 {_ms(g.baseline['p99'])} -> "
                 f"{_ms(g.candidate['p99'])}, {g.grew_ns / MS:+.1f} ms)")
    return line


def _verdict(ops: list[OperationComparison], options: CompareOptions, baseline: Profile,
             candidate: Profile) -> tuple[int, str]:
    regressions = [op for op in ops if op.regression]
    if regressions:
        n = len(regressions)
        return 1, "\n".join([f"p99 regression in {n} operation{'s' * (n != 1)}:",
                             *(f"  {regression_sentence(op, options)}" for op in regressions)])
    judged = [op for op in ops if op.judged]
    if judged:
        n = len(judged)
        return 0, f"no p99 regression beyond {options.max_regression:.0%} in {n} operation{'s' * (n != 1)}"
    empty = [f"the {name} ({p.meta['selector']})" if "selector" in p.meta else f"the {name}"
             for name, p in (("baseline", baseline), ("candidate", candidate)) if not p.operations]
    if empty:
        return 2, f"too little data to judge: no requests match {' or '.join(empty)} in the time range"
    if not ops:
        return 2, "too little data to judge: no operation matches " + " ".join(
            f"{flag} {value}" for flag, value in (("--service", options.service), ("--operation", options.operation))
            if value is not None)
    return 2, "too little data to judge: " + "; ".join(f"{op.name}: {op.reason}" for op in ops)


def _delta_json(d: Delta) -> dict[str, Any]:
    return {"ms": d.point / MS, "ms_ci": [d.low / MS, d.high / MS], "relative": d.relative,
            "relative_ci": None if d.relative is None else [d.relative_low, d.relative_high]}


def _side_json(count: int, quantiles: dict[str, float | None]) -> dict[str, Any]:
    return {"count": count, **{f"{name}_ms": (None if v is None else v / MS) for name, v in quantiles.items()}}


def _stage_json(s: StageComparison) -> dict[str, Any]:
    return {"kind": s.stage.kind, "service": s.stage.service, "name": s.stage.name,
            "peer_service": s.stage.peer_service, "label": s.stage.label,
            "baseline": _side_json(s.baseline_count, s.baseline),
            "candidate": _side_json(s.candidate_count, s.candidate),
            "delta": {name: _delta_json(d) for name, d in s.delta.items()}}


def _operation_json(op: OperationComparison) -> dict[str, Any]:
    return {"service": op.service, "operation": op.operation, "judged": op.judged, "reason": op.reason,
            "regression": op.regression,
            "baseline": _side_json(op.baseline_count, op.baseline),
            "candidate": _side_json(op.candidate_count, op.candidate),
            "delta": {name: _delta_json(d) for name, d in op.delta.items()},
            "grew": None if op.grew is None else {**_stage_json(op.grew), "p99_growth_ms": op.grew.grew_ns / MS,
                                                  "supported": op.grew.growth_supported},
            "stages": [_stage_json(s) for s in op.stages]}
