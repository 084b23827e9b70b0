"""Generated traffic with injected faults, the same every time: what the detection suite, the tests and the
benchmarks feed the collector and its detectors (pure code on the core model; no I/O)."""
