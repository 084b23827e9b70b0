"""What the tests and the benchmarks both run: collectors and PostgreSQL servers to start, scenarios to send,
the detection suite's scoring, the fuzzed properties and the checks of the API's answers.

Neither tests/ nor benchmarks/ imports the other (tests/test_layout.py); what they share lives here.
Not shipped with the package.
"""
