"""Text for people: the tables ``spikehound compare`` and ``spikehound analyze`` print.

Each function takes the JSON the collector's API answers (``/api/v1/compare``,
``/api/v1/analyze/batching``, ``/api/v1/analyze/pipeline``) and returns lines,
so that what a person reads and what a machine reads (``--format json``) are
the same numbers.

>>> relative_time("30m", now_ns=3_600_000_000_000), relative_time("now", 3_600_000_000_000), relative_time("7", 0)
('1800', '3600.000', '7')
>>> table([("a", 1), ("bbb", 22)], ("NAME", "N"))
['NAME  N', 'a     1', 'bbb   22']
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
STAGES_SHOWN = 8  # per operation in the table; --format json has all


def relative_time(text: str, now_ns: int) -> str:
    """``now`` and ``30m``/``2h``/``7d`` (before now) as unix seconds; anything else unchanged."""
    if text == "now":
        return f"{now_ns / 1e9:.3f}"
    found = _RELATIVE.match(text.strip())
    if found is None:
        return text
    return str(int(now_ns / 1e9 - float(found[1]) * _UNIT_SECONDS[found[2]]))


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    return ["  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=False)).rstrip() for row in (header, *rows)]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.0f}%"


def _pair(side: dict[str, Any], other: dict[str, Any], key: str) -> str:
    return f"{_ms(side.get(key))} -> {_ms(other.get(key))}"


def _ci(delta: dict[str, Any] | None, relative: bool) -> str:
    if not delta:
        return "-"
    if relative:
        ci = delta.get("relative_ci")
        return "-" if ci is None else f"{_pct(ci[0])} to {_pct(ci[1])}"
    lo, hi = delta["ms_ci"]
    return f"{lo:+.1f} to {hi:+.1f}"


def comparison_lines(report: dict[str, Any]) -> list[str]:
    """The comparison as a table per operation, its critical-path stages below it, then the verdict."""
    lines = []
    for name in ("baseline", "candidate"):
        side = report.get(name, {})
        window = f"{side.get('since', '?')} .. {side.get('until', '?')}"
        lines.append(f"{name:<9}  {side.get('selector', '?')}  ({window}: {side.get('spans', 0):,} spans, "
                     f"{side.get('operations', 0)} operations)")
    lines.append("")
    rows = []
    for op in report["operations"]:
        b, c, p99 = op["baseline"], op["candidate"], op["delta"].get("p99")
        verdict = "REGRESSION" if op["regression"] else ("ok" if op["judged"] else f"not judged: {op['reason']}")
        rows.append((op["service"], op["operation"], f"{b['count']}/{c['count']}", _pair(b, c, "p50_ms"),
                     _pair(b, c, "p95_ms"), _pair(b, c, "p99_ms"), _pct(p99 and p99["relative"]),
                     _ci(p99, relative=True), verdict))
    conf = f"{report.get('confidence', 0.95):.0%} CI"
    lines += table(rows, ("SERVICE", "OPERATION", "REQUESTS", "P50 MS", "P95 MS", "P99 MS", "P99 CHANGE", conf,
                          "VERDICT"))
    for op in report["operations"]:
        stages = [s for s in op["stages"] if s["delta"]] + [s for s in op["stages"] if not s["delta"]]
        if not op["judged"] or not stages:
            continue
        stages.sort(key=lambda s: -abs(s["delta"]["p99"]["ms"]) if s["delta"] else 0.0)
        grew = (op.get("grew") or {}).get("label")
        lines += ["", f"critical path of {op['service']} {op['operation']}: time each stage held the path, "
                      "per request it was on"]
        rows = [(s["label"], f"{s['baseline']['count']}/{s['candidate']['count']}",
                 _pair(s["baseline"], s["candidate"], "p50_ms"), _pair(s["baseline"], s["candidate"], "p99_ms"),
                 f"{s['delta']['p99']['ms']:+.1f}" if s["delta"] else "new" if not s["baseline"]["count"] else "gone",
                 _ci(s["delta"].get("p99"), relative=False), "<- grew" if s["label"] == grew else "")
                for s in stages[:STAGES_SHOWN]]
        lines += ["  " + line for line in table(rows, ("STAGE", "REQUESTS", "P50 MS", "P99 MS", "P99 CHANGE MS",
                                                        conf, ""))]
        if len(stages) > STAGES_SHOWN:
            lines.append(f"  ({len(stages) - STAGES_SHOWN} more stages in --format json)")
    return [*lines, "", report["message"]]


def batching_lines(report: dict[str, Any]) -> list[str]:
    rows = []
    for g in report["groups"]:
        lo, hi = g["p99_ci_ms"]
        gpu = "-" if g["gpu_utilization"] is None else f"{g['gpu_utilization'] * 100:.0f}%"
        rows.append((g["batch"], g["count"], _ms(g["p50_ms"]), _ms(g["p95_ms"]), _ms(g["p99_ms"]),
                     f"{lo:.1f} to {hi:.1f}", "-" if g["throughput_rps"] is None else f"{g['throughput_rps']:.1f}",
                     gpu, ",".join(g["hosts"]) or "-", "" if g["enough_data"] else "too few requests"))
    lines = [f"{report['service']}: requests by {report['attribute']} ({report.get('since')} .. {report.get('until')})",
             ""]
    lines += table(rows, ("BATCH", "REQUESTS", "P50 MS", "P95 MS", "P99 MS", "P99 95% CI", "REQ/S", "GPU UTIL",
                          "HOSTS", ""))
    if report.get("requests_without_attribute"):
        lines.append(f"({report['requests_without_attribute']} requests had no {report['attribute']} attribute)")
    target = report.get("p99_target_ms")
    lines += ["", (f"recommendation for a p99 target of {target:g} ms: " if target is not None else "")
              + report["message"]]
    return lines


def _bar(share: float, width: int = 20) -> str:
    return "#" * round(max(share, 0.0) * width)


def pipeline_lines(report: dict[str, Any]) -> list[str]:
    if not report["operations"]:
        return [f"no requests of {report['service']} in {report.get('since')} .. {report.get('until')}"]
    lines: list[str] = []
    for op in report["operations"]:
        m, t = op["median"], op["p99"]
        lines += [f"{op['service']} {op['operation']}: {op['requests']:,} requests; median group {m['count']} "
                  f"({m['latency_ms'][0]:.1f}-{m['latency_ms'][1]:.1f} ms), p99 group {t['count']} "
                  f"({t['latency_ms'][0]:.1f}-{t['latency_ms'][1]:.1f} ms)", op["headline"], ""]
        rows = [(s["label"], _ms(s["median"]["ms"]), f"{s['median']['share']:.0%}", _bar(s["median"]["share"]),
                 _ms(s["p99"]["ms"]), f"{s['p99']['share']:.0%}", _bar(s["p99"]["share"])) for s in op["stages"]]
        lines += table(rows, ("STAGE (self time; network = call time outside the callee)", "MEDIAN MS", "SHARE", "",
                              "P99 MS", "SHARE", ""))
        rows = [(s["service"], _ms(s["median"]["ms"]), f"{s['median']['share']:.0%}", _bar(s["median"]["share"]),
                 _ms(s["p99"]["ms"]), f"{s['p99']['share']:.0%}", _bar(s["p99"]["share"])) for s in op["services"]]
        lines += ["", *table(rows, ("BY SERVICE", "MEDIAN MS", "SHARE", "", "P99 MS", "SHARE", "")), ""]
    return lines[:-1]
