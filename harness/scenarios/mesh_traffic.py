"""Sparse, lumpy microservice traffic with injected faults: the shape real systems have.

The scenario suite's first family (:mod:`harness.scenarios.traffic`) is dense and
smooth: 20 requests a second through four services, every fault moving the
entry stream. Recorded traffic of a real microservice benchmark looks nothing
like that, and this generator builds timelines of *its* shape:

- **One gateway, many services.** About 40 services (a train-ticket booking
  system: search, booking, orders, payment, food, consignment, ...) behind one
  gateway whose entry operation has a generic name (``HTTP POST`` or ``/*``),
  fanning out through synchronous calls. Every call is a CLIENT span on the
  caller (generic name, ``server.address`` attribute) and a SERVER span on the
  callee named by its route template; database calls are CLIENT spans with no
  server behind them. Some timelines carry ``http.route`` on the gateway's
  span, others do not (the stream must then be split by where requests go).
- **Sparse and lumpy.** About 45 user requests a minute. Searches loop over a
  varying number of trips, so one route is slow by nature and the per-minute
  root p99 swings between about 0.5 and 1.4 s on calm traffic; many services
  see two to six calls a minute. Exporters deliver spans up to 5 s after they
  end (the SDK's batch schedule), and host clocks are a few milliseconds apart.
- **Calm is not clean.** Lone multi-second stalls (about one request in 400,
  somewhere in its tree), a service pausing for a second or three now and then
  (every request inside it waits), and in some timelines the load dropping
  tenfold for an hour and a half (a workload change, not a fault).
- **Faults** of about 3.5 minutes with clean traffic before and after:
  ``delay`` (+1 to +2 s on every call into one service: only its callers'
  CLIENT spans grow), ``netem`` (the same delay on the service's own network
  interface: calls into it and its own outgoing calls, database included, all
  slower) and ``cpu`` (CPU contention on the service: 200 to 700 ms more on
  each of its spans, and its host's CPU busy, where the timeline sends host
  metrics).

Everything is drawn from one seeded generator, so a timeline is the same
every time; nothing here was fitted to a recording.

>>> fault = MeshFault("delay", "ts-order-service", onset_s=600.0, duration_s=210.0, size_ms=1500.0)
>>> tl = MeshTimeline(seed=3, hours=0.25, faults=[fault])
>>> spans = sum(len(b.spans) for b in tl.batches())
>>> spans > 10_000, 500 < tl.requests < 1000, MeshTimeline.fault_slots(3.0)
(True, True, 7)
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from harness.scenarios.traffic import Batch, poisson
from spikehound.model import MetricKind, MetricPoint, Span, SpanKind, StatusCode
from spikehound.units import MS, NS

__all__ = ["FAULT_KINDS", "GATEWAY", "NODES", "MeshFault", "MeshTimeline", "reach"]

GATEWAY = "ts-gateway-service"
FAULT_KINDS = ("delay", "netem", "cpu")

# op key -> (service, route template, self time median ms, sigma, calls). A call is (op key, repeats) where
# repeats is a fixed count or (lo, hi) drawn per request; "db:<statement>" is a database call.
Call = tuple[str, int | tuple[int, int]]
_OPS: dict[str, tuple[str, str, float, float, tuple[Call, ...]]] = {
    "auth.login": ("ts-auth-service", "POST /api/v1/users/login", 25, 0.4,
                   (("verify.check", 1), ("user.get", 1), ("db:find ts.auth_user", 1))),
    "verify.check": ("ts-verification-code-service", "GET /api/v1/verifycode/verify/{code}", 3, 0.3, ()),
    "verify.generate": ("ts-verification-code-service", "GET /api/v1/verifycode/generate", 12, 0.4, ()),
    "user.get": ("ts-user-service", "GET /api/v1/userservice/users/id/{userId}", 4, 0.3,
                 (("db:SELECT ts.user", 1),)),
    "station.id": ("ts-station-service", "GET /api/v1/stationservice/stations/id/{stationNameForId}", 2, 0.3,
                   (("db:SELECT ts.station", 1),)),
    "station.list": ("ts-station-service", "GET /api/v1/stationservice/stations", 8, 0.4,
                     (("db:SELECT ts.station", 1),)),
    "train.get": ("ts-train-service", "GET /api/v1/trainservice/trains/{id}", 2, 0.3, (("db:SELECT ts.train", 1),)),
    "route.get": ("ts-route-service", "GET /api/v1/routeservice/routes/{routeId}", 3, 0.3,
                  (("db:find ts.route", 1),)),
    "price.get": ("ts-price-service", "GET /api/v1/priceservice/prices/{routeId}/{trainType}", 2, 0.3,
                  (("db:SELECT ts.price_config", 1),)),
    "config.get": ("ts-config-service", "GET /api/v1/configservice/configs/{configName}", 2, 0.3,
                   (("db:SELECT ts.config", 1),)),
    "basic.travel": ("ts-basic-service", "POST /api/v1/basicservice/basic/travel", 4, 0.3,
                     (("station.id", 2), ("train.get", 1), ("route.get", 1), ("price.get", 1))),
    "ticketinfo.query": ("ts-ticketinfo-service", "POST /api/v1/ticketinfoservice/ticketinfo", 2, 0.3,
                         (("basic.travel", 1),)),
    "order.sold": ("ts-order-service", "POST /api/v1/orderservice/order/tickets", 5, 0.4,
                   (("db:SELECT ts.orders", 1),)),
    "order.refresh": ("ts-order-service", "POST /api/v1/orderservice/order/refresh", 14, 0.5,
                      (("db:SELECT ts.orders", 1), ("station.id", (1, 3)))),
    "order.get": ("ts-order-service", "GET /api/v1/orderservice/order/{orderId}", 4, 0.3,
                  (("db:SELECT ts.orders", 1),)),
    "order.create": ("ts-order-service", "POST /api/v1/orderservice/order", 9, 0.4, (("db:INSERT ts.orders", 1),)),
    "order.modify": ("ts-order-service", "GET /api/v1/orderservice/order/status/{orderId}/{status}", 6, 0.3,
                     (("db:UPDATE ts.orders", 1),)),
    "other.sold": ("ts-order-other-service", "POST /api/v1/orderOtherService/orderOther/tickets", 5, 0.4,
                   (("db:SELECT ts.orders_other", 1),)),
    "other.refresh": ("ts-order-other-service", "POST /api/v1/orderOtherService/orderOther/refresh", 14, 0.5,
                      (("db:SELECT ts.orders_other", 1), ("station.id", (1, 3)))),
    "seat.left": ("ts-seat-service", "POST /api/v1/seatservice/seats/left_tickets", 5, 0.4,
                  (("order.sold", 1), ("config.get", 1))),
    "seat.left2": ("ts-seat-service", "POST /api/v1/seatservice/seats/left_tickets", 5, 0.4,
                   (("other.sold", 1), ("config.get", 1))),
    "seat.assign": ("ts-seat-service", "POST /api/v1/seatservice/seats", 6, 0.4,
                    (("order.sold", 1), ("config.get", 1))),
    "travel.left": ("ts-travel-service", "POST /api/v1/travelservice/trips/left", 12, 0.4,
                    (("db:SELECT ts.trip", 1), ("ticketinfo.query", (1, 5)), ("seat.left", (1, 5)))),
    "travel.detail": ("ts-travel-service", "POST /api/v1/travelservice/trip_detail", 6, 0.3,
                      (("db:SELECT ts.trip", 1), ("ticketinfo.query", 1), ("seat.left", 1))),
    "travel.route": ("ts-travel-service", "GET /api/v1/travelservice/routes/{tripId}", 3, 0.3,
                     (("db:SELECT ts.trip", 1), ("route.get", 1))),
    "travel2.left": ("ts-travel2-service", "POST /api/v1/travel2service/trips/left", 12, 0.4,
                     (("db:SELECT ts.trip2", 1), ("ticketinfo.query", (1, 5)), ("seat.left2", (1, 5)))),
    "contacts.list": ("ts-contacts-service", "GET /api/v1/contactservice/contacts/account/{accountId}", 6, 0.4,
                      (("db:find ts.contacts", 1),)),
    "contacts.get": ("ts-contacts-service", "GET /api/v1/contactservice/contacts/{id}", 3, 0.3,
                     (("db:find ts.contacts", 1),)),
    "assurance.types": ("ts-assurance-service", "GET /api/v1/assuranceservice/assurances/types", 3, 0.3, ()),
    "assurance.create": ("ts-assurance-service", "GET /api/v1/assuranceservice/assurances/{typeIndex}/{orderId}",
                         5, 0.3, (("db:INSERT ts.assurance", 1),)),
    "foodmap.train": ("ts-food-map-service", "GET /api/v1/foodmapservice/trainfoods/{tripId}", 4, 0.4,
                      (("db:find ts.train_food", 1),)),
    "foodmap.store": ("ts-food-map-service", "POST /api/v1/foodmapservice/foodstores", 6, 0.4,
                      (("db:find ts.food_store", 1),)),
    "food.list": ("ts-food-service", "GET /api/v1/foodservice/foods/{date}/{startStation}/{endStation}/{tripId}",
                  10, 0.4, (("foodmap.train", 1), ("travel.route", 1), ("station.id", 2), ("foodmap.store", 1))),
    "food.order": ("ts-food-service", "POST /api/v1/foodservice/orders", 5, 0.3, (("db:INSERT ts.food_order", 1),)),
    "consignprice.get": ("ts-consign-price-service",
                         "GET /api/v1/consignpriceservice/consignprice/{weight}/{isWithinRegion}", 2, 0.3,
                         (("db:SELECT ts.consign_price", 1),)),
    "consign.create": ("ts-consign-service", "PUT /api/v1/consignservice/consigns", 8, 0.4,
                       (("consignprice.get", 1), ("db:INSERT ts.consign", 1))),
    "consign.list": ("ts-consign-service", "GET /api/v1/consignservice/consigns/account/{id}", 5, 0.4,
                     (("db:find ts.consign", 1),)),
    "security.check": ("ts-security-service", "GET /api/v1/securityservice/securityConfigs/{accountId}", 4, 0.3,
                       (("db:SELECT ts.security_config", 1), ("order.get", 1), ("other.sold", 1))),
    "notify.send": ("ts-notification-service", "POST /api/v1/notifyservice/notification/preserve_success", 12, 0.5,
                    ()),
    "notify.cancel": ("ts-notification-service", "POST /api/v1/notifyservice/notification/order_cancel_success",
                      12, 0.5, ()),
    "preserve.book": ("ts-preserve-service", "POST /api/v1/preserveservice/preserve", 15, 0.4,
                      (("security.check", 1), ("contacts.get", 1), ("travel.detail", 1), ("station.id", 2),
                       ("seat.assign", 1), ("order.create", 1), ("assurance.create", 1), ("food.order", 1),
                       ("consign.create", 1), ("user.get", 1), ("notify.send", 1))),
    "payment.pay": ("ts-payment-service", "POST /api/v1/paymentservice/payment", 6, 0.3,
                    (("db:INSERT ts.payment", 1),)),
    "inside.pay": ("ts-inside-payment-service", "POST /api/v1/inside_pay_service/inside_payment", 8, 0.4,
                   (("order.get", 1), ("payment.pay", 1), ("order.modify", 1), ("db:INSERT ts.inside_payment", 1))),
    "inside.drawback": ("ts-inside-payment-service",
                        "GET /api/v1/inside_pay_service/inside_payment/drawback/{userId}/{money}", 6, 0.3,
                        (("db:UPDATE ts.inside_money", 1),)),
    "cancel.cancel": ("ts-cancel-service", "GET /api/v1/cancelservice/cancel/{orderId}/{loginId}", 10, 0.4,
                      (("order.get", 1), ("order.modify", 1), ("inside.drawback", 1), ("user.get", 1),
                       ("notify.cancel", 1))),
    "cancel.refund": ("ts-cancel-service", "GET /api/v1/cancelservice/cancel/refound/{orderId}", 5, 0.3,
                      (("order.get", 1),)),
    "execute.collect": ("ts-execute-service", "GET /api/v1/executeservice/execute/collected/{orderId}", 5, 0.3,
                        (("order.get", 1), ("order.modify", 1))),
    "execute.enter": ("ts-execute-service", "GET /api/v1/executeservice/execute/execute/{orderId}", 5, 0.3,
                      (("order.get", 1), ("order.modify", 1))),
    "rebook.rebook": ("ts-rebook-service", "POST /api/v1/rebookservice/rebook", 14, 0.4,
                      (("order.get", 1), ("travel.detail", 1), ("seat.assign", 1), ("inside.drawback", 1),
                       ("order.modify", 1))),
    "routeplan.cheapest": ("ts-route-plan-service", "POST /api/v1/routeplanservice/routePlan/cheapestRoute", 20, 0.4,
                           (("travel.left", 1), ("travel2.left", 1))),
    "travelplan.quickest": ("ts-travel-plan-service", "POST /api/v1/travelplanservice/travelPlan/quickest", 10, 0.4,
                            (("routeplan.cheapest", 1), ("station.id", 2))),
    "voucher.get": ("ts-voucher-service", "POST /getVoucher", 6, 0.4, (("order.get", 1), ("db:SELECT ts.voucher", 1))),
    "news.list": ("ts-news-service", "GET /news-service/news", 2, 0.3, ()),
    "avatar.get": ("ts-avatar-service", "GET /api/v1/avatar", 30, 0.5, ()),
    "adminbasic.stations": ("ts-admin-basic-info-service", "GET /api/v1/adminbasicservice/adminbasic/stations", 6, 0.4,
                            (("station.list", 1),)),
    "adminorder.orders": ("ts-admin-order-service", "GET /api/v1/adminorderservice/adminorder", 10, 0.4,
                          (("order.refresh", 1), ("other.refresh", 1))),
    "adminroute.routes": ("ts-admin-route-service", "GET /api/v1/adminrouteservice/adminroute", 6, 0.4,
                          (("route.get", 2),)),
    "admintravel.travels": ("ts-admin-travel-service", "GET /api/v1/admintravelservice/admintravel", 8, 0.4,
                            (("travel.route", 2),)),
    "adminuser.users": ("ts-admin-user-service", "GET /api/v1/adminuserservice/users", 6, 0.4, (("user.get", 2),)),
    "waitorder.list": ("ts-wait-order-service", "GET /api/v1/waitorderservice/orders", 5, 0.4,
                       (("db:SELECT ts.wait_list_order", 1),)),
    "delivery.get": ("ts-delivery-service", "GET /api/v1/deliveryservice/deliveries", 4, 0.3,
                     (("db:find ts.delivery", 1),)),
}

# The user requests: (weight, op key the gateway calls). Searches dominate and are slow by nature.
_ROUTES: tuple[tuple[float, str], ...] = (
    (24, "travel.left"), (7, "travel2.left"), (9, "auth.login"), (4, "verify.generate"), (7, "contacts.list"),
    (5, "assurance.types"), (5, "food.list"), (8, "order.refresh"), (4, "other.refresh"), (4, "preserve.book"),
    (3, "inside.pay"), (2, "cancel.cancel"), (1, "cancel.refund"), (2, "execute.collect"), (1, "execute.enter"),
    (1.5, "rebook.rebook"), (2, "consign.list"), (2, "travelplan.quickest"), (1, "voucher.get"), (2, "news.list"),
    (1, "avatar.get"), (0.7, "adminbasic.stations"), (0.7, "adminorder.orders"), (0.5, "adminroute.routes"),
    (0.5, "admintravel.travels"), (0.5, "adminuser.users"), (0.8, "waitorder.list"), (0.8, "delivery.get"),
)
# Java services on busy nodes: the table's self times are scaled by this (it sets the root's p50 near 150 ms).
_SELF_SCALE = 3.0
_SLOT_S = 20 * 60.0  # a fault and the clean traffic after it
NODES = ("k8s-node-1", "k8s-node-2", "k8s-node-3", "k8s-node-4")


def _services() -> list[str]:
    return sorted({GATEWAY} | {spec[0] for spec in _OPS.values()})


def reach() -> dict[str, float]:
    """Per service: the share of user requests that reach it at least once (from the call graph's structure).

    >>> r = reach()
    >>> r["ts-travel-service"] > 0.3, 0.02 < r["ts-food-map-service"] < 0.15
    (True, True)
    """
    total = sum(w for w, _ in _ROUTES)
    out: dict[str, float] = {}
    for weight, op in _ROUTES:
        for service in _reached(op):
            out[service] = out.get(service, 0.0) + weight / total
    return out


def _reached(op: str) -> set[str]:
    service, _, _, _, calls = _OPS[op]
    out = {service}
    for target, _ in calls:
        if not target.startswith("db:"):
            out |= _reached(target)
    return out


@dataclass(frozen=True, slots=True)
class MeshFault:
    """One injected fault: what, where, when (seconds into the timeline) and how much."""

    kind: str  # "delay" | "netem" | "cpu"
    service: str
    onset_s: float
    duration_s: float
    size_ms: float  # the added delay, or the CPU contention's added time per span

    def active(self, t_s: float) -> bool:
        return self.onset_s <= t_s < self.onset_s + self.duration_s


@dataclass(slots=True)
class _Ctx:
    """What one request's spans are being built into."""

    trace: bytes
    t_s: float  # request start, seconds into the timeline
    spans: list[Span] = field(default_factory=list)


class MeshTimeline:
    """Hours of gateway traffic through ~40 services, with calm stalls and injected faults.

    Parameters
    ----------
    seed
        Everything (routes, latencies, stalls, fault targets and times) follows from it.
    hours
        Length of the timeline.
    faults
        How many faults, spread evenly after a 20-minute warm-up, each about 3.5 minutes with at least
        15 minutes of clean traffic after it; or the faults themselves.
    rate_per_min
        Mean user requests a minute (it also wanders by a quarter over the hour).
    load_drop
        (start, end) hours of a tenfold load drop, or None.
    route_attribute
        Whether the gateway's span carries ``http.route`` (else only ``url.path``).
    metrics
        Whether the hosts send CPU samples (the agent's names), so a CPU fault can be seen there too.
    generic_name
        The gateway's entry operation: ``"HTTP"`` for ``HTTP <method>``, or a catch-all such as ``"/*"``.
    stall_rate
        The share of user requests with a lone multi-second stall somewhere in their tree.
    """

    def __init__(self, seed: int, hours: float = 3.0, faults: int | Sequence[MeshFault] = 7,
                 rate_per_min: float = 45.0,
                 load_drop: tuple[float, float] | None = None, route_attribute: bool = False,
                 metrics: bool = True, generic_name: str = "HTTP", stall_rate: float = 1 / 400,
                 start_ns: int = 1_767_225_600 * NS) -> None:
        self.seed = seed
        self.duration_s = hours * 3600
        self.rate_per_min = rate_per_min
        self.load_drop = load_drop
        self.route_attribute = route_attribute
        self.metrics = metrics
        self.generic_name = generic_name
        self.stall_rate = stall_rate
        self.start_ns = start_ns
        self.requests = 0
        self._rng = random.Random(f"mesh/{seed}")
        rng = self._rng
        self.services = _services()
        self._host = {s: rng.choice(NODES) for s in self.services}
        self._skew_ns = {n: int(rng.gauss(0, 3) * MS) for n in NODES}  # host clocks a few ms apart
        self._export_period = {s: rng.uniform(1.0, 5.0) for s in self.services}  # BSP schedule per service
        self.faults = self._plan_faults(faults) if isinstance(faults, int) else sorted(faults, key=lambda f: f.onset_s)
        self._pauses = self._plan_pauses()
        self._next_id = 1

    # -- what happened -------------------------------------------------------

    def _plan_faults(self, n: int) -> list[MeshFault]:
        rng = self._rng
        if n == 0:
            return []
        shares = reach()
        # Any service that at least 4 % of user requests reach: two calls a minute and more, like the sparse
        # services of the recorded benchmark. Rarer ones see a call every few minutes, a handful in the whole
        # fault, which no detector can tell from chance within two minutes.
        targets = [s for s in self.services if s != GATEWAY and shares.get(s, 0.0) >= 0.04]
        # Slots of at least 3.5 + 15 minutes after a 20-minute warm-up, none inside a load drop (at a tenth
        # of the load a service reached by 5 % of requests sees one call in the whole fault).
        starts = self._slots(self.duration_s, self.load_drop)
        if len(starts) < n:
            raise ValueError(f"a {self.duration_s / 3600:.1f} h timeline has room for {len(starts)} faults, not {n}")
        chosen = sorted(rng.sample(starts, n))
        out = []
        for start in chosen:
            onset = start + rng.uniform(0, _SLOT_S - 15 * 60 - 230)
            kind = FAULT_KINDS[rng.randrange(len(FAULT_KINDS))]
            service = rng.choice(targets)
            size = rng.uniform(1000, 2000) if kind != "cpu" else rng.uniform(200, 700)
            out.append(MeshFault(kind, service, onset + rng.random(), rng.uniform(195, 225), size))
        return sorted(out, key=lambda f: f.onset_s)

    @staticmethod
    def _slots(duration_s: float, drop: tuple[float, float] | None) -> list[float]:
        free = [(20 * 60.0, duration_s - 5 * 60)]
        if drop is not None:
            lo, hi = drop[0] * 3600, drop[1] * 3600
            free = [(a, min(b, lo - 5 * 60)) for a, b in free] + [(max(a, hi + 10 * 60), b) for a, b in free]
        return [a + k * _SLOT_S for a, b in free for k in range(max(int((b - a) // _SLOT_S), 0))]

    @classmethod
    def fault_slots(cls, hours: float, drop: tuple[float, float] | None = None) -> int:
        """How many faults fit a timeline of ``hours`` with a load drop over ``drop`` (hours)."""
        return len(cls._slots(hours * 3600, drop))

    def _plan_pauses(self) -> list[tuple[float, float, str]]:
        """(start s, length s, service): a service stops for a second or three (a GC pause), about hourly."""
        rng = self._rng
        out, t = [], 0.0
        while True:
            t += rng.expovariate(1 / 2400)
            if t >= self.duration_s:
                return out
            out.append((t, rng.uniform(1.0, 3.0), rng.choice(self.services)))

    @property
    def pauses(self) -> list[tuple[float, float, str]]:
        """The calm pauses planned: (start s, length s, service)."""
        return list(self._pauses)

    def fault_at(self, t_s: float) -> MeshFault | None:
        return next((f for f in self.faults if f.active(t_s)), None)

    @property
    def end_ns(self) -> int:
        return self.start_ns + int(self.duration_s * NS)

    # -- traffic -------------------------------------------------------------

    def rate(self, t_s: float) -> float:
        """User requests per second at ``t_s``."""
        wave = 1.0 + 0.25 * math.sin(2 * math.pi * t_s / 3600 + self.seed)
        drop = self.load_drop is not None and self.load_drop[0] * 3600 <= t_s < self.load_drop[1] * 3600
        return self.rate_per_min / 60 * wave * (0.1 if drop else 1.0)

    def batches(self) -> Iterator[Batch]:
        """Telemetry second by second, each service's spans delivered on its exporter's schedule."""
        rng = self._rng
        pending: dict[int, Batch] = {}
        for second in range(int(self.duration_s)):
            t0 = self.start_ns + second * NS
            for _ in range(poisson(rng, self.rate(second))):
                ctx = _Ctx(rng.getrandbits(128).to_bytes(16, "big"), second + rng.random())
                self._user_request(ctx)
                self._deliver(ctx.spans, pending, second)
            if self.metrics and second % 5 == 0:
                pending.setdefault(second, Batch(t0)).points.extend(self._samples(second))
            yield pending.pop(second, Batch(t0))
        for second in sorted(pending):
            yield pending.pop(second)

    def _deliver(self, spans: list[Span], pending: dict[int, Batch], second: int) -> None:
        for span in spans:
            period = self._export_period[span.service]
            ended = (span.end_unix_nano - self.start_ns) / NS
            # The batch span processor exports every `period` seconds, on the service's own phase.
            at = max(int(ended + period - (ended % period)), second)
            pending.setdefault(at, Batch(self.start_ns + at * NS)).spans.append(span)

    # -- one request ---------------------------------------------------------

    def _user_request(self, ctx: _Ctx) -> None:
        rng = self._rng
        self.requests += 1
        total = sum(w for w, _ in _ROUTES)
        pick, acc, op = rng.uniform(0, total), 0.0, _ROUTES[0][1]
        for weight, key in _ROUTES:
            acc += weight
            if pick <= acc:
                op = key
                break
        stall_at = rng.randrange(40) if rng.random() < self.stall_rate else None  # a lone stall somewhere in it
        start = self.start_ns + int(ctx.t_s * NS)
        method, template = _OPS[op][1].split(" ", 1)
        name = f"HTTP {method}" if self.generic_name == "HTTP" else self.generic_name
        root = self._span(ctx, None, GATEWAY, name, SpanKind.SERVER, start)
        root.attributes.update({"http.request.method": method, "url.path": _concrete(template, rng)})
        if self.route_attribute:
            root.attributes["http.route"] = template
        t = start + self._ms(1.5, 0.4)
        counter = [0, stall_at]
        t = self._call(ctx, root, GATEWAY, op, t, counter)
        root.end_unix_nano = t + self._ms(1.0, 0.4)
        for span in ctx.spans:  # each host stamps its spans with its own clock
            skew = self._skew_ns[span.host or ""]
            span.start_unix_nano += skew
            span.end_unix_nano += skew

    def _call(self, ctx: _Ctx, parent: Span, caller: str, op: str, t: int, counter: list) -> int:
        """A CLIENT span on ``caller`` and the callee's SERVER span under it; returns the client's end."""
        rng = self._rng
        service, route, self_ms, sigma, calls = _OPS[op]
        self_ms *= _SELF_SCALE
        fault = self.fault_at(ctx.t_s)
        method = route.split(" ", 1)[0]
        client = self._span(ctx, parent, caller, f"HTTP {method}", SpanKind.CLIENT, t)
        client.attributes.update({"server.address": service, "server.port": 8080, "http.request.method": method})
        request_net = self._ms(1.0, 0.5) + self._stall(counter)
        response_net = self._ms(1.0, 0.5) + self._stall(counter)
        if fault is not None and fault.kind in ("delay", "netem") and fault.service == service:
            response_net += int(fault.size_ms * rng.uniform(0.9, 1.1) * MS)  # the reply waits in front of it
        if fault is not None and fault.kind == "netem" and fault.service == caller:
            request_net += int(fault.size_ms * rng.uniform(0.9, 1.1) * MS)  # its own requests leave late
        server = self._span(ctx, client, service, route, SpanKind.SERVER, t + request_net)
        cursor = server.start_unix_nano + self._own(ctx, service, self_ms * 0.4, sigma, server.start_unix_nano, counter)
        for target, repeats in calls:
            n = repeats if isinstance(repeats, int) else rng.randint(*repeats)
            for _ in range(n):
                if target.startswith("db:"):
                    cursor = self._db(ctx, server, service, target[3:], cursor, counter) + self._ms(0.1, 0.3)
                else:
                    cursor = self._call(ctx, server, service, target, cursor, counter) + self._ms(0.2, 0.3)
        cursor += self._own(ctx, service, self_ms * 0.6, sigma, cursor, counter)
        server.end_unix_nano = cursor
        client.end_unix_nano = cursor + response_net
        return client.end_unix_nano

    def _db(self, ctx: _Ctx, parent: Span, service: str, statement: str, t: int, counter: list) -> int:
        fault = self.fault_at(ctx.t_s)
        span = self._span(ctx, parent, service, statement, SpanKind.CLIENT, t)
        span.attributes["db.system"] = "mysql" if statement.split(" ")[0].isupper() else "mongodb"
        duration = self._ms(3.0, 0.6) + self._stall(counter)
        if fault is not None and fault.kind == "netem" and fault.service == service:
            duration += int(fault.size_ms * self._rng.uniform(0.9, 1.1) * MS)
        span.end_unix_nano = t + duration
        return span.end_unix_nano

    def _own(self, ctx: _Ctx, service: str, median_ms: float, sigma: float, at_ns: int, counter: list) -> int:
        """A stretch of the service's own work beginning at ``at_ns``: its self time, slowed by CPU contention, or
        waiting out a pause it began in (once: the stretch after the service's calls begins when they ended)."""
        rng = self._rng
        ns = self._ms(median_ms, sigma) + self._stall(counter)
        fault = self.fault_at(ctx.t_s)
        if fault is not None and fault.kind == "cpu" and fault.service == service:
            ns += int(fault.size_ms * 0.5 * rng.lognormvariate(0, 0.3) * MS)  # half before its calls, half after
        at_s = (at_ns - self.start_ns) / NS
        for start, length, paused in self._pauses:
            if paused == service and start <= at_s < start + length:
                ns += int((start + length - at_s) * NS)
        return ns

    def _stall(self, counter: list) -> int:
        """A multi-second stall at one place of the request tree, when this request has one."""
        counter[0] += 1
        if counter[1] is not None and counter[0] == counter[1] + 1:
            return int(self._rng.uniform(1.5, 6.0) * NS)
        return 0

    def _ms(self, median: float, sigma: float) -> int:
        return int(median * self._rng.lognormvariate(0.0, sigma) * MS)

    def _span(self, ctx: _Ctx, parent: Span | None, service: str, name: str, kind: SpanKind, start: int) -> Span:
        self._next_id += 1
        host = self._host[service]
        span = Span(trace_id=ctx.trace, span_id=self._next_id.to_bytes(8, "big"),
                    parent_span_id=parent.span_id if parent else None, service=service, host=host, name=name,
                    kind=kind, start_unix_nano=start, end_unix_nano=start,
                    status=StatusCode.UNSET, attributes={})
        ctx.spans.append(span)
        return span

    # -- host samples --------------------------------------------------------

    def _samples(self, second: int) -> list[MetricPoint]:
        rng = self._rng
        fault = self.fault_at(second)
        t = self.start_ns + second * NS
        out = []
        for node in NODES:
            busy = min(max(rng.gauss(0.35, 0.04) * self.rate(second) / (self.rate_per_min / 60), 0.02), 1.0)
            if fault is not None and fault.kind == "cpu" and self._host[fault.service] == node:
                busy = min(busy + 0.55, 0.99)
            out.append(MetricPoint(host=node, name="system.cpu.utilization", attributes={"cpu.mode": "busy"},
                                   time_unix_nano=t, value=busy, kind=MetricKind.GAUGE, unit="1"))
        return out


def _concrete(template: str, rng: random.Random) -> str:
    """A URL path for a route template: its {placeholders} filled with ids."""
    parts = [str(rng.randrange(10**6)) if p.startswith("{") else p for p in template.split("/")]
    return "/".join(parts)
