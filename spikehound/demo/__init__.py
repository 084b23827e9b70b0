"""``spikehound demo``: real faults in a real, instrumented inference stack, found and explained live.

It starts ``spikehound collector`` on SQLite in a temporary directory,
``spikehound agent``, and an inference stack of separate processes traced
with the OpenTelemetry SDK that send to the agent (:mod:`.stack`: gateway,
preprocess with a feature store in SQLite, model server on a SIMULATED GPU;
:mod:`.delay_proxy` on the gateway -> model-server hop). It drives an open
loop of requests (:mod:`.load`), injects the faults of :mod:`.faults` one
after another, shows the alerts that reach its webhook receiver
(:mod:`.alerts`) and the spikes the REST API reports, and ends with a table
that judges each answer (:mod:`.runner`).

Like any other sender, the demo talks to the daemons over OTLP and HTTP only
and imports nothing of them.
"""

from spikehound.demo.runner import run_demo

__all__ = ["run_demo"]
