"""How the agent process runs: gRPC's poll-based transport unless the operator chose otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

from spikehound.agent.runtime import POLL_TRANSPORT, prefer_poll_transport


def test_defaults_to_the_poll_transport_and_quiet_grpc_logs() -> None:
    env: dict[str, str] = {}
    assert prefer_poll_transport(env)
    assert env == {"GRPC_EXPERIMENTS": POLL_TRANSPORT, "GRPC_VERBOSITY": "ERROR"}


def test_an_operators_choice_is_left_alone() -> None:
    env = {"GRPC_EXPERIMENTS": "", "GRPC_VERBOSITY": "DEBUG"}
    assert not prefer_poll_transport(env)
    assert env == {"GRPC_EXPERIMENTS": "", "GRPC_VERBOSITY": "DEBUG"}


def test_does_nothing_once_grpc_is_loaded() -> None:
    # gRPC reads its experiments when it loads; setting them later would only mislead whoever reads the environment.
    code = ("import os, grpc; from spikehound.agent.runtime import prefer_poll_transport; "
            "print(prefer_poll_transport(), 'GRPC_EXPERIMENTS' in os.environ)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]

