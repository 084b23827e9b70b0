"""``spikehound demo``: start everything, drive load, inject the faults one after another, judge the answers.

The timeline is a warm-up (the detectors learn normal traffic), then for each
fault a period with the fault on and a period to recover. While it runs the
demo prints progress, the alerts that reach its webhook receiver, and the
spikes as the REST API reports them. At the end it matches each fault to the
spike that opened while it was on (on the gateway's entry point, what users
see) and judges that spike's top cause.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from spikehound.config import HostPort
from spikehound.demo import feature_store
from spikehound.demo.alerts import WebhookReceiver, describe
from spikehound.demo.faults import FAULTS, Fault, component_of
from spikehound.demo.load import OpenLoopLoad
from spikehound.demo.processes import (
    DEMO_SETTINGS,
    PROFILE_RATE_HZ,
    PROFILE_WINDOW_S,
    Stack,
    StartError,
    free_port,
    http_json,
)
from spikehound.model import Cause, CauseKind
from spikehound.model_json import cause_from_json

ENTRY = ("gateway", "POST /v1/predict")
WINDOW_S = float(DEMO_SETTINGS["collector.window_seconds"])
# The answer for a fault's time is the API's once the fault's last window closed and was judged.
ANSWER_DELAY_S = WINDOW_S + float(DEMO_SETTINGS["collector.allowed_lateness_seconds"]) + 2
RECOVERY_GRACE_S = 45.0  # longest wait, after a recovery period, for its spikes to resolve (busy hosts are slower)


@dataclass
class Injection:
    fault: Fault
    on: float  # wall-clock seconds
    off: float | None = None


@dataclass
class Finding:
    injection: Injection
    spike: dict[str, Any] | None
    found_after_s: float | None

    @property
    def top(self) -> Cause | None:
        causes = self.causes
        return causes[0] if causes else None

    @property
    def causes(self) -> tuple[Cause, ...]:
        return causes_of(self.spike) if self.spike else ()

    @property
    def ok(self) -> bool:
        return self.injection.fault.named_by(self.causes)

    @property
    def verdict(self) -> str:
        """yes, or NO with the rank of the first cause that does name the fault."""
        if self.ok:
            return "yes"
        rank = next((n for n, c in enumerate(self.causes, 1) if self.injection.fault.matches(c)), None)
        return f"NO (it is cause #{rank})" if rank else "NO"


@dataclass
class SpikeWatch:
    """Polls ``GET /api/v1/spikes`` and reports what changed since the last poll."""

    api: str
    since: float
    spikes: dict[str, dict[str, Any]] = field(default_factory=dict)  # latest state
    first_seen: dict[str, float] = field(default_factory=dict)
    history: dict[str, list[tuple[float, dict[str, Any]]]] = field(default_factory=dict)  # (seen at, state)

    def all_resolved(self) -> bool:
        return all(s["state"] != "open" for s in self.spikes.values())

    def poll(self) -> list[tuple[str, dict[str, Any]]]:
        query = urllib.parse.urlencode({"since": f"{self.since:.3f}"})
        body = http_json(f"{self.api}/api/v1/spikes?{query}")
        events = []
        for spike in reversed(body["spikes"]):  # oldest first
            old = self.spikes.get(spike["id"])
            if old is None:
                self.first_seen[spike["id"]] = time.time()
                events.append(("opened", spike))
            elif old["state"] != spike["state"]:
                events.append((spike["state"], spike))
            elif _cause_key(old) != _cause_key(spike):
                events.append(("explained", spike))
            self.spikes[spike["id"]] = spike
            if old != spike:
                self.history.setdefault(spike["id"], []).append((time.time(), spike))
        return events

    def as_of(self, spike_id: str, when: float) -> dict[str, Any]:
        """The spike as the API reported it at ``when`` (its first report, if that came later)."""
        states = self.history[spike_id]
        return next((s for t, s in reversed(states) if t <= when), states[0][1])


def _cause_key(spike: dict[str, Any]) -> tuple[Any, ...]:
    c = spike["causes"][0] if spike["causes"] else {}
    return c.get("kind"), c.get("service"), c.get("operation"), c.get("peer_service"), c.get("resource")


def causes_of(spike: dict[str, Any]) -> tuple[Cause, ...]:
    """The ranked causes of a spike as the API reported it."""
    return tuple(cause_from_json(c) for c in spike["causes"])


def short_cause(causes: Sequence[Cause]) -> str:
    """The top cause in a few words; a resource cause with the component it explains."""
    if not causes:
        return "-"
    cause = causes[0]
    kind = cause.kind
    if kind == CauseKind.RESOURCE:
        explained = component_of(causes)
        tail = f", at {short_cause([explained])}" if explained else f" ({cause.score:.0%})"
        return f"[resource] {cause.resource} on {cause.host}{tail}"
    if kind == CauseKind.NETWORK:
        what = f"hop {cause.peer_service or 'an untraced caller'} -> {cause.service}"
    elif kind == CauseKind.SERVICE:
        what = f"service {cause.service}"
    else:
        what = f"{cause.operation} of {cause.service}"
    return f"[{kind.value}] {what} ({cause.score:.0%})"


class Console:
    """Lines stamped with the time since the demo started, flushed at once (the test reads them live)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.t0 = time.monotonic()

    def stamp(self) -> str:
        seconds = int(time.monotonic() - self.t0)
        return f"{seconds // 60}:{seconds % 60:02d}"

    def say(self, text: str = "", stamped: bool = True) -> None:
        print(f"[{self.stamp()}] {text}" if stamped else text, file=self.out, flush=True)


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def run_demo(rate: float = 20.0, warmup: float = 40.0, fault_seconds: float = 15.0, recover_seconds: float = 10.0,
             faults: Sequence[str] = tuple(FAULTS), api: HostPort | None = None, keep: bool = False,
             out: TextIO = sys.stdout) -> int:
    """Run the demo; 0 when every fault was found and its top cause names it, 1 when not, 2 when it could not run."""
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        print(f"spikehound demo: unknown fault {', '.join(unknown)} (choose from {', '.join(FAULTS)})", file=sys.stderr)
        return 2
    api_port = free_port(api.port if api else 8470)
    if api is not None and api.port not in (0, api_port):
        print(f"spikehound demo: --api {api}: the port is in use", file=sys.stderr)
        return 2
    # Ctrl-C and SIGTERM stop the demo cleanly, even where SIGINT came ignored (a shell's background job).
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    con = Console(out)
    workdir = Path(tempfile.mkdtemp(prefix="spikehound-demo-"))
    receiver = WebhookReceiver().start()
    stack = Stack(workdir, HostPort(api.host if api else "127.0.0.1", api_port), receiver.url)
    chosen = [FAULTS[f] for f in faults]
    _print_plan(con, stack, receiver, rate, warmup, fault_seconds, recover_seconds, chosen, api is not None)
    status = 2
    load: OpenLoopLoad | None = None
    try:
        stack.start()
        con.say("collector, agent, gateway, preprocess, model-server and delay proxy are up; load starts")
        load = OpenLoopLoad(*stack.gateway, "/v1/predict", rate,
                            body=lambda i: {"user": feature_store.entity_id(i * 7919 % feature_store.ROWS)})
        load.start()
        watch = SpikeWatch(stack.api, since=time.time() - 60)
        injections: list[Injection] = []
        # A fault goes into a calm stack only: a spike the host's own load opened in the warm-up (a noisy
        # neighbour, a busy machine) must end first, or the first fault would be folded into it.
        _run_phase(con, stack, receiver, watch, load, warmup, "warm-up: learning normal traffic",
                   until=watch.all_resolved, max_extra=RECOVERY_GRACE_S)
        for n, fault in enumerate(chosen, 1):
            stack.set_fault(fault, True)
            injection = Injection(fault, on=time.time())
            injections.append(injection)
            con.say(f"fault {n}/{len(chosen)} ON: {fault.title}: {fault.injected}")
            _run_phase(con, stack, receiver, watch, load, fault_seconds, f"fault {n}/{len(chosen)} {fault.key}")
            stack.set_fault(fault, False)
            injection.off = time.time()
            con.say(f"fault {n}/{len(chosen)} OFF")
            # Recovered means its spikes resolved: a spike still open would swallow the next fault.
            _run_phase(con, stack, receiver, watch, load, recover_seconds, f"recovery after {fault.key}",
                       until=watch.all_resolved, max_extra=RECOVERY_GRACE_S)
        load.stop()
        load = None
        findings = _match(watch, injections)
        status = _report(con, stack, findings, keep)
        if keep:
            stack.stop(keep_collector=True)
            con.say(f"collector keeps running at {stack.api} (Ctrl-C to stop)")
            with contextlib.suppress(KeyboardInterrupt):
                assert stack.collector.proc is not None
                stack.collector.proc.wait()
    except StartError as exc:
        con.say(f"FAILED: {exc}")
    except urllib.error.URLError as exc:  # the collector's API or a fault switch
        con.say(f"FAILED: a demo process did not answer: {exc.reason}")
    except KeyboardInterrupt:
        con.say("interrupted")
        status = 130 if status == 2 else status
    finally:
        if load is not None:
            load.stop()
        stack.stop()
        receiver.stop()
        if status == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            con.say(f"logs and databases kept in {workdir}")
    con.say(f"finished in {con.stamp()} (exit status {status})")
    return status


def _print_plan(con: Console, stack: Stack, receiver: WebhookReceiver, rate: float, warmup: float,
                fault_seconds: float, recover_seconds: float, chosen: Sequence[Fault], api_chosen: bool) -> None:
    p = stack.ports
    moved = "" if stack.api.endswith(":8470") or api_chosen else " (8470 was in use)"
    total = warmup + len(chosen) * (fault_seconds + recover_seconds)
    con.say(f"spikehound demo: {len(chosen)} real faults injected into an instrumented inference stack "
            f"(about {total / 60:.1f} minutes of load)")
    rows = [
        ("working dir", f"{stack.workdir} (logs, SQLite databases)"),
        ("collector", f"API {stack.api}{moved}, OTLP gRPC 127.0.0.1:{p['grpc']}, "
                      f"SQLite {stack.workdir / 'spikehound.db'}"),
        ("agent", f"OTLP 127.0.0.1:{p['agent_grpc']} (gRPC) and :{p['agent_http']} (HTTP), "
                  f"host {socket.gethostname()}"),
        ("stack", f"gateway :{p['gateway']} -> preprocess :{p['preprocess']} (feature store: SQLite) -> "
                  f"delay proxy :{p['proxy']} -> model-server :{p['model']} (GPU: SIMULATED, no GPU is used)"),
        ("load", f"{rate:g} requests/s, open loop: constant arrival rate, latency counted from when each was due"),
        ("detection", "SHORT demo windows: 5 s windows, 6 warm-up windows, 2 s lateness, 1 calm window resolves, "
                      "min_score 12 (production defaults: 10 s, 12, 5 s, 2, 6)"),
        ("profiles", f"the agent samples the three services' stacks with py-spy, diffed at each spike "
                     f"({PROFILE_RATE_HZ} Hz, {PROFILE_WINDOW_S} s windows; production defaults: 19 Hz, 10 s)"),
        ("alerts", f"every spike is routed to the webhook receiver {receiver.url} (Alertmanager payload)"),
        ("plan", f"warm-up {warmup:g} s, then each fault for {fault_seconds:g} s with {recover_seconds:g} s to "
                 f"recover: {', '.join(f.key for f in chosen)}"),
    ]
    for name, text in rows:
        con.say(f"  {name:<11} {text}", stamped=False)


def _run_phase(con: Console, stack: Stack, receiver: WebhookReceiver, watch: SpikeWatch, load: OpenLoopLoad,
               seconds: float, label: str, until: Callable[[], bool] | None = None, max_extra: float = 0.0) -> None:
    """Run for ``seconds``, then on while ``until()`` is false, ``max_extra`` seconds at most."""
    start = time.monotonic()
    next_progress = start + 5
    next_poll = start
    while (now := time.monotonic()) < start + seconds or (
            until is not None and now < start + seconds + max_extra and not until()):
        dead = stack.dead()
        if dead:
            raise StartError(f"{dead[0].name} died:\n{dead[0].log_tail()}")
        for body in receiver.drain():
            for n, line in enumerate(describe(body)):
                con.say(("ALERT " if n == 0 else "      ") + line)
        if now >= next_poll:
            next_poll = now + 1
            for event, spike in watch.poll():
                _print_spike_event(con, event, spike)
        if now >= next_progress:
            next_progress += 5
            s = load.stats(5)
            extra = " waiting for the spikes to resolve" if now > start + seconds else ""
            con.say(f"{label} ({now - start:.0f}/{seconds:g} s{extra}) | {s.completed / 5:.0f} req/s, client p50 "
                    f"{s.p50_ms:.0f} ms, p99 {s.p99_ms:.0f} ms, {s.errors} errors")
        time.sleep(0.25)


def _print_spike_event(con: Console, event: str, spike: dict[str, Any]) -> None:
    where = f"{spike['service']} {spike['operation']}"
    if event == "resolved":
        con.say(f"spike resolved  {where} ({spike['id']})")
        return
    con.say(f"spike {event:<8} {where}: p99 {spike['p99_ms']:.0f} ms against {spike['baseline_p99_ms']:.0f} ms; "
            f"top cause {short_cause(causes_of(spike))}")


def _match(watch: SpikeWatch, injections: Sequence[Injection]) -> list[Finding]:
    # One last read: causes are refined while a spike lasts.
    with contextlib.suppress(OSError):
        watch.poll()
    findings = []
    for inj in injections:
        end = inj.off if inj.off is not None else time.time()
        candidates = [s for s in watch.spikes.values()
                      if inj.on - WINDOW_S <= _unix(s["start"]) <= end]
        candidates.sort(key=lambda s: ((s["service"], s["operation"]) != ENTRY, s["start"]))
        spike = candidates[0] if candidates else None
        found = watch.first_seen[spike["id"]] - inj.on if spike else None
        if spike is not None:  # judged as explained for the fault's time: once its last window was judged
            spike = watch.as_of(spike["id"], end + ANSWER_DELAY_S)
        findings.append(Finding(inj, spike, found))
    return findings


def _unix(rfc3339: str) -> float:
    from spikehound.timefmt import parse_time

    return parse_time(rfc3339) / 1e9


def _report(con: Console, stack: Stack, findings: Sequence[Finding], keep: bool = False) -> int:
    header = ("FAULT", "INJECTED", "FOUND AFTER", "SPIKE ON", "P99 / BASELINE", "TOP CAUSE", "MATCH")
    rows = []
    for f in findings:
        inj = f.injection
        at = inj.on - (time.time() - (time.monotonic() - con.t0))
        s = f.spike
        rows.append((inj.fault.title, f"{int(at) // 60}:{int(at) % 60:02d}",
                     f"{f.found_after_s:.0f} s" if f.found_after_s is not None else "NOT FOUND",
                     f"{s['service']} {s['operation']}" if s else "-",
                     f"{s['p99_ms']:.0f} / {s['baseline_p99_ms']:.0f} ms" if s else "-",
                     short_cause(f.causes), f.verdict))
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    con.say("", stamped=False)
    for row in (header, *rows):
        con.say("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip(), stamped=False)
    con.say("", stamped=False)
    for f in findings:
        fault = f.injection.fault
        con.say(f"{fault.title}: expected {fault.expected}", stamped=False)
        if f.top is not None:
            con.say(f"  top cause: {f.top.summary}", stamped=False)
            explained = component_of(f.causes)
            if f.top.kind == CauseKind.RESOURCE and explained is not None:
                con.say(f"  ... at:    {explained.summary}", stamped=False)
        if f.spike is not None:
            profile = profile_line(stack.api, f.spike["id"])
            if profile:
                con.say(f"  profile:   {profile}", stamped=False)
            con.say(f"  evidence:  {stack.api}/ui/spikes/{f.spike['id']}   (JSON: /api/v1/spikes/{f.spike['id']})",
                    stamped=False)
    good = sum(f.ok for f in findings)
    con.say("", stamped=False)
    verdict = "OK" if good == len(findings) else "FAIL"
    simulated = " (GPU: a SIMULATED device)" if any(f.injection.fault.simulated for f in findings) else ""
    con.say(f"{verdict}: {good} of {len(findings)} faults found and explained by their top cause{simulated}",
            stamped=False)
    if keep:
        con.say(f"API  {stack.api}/api/v1/spikes   (also: spikehound spikes --api-url {stack.api})", stamped=False)
        con.say(f"web  {stack.api}/", stamped=False)
    else:
        con.say("the collector stops with the demo: `spikehound demo --keep` keeps its API, web pages and "
                "databases up to look around", stamped=False)
    return 0 if verdict == "OK" else 1


def profile_line(api: str, spike_id: str) -> str | None:
    """What the spike's profile diff says (docs/profile-diff.md): its culprit when one is clear, else the top
    change of the top cause's process and why it is no culprit; None without profiles."""
    try:
        answer = http_json(f"{api}/api/v1/spikes/{spike_id}/profile?limit=1")
    except (OSError, ValueError):
        return None
    if answer.get("culprit"):
        return f"{_with_rate(answer['culprit'])} (the culprit)"
    for group in answer.get("profiles", ()):
        if group["changes"]:
            return f"{_with_rate(group['changes'][0])} (no clear culprit: {group['why_unclear']})"
    return None


def _with_rate(change: dict[str, Any]) -> str:
    before, during = change.get("self_rate_baseline") or 0, change.get("self_rate_spike") or 0
    if before and during >= 2 * before:
        return f"{change['sentence']}, {during / before:.1f}x its samples a second"
    return str(change["sentence"])
