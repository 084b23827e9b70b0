"""What the tests share; no test module imports another (tests/test_layout.py).

* ``storage_data``, ``query_plans``: stored records at fixed times, and what a query plan must not do (and
  the plans of what a query runs);
* ``sdk_traffic``, ``otlp_requests``, ``otel_send``, ``serving_stack``: traces and samples to send, through
  the OpenTelemetry SDK or as raw OTLP requests;
* ``cli``: the spikehound command in a child process; ``spool_items``: numbered spool items;
* ``systemd_notify``, ``systemd_units``: systemd's notification socket and the unit files;
* ``alert_spikes``, ``alert_receivers``: spikes as alerting is handed them, and an alert webhook;
* ``prometheus``, ``web_scenarios``: a Prometheus server, the web pages' spike data; ``ci``: whether this is
  CI's run.

What the benchmarks share too is ``harness/``: collectors to start (``daemons``) on free ports (``ports``),
scenarios to send, ``waiting.eventually()`` (the one way to wait for something a daemon does in its own
time), ``api_client`` (the REST API, every answer held to the OpenAPI document the collector serves) and
``scrape`` (a daemon's Prometheus /metrics, parsed).
"""
