"""What the tests and the benchmarks both run: collectors and PostgreSQL servers to start (on free ports),
scenarios to send (generated traffic with injected faults, ``scenarios/``), the detection suite's scoring, the
fuzzed properties and the checks of the API's answers; the one way to wait (``waiting.eventually``), the REST
API client that holds every answer to the served OpenAPI document (``api_client``) and a daemon's /metrics
parsed (``scrape``).

Neither tests/ nor benchmarks/ imports the other (tests/test_layout.py); what they share lives here.
Not shipped with the package.
"""
