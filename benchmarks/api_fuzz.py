"""schemathesis over every operation of a live collector's OpenAPI document.

Run from the repository root: ``python -m benchmarks.api_fuzz`` (``--max-examples N`` per operation,
``--seed N`` to repeat a run). It starts a real collector (a child process on SQLite in a temporary
directory), loads it first so that the routes answer with data: five minutes of the scenario suite's
traffic with a slow feature query in it (spans and host samples, so there are traces, latency windows,
metrics and a spike), an alert receiver that is never reachable (so the spike's notification is a dead
letter the outbox routes can show and retry) and a silence. Then schemathesis (its CLI, all phases:
examples, coverage, fuzzing, stateful) generates requests for every operation of the document the
collector serves at ``/api/v1/openapi.json`` and checks each answer:

* ``not_a_server_error``: no 5xx;
* ``status_code_conformance``, ``content_type_conformance``, ``response_headers_conformance``,
  ``response_schema_conformance``: every answer is one the document describes, in its shape;
* ``missing_required_header``, ``unsupported_method``, ``allow_header_conformance``,
  ``ensure_resource_availability``: routing and methods behave as HTTP says.

Left out, with the reason: ``positive_data_acceptance`` and ``negative_data_rejection`` (a parameter's
validity can depend on another's, since before until, or on what storage holds, 1677 to 2262, which JSON
Schema cannot say, so a schema-valid request may rightly get a 400; and an empty optional parameter is
read as none given), ``use_after_free`` (a silence ended with DELETE stays readable as expired, by
design, docs/alerts.md), ``ignored_auth`` (the run has no token; tests/test_api.py covers tokens).

The requests name the collector by address (its Host check, spikehound/collector/cross_site.py, passes them) and send
JSON bodies as application/json, as the document asks. Exit status: schemathesis's (0: no failure), or 1
when the collector logged an error or died.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from harness.api_checks import check_known, loaded_collector, logged_errors

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
          "response_schema_conformance,missing_required_header,unsupported_method,allow_header_conformance,"
          "ensure_resource_availability")
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.api_fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--max-examples", type=int, default=200, help="generated cases per operation (default 200)")
    parser.add_argument("--seed", type=int, default=None, help="schemathesis seed (default: a new one, printed)")
    args = parser.parse_args(argv)
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if exe is None:
        print("schemathesis is not installed (pip install -e '.[dev]')", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="spikehound-api-fuzz-") as tmp:
        workdir = Path(tmp)
        started = time.perf_counter()
        collector = loaded_collector(workdir)
        print(f"collector loaded in {time.perf_counter() - started:.1f} s: {collector.api}", flush=True)
        command = [exe, "run", f"{collector.api}/api/v1/openapi.json", "--checks", CHECKS,
                   "--max-examples", str(args.max_examples), "--header", "Host: 127.0.0.1",
                   "--request-timeout", "120", "--warnings", "off", "--no-color"]
        if args.seed is not None:
            command += ["--seed", str(args.seed)]
        started = time.perf_counter()
        try:
            known = check_known(collector.api)
            print(f"the collector's own objects: {len(known)} answers unlike the document", flush=True)
            for failure in known:
                print(failure)
            status = subprocess.run(command, cwd=workdir, timeout=3600, check=False).returncode
        finally:
            alive = collector.running
            collector.kill()
        logged, refusals = logged_errors(collector)
    print(f"schemathesis exited {status} after {time.perf_counter() - started:.1f} s; answers of the collector's "
          f"objects unlike the document: {len(known)}; collector alive at the end: {alive}; collector error lines "
          f"logged: {len(logged)} (and {refusals} malformed requests refused by aiohttp's parser, logged by it)")
    for line in logged[:10]:
        print(f"  {line}")
    return status or (0 if alive and not logged and not known else 1)


if __name__ == "__main__":
    sys.exit(main())
