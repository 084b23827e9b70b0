"""The Prometheus rules, the example scrape config and the Grafana dashboard, against the real Prometheus.

promtool checks the rule file, its unit tests and the example configuration. End to end, a real Prometheus
server scrapes a running collector and agent while the real OpenTelemetry SDK sends spans (through the agent,
as a model server on a GPU host would) and GPU samples (the one part this machine cannot have: NVML readings
sent by the SDK under the agent's metric name). Then:

* ``histogram_quantile(0.99, ...)`` over the spanmetrics buckets is within one bucket of the true p99 sent;
* every rule of the shipped rule file evaluates, and the p99-high / GPU-low alert is raised for the host;
* every query of the Grafana dashboard, its variables filled in, evaluates and returns series, and names
  only metrics that spikehound exports.
"""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
import time
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from opentelemetry import trace
from prometheus_client.parser import text_string_to_metric_families

from harness.daemons import AgentProcess, CollectorThread, collector_config
from harness.scrape import scrape_text
from harness.waiting import eventually
from spikehound.collector.span_metrics import DURATION_BUCKETS_MS
from spikehound.detectors.windows import nearest_rank
from spikehound.model import Cause, CauseKind, Spike
from spikehound.storage.engine import make_engine
from spikehound.storage.writer import WriteBatch, Writer
from tests.support.otel_send import MS, sample_provider, timed_span, tracer_provider
from tests.support.prometheus import REPO, RULES, PrometheusServer, tool

DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "spikehound.json"
SERVICE, HOST = "e2e-model", "e2e-gpu-host"
SENT = 2_000
GPU_UTILIZATION = 0.12  # an idle GPU (12 %) under a slow service: what the compound alert is for
P99_QUERY = ('histogram_quantile(0.99, sum by (le, service_name) '
             '(rate(traces_span_metrics_duration_milliseconds_bucket[1m])))')
PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
                "group_right", "inf", "nan"}


def _promtool(*args: str, cwd: Path | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, cwd=cwd, input=stdin,
                          timeout=120)


def test_promtool_accepts_the_rule_file():
    result = _promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 13 rules found" in result.stdout


def test_promtool_accepts_the_example_scrape_config():
    result = _promtool("check", "config", "prometheus.yml", cwd=DEPLOY / "prometheus")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "is valid prometheus config file syntax" in result.stdout
    assert "SUCCESS: 13 rules found" in result.stdout  # the rule file it names was found and read too


def test_the_rules_fire_when_they_should_and_only_then():
    result = _promtool("test", "rules", "spikehound-rules.test.yml", cwd=DEPLOY / "prometheus")
    assert result.returncode == 0, result.stdout + result.stderr


# --- end to end -------------------------------------------------------------------------------


@dataclass
class Stack:
    collector: CollectorThread
    agent: AgentProcess
    prometheus: PrometheusServer
    durations_ms: list[float]


def _durations_ms() -> list[float]:
    """Log-normal around 120 ms with a 3 % tail of slow requests: the p99 sits in the tail, above 0.5 s."""
    rng = random.Random(20241130)
    return [rng.uniform(600, 1_100) if rng.random() < 0.03 else rng.lognormvariate(math.log(120), 0.5)
            for _ in range(SENT)]


def _send(endpoint: str, durations_ms: list[float], start_ns: int) -> None:
    provider = tracer_provider(endpoint, SERVICE, host="sender-reported-name")  # the agent sets host.name
    tracer = provider.get_tracer("e2e")
    for i, ms in enumerate(durations_ms):
        timed_span(tracer, "POST /v1/generate", start_ns + i * MS, round(ms * MS), kind=trace.SpanKind.SERVER,
                   error=i % 50 == 49)
    provider.shutdown()


def _open_spike(db_url: str) -> None:
    """The detection engine is built elsewhere; its output is a row in ``spikes``, written as it would."""
    start = time.time_ns() - 120 * 1_000_000_000
    engine = make_engine(db_url)
    try:
        Writer(engine).write(WriteBatch(spikes=[Spike(
            id="e2e-spike", service=SERVICE, operation="POST /v1/generate", state="open", start_unix_nano=start,
            end_unix_nano=None, p99_ns=950 * MS, baseline_p99_ns=300 * MS,
            causes=(Cause(kind=CauseKind.RESOURCE, score=0.7, summary="GPU utilization fell to 12 %", host=HOST,
                          resource="hw.gpu.utilization"),))]))
    finally:
        engine.dispose()


def _send_invalid_span(http_endpoint: str) -> None:
    now = time.time_ns()
    body = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "bad"}}]},
                               "scopeSpans": [{"spans": [{"traceId": "0" * 32, "spanId": "00000000000000aa",
                                                          "name": "GET /", "startTimeUnixNano": str(now - MS),
                                                          "endTimeUnixNano": str(now)}]}]}]}
    r = requests.post(f"{http_endpoint}/v1/traces", data=json.dumps(body),
                      headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 400, r.text  # the trace id is all zeroes: rejected and counted


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tool("prometheus")
    tmp = tmp_path_factory.mktemp("e2e")
    db_url = f"sqlite:///{tmp / 'collector.db'}"
    with CollectorThread(collector_config(db_url)) as collector:
        # Loopback is the one interface every machine has: the network panel has something to show anywhere.
        agent = AgentProcess(collector.grpc_endpoint, tmp, interval=1.0,
                             env={"SPIKEHOUND_AGENT_HOST_NAME": HOST, "SPIKEHOUND_AGENT_INTERFACES": "lo"}).start()
        samples = sample_provider(agent.grpc_endpoint, HOST, {"hw.gpu.utilization": (
            "1", lambda: [(GPU_UTILIZATION, {"hw.id": "GPU-e2e-0", "gpu.index": 0})])})
        prometheus = PrometheusServer({"spikehound-collector": [collector.api.removeprefix("http://")],
                                       "spikehound-agent": [agent.metrics_url.removeprefix("http://")]},
                                      [RULES]).start()
        try:
            _open_spike(db_url)
            _send_invalid_span(collector.http_endpoint)  # for the dashboard's "rejected" series
            # Prometheus must see the series before the measured spans arrive: rate() needs a sample before them.
            start = time.time_ns() - 30 * 1_000_000_000
            _send(agent.grpc_endpoint, [100.0], start)
            prometheus.wait_for(f'sum(traces_span_metrics_calls_total{{service_name="{SERVICE}"}})')
            durations = _durations_ms()
            _send(agent.grpc_endpoint, durations, start + 1_000 * MS)
            prometheus.wait_for(f'sum(traces_span_metrics_calls_total{{service_name="{SERVICE}"}})',
                                lambda v: v == SENT + 1)
            prometheus.wait_for(f'count(gpu_utilization_percentage{{host="{HOST}"}})')
            prometheus.wait_for(f'count(cpu_load_average{{host="{HOST}"}})')
            # Two more scrapes of every series, counted in Prometheus (not a pause a loaded host might not fill):
            # the last increase is inside every rate() window.
            counted = f'min(count_over_time(traces_span_metrics_calls_total{{service_name="{SERVICE}"}}[1h]))'
            scraped = prometheus.value(counted)
            prometheus.wait_for(counted, lambda v: v >= scraped + 2)
            yield Stack(collector, agent, prometheus, durations)
        finally:
            prometheus.stop()
            samples.shutdown()
            agent.terminate()


def _bucket(ms: float) -> int:
    return bisect_left(DURATION_BUCKETS_MS, ms)


def test_histogram_quantile_over_span_metrics_is_within_one_bucket_of_the_true_p99(stack):
    true_p99 = nearest_rank(sorted(stack.durations_ms), 0.99)
    result = {r["metric"].get("service_name"): float(r["value"][1]) for r in stack.prometheus.query(P99_QUERY)}
    assert SERVICE in result, result
    estimate = result[SERVICE]
    assert abs(_bucket(estimate) - _bucket(true_p99)) <= 1, (estimate, true_p99)
    assert true_p99 > 500  # what the compound alert's 0.5 s threshold needs


def test_every_rule_evaluates_and_the_p99_high_gpu_low_alert_is_raised(stack):
    prometheus = stack.prometheus
    alerts = eventually(lambda: [a for a in prometheus.api("alerts")["alerts"]
                                 if a["labels"]["alertname"] == "SpikehoundP99HighGpuLow"],
                        "Prometheus to raise SpikehoundP99HighGpuLow", every=0.5)
    assert [(a["labels"]["service"], a["labels"]["host"]) for a in alerts] == [(SERVICE, HOST)], alerts
    assert alerts[0]["state"] in ("pending", "firing")  # pending: the rule waits 2 minutes before it fires
    assert float(alerts[0]["value"]) > 0.5

    rules = [rule for group in prometheus.api("rules")["groups"] for rule in group["rules"]]
    assert len(rules) == 13
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []


def _fill(expr: str, service: str, host: str) -> str:
    return (expr.replace("$__rate_interval", "1m").replace("$__interval", "15s").replace("$__range", "5m")
            .replace("$service", service).replace("$host", host))


def metric_names(expr: str) -> set[str]:
    """Names of the series a PromQL expression selects (not its functions, labels or keywords).

    >>> sorted(metric_names('sum by (le) (rate(a_bucket{job="x"}[5m])) / on (le) b_total > bool 2'))
    ['a_bucket', 'b_total']
    """
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for word in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        if word.group() not in PROMQL_WORDS and not expr[word.end():].lstrip().startswith("("):
            names.add(word.group())
    return names


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _exported(*urls: str) -> set[str]:
    """Every series name the daemons' /metrics declare (a labelled counter is declared before it counts)."""
    names = set()
    for url in urls:
        for family in text_string_to_metric_families(scrape_text(url)):
            names |= {s.name for s in family.samples}
            names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ())}
    return names


def _panels() -> list[dict]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_the_dashboard_puts_the_seed_panels_on_one_time_axis_with_a_prometheus_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert dashboard["graphTooltip"] == 1  # shared crosshair: one time axis across the panels
    titles = [p["title"] for p in _panels()]
    for wanted in ("Latency p50 / p95 / p99 by service", "Request rate by service", "GPU utilization",
                   "CPU load (1 min)", "Network I/O", "Open spikes"):
        assert wanted in titles
    for panel in _panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["type"] == "timeseries" and panel["targets"], panel["title"]


def test_every_dashboard_query_evaluates_and_uses_only_exported_metrics(stack):
    prometheus = stack.prometheus
    exported = _exported(stack.collector.api, stack.agent.metrics_url)
    for panel in _panels():
        for target in panel["targets"]:
            expr = target["expr"]
            missing = metric_names(expr) - exported
            assert not missing, f"{panel['title']}: {missing} not exported by spikehound"
            prometheus.query(_fill(expr, ".*", ".*"))  # "All": evaluates without error
            result = prometheus.query(_fill(expr, SERVICE, HOST))
            if "spikehound_ingest_dropped_total" not in expr:  # only a full queue drops: nothing to show here
                assert result, f"{panel['title']}: {expr} returned no series"

    for variable in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        if variable["type"] != "query":
            continue
        metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["query"]["query"]).groups()
        assert metric in exported
        values = prometheus.api(f"label/{label}/values", **{"match[]": metric})
        assert (SERVICE if label == "service" else HOST) in values, (variable["name"], values)


def test_the_collector_metrics_pass_promtool_lint_but_for_the_connector_unit(stack):
    text = requests.get(f"{stack.collector.api}/metrics", timeout=10).text
    result = _promtool("check", "metrics", stdin=text)
    problems = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    # The spanmetrics connector's name says milliseconds; Jaeger's Monitor tab and dashboards need it so.
    assert problems == ['traces_span_metrics_duration_milliseconds use base unit "seconds" instead of '
                        '"milliseconds"'], problems
