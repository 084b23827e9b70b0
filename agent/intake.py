"""What the agent's receivers share: enrich the request, queue it, count it.

The agent acknowledges a request once it is in the forward queue (memory or
disk); the collector's acknowledgement of the forwarded copy comes later.
When both memory and the disk spool are full the request is refused with
``QueueFull`` and the receivers push back (RESOURCE_EXHAUSTED / 429): the
sender keeps the data and retries, nothing is dropped silently.
"""

from __future__ import annotations

from collections import Counter

from agent.enrich import Enricher
from agent.forward_queue import ForwardQueue
from agent.spool import Item, Signal
from spikehound.otlp import parse_metrics_request, parse_trace_request


class QueueFull(Exception):
    """Memory queue and disk spool are both full."""


class Intake:
    def __init__(self, enricher: Enricher, queue: ForwardQueue) -> None:
        self.enricher = enricher
        self.queue = queue
        self.received: Counter[tuple[Signal, str]] = Counter()  # (signal, protocol) -> items
        self.refused: Counter[Signal] = Counter()  # items pushed back because the queue was full
        self.invalid_requests: Counter[str] = Counter()  # protocol -> requests that could not be read

    def accept(self, signal: Signal, payload: bytes, protocol: str, json: bool = False) -> int:
        """Queue one export request (protobuf, or OTLP/JSON when ``json``); return its item count.

        Raises PayloadError (unreadable) or QueueFull (push back).
        """
        try:
            if json:  # the queue and the collector only ever see protobuf
                parse = parse_trace_request if signal is Signal.TRACES else parse_metrics_request
                payload = parse(payload, json=True).SerializeToString()
            enriched, count = (self.enricher.traces(payload) if signal is Signal.TRACES
                               else self.enricher.metrics(payload))
        except ValueError:
            self.invalid_requests[protocol] += 1
            raise
        self.received[signal, protocol] += count
        if count and not self.queue.put(Item(signal, enriched, count)):
            self.refused[signal] += count
            raise QueueFull("agent forward queue and disk spool are full; retry later")
        return count
