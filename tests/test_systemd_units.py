"""The systemd units and the example configuration under ``systemd/``.

``systemd-analyze verify`` must accept both units and ``systemd-analyze security`` must rate their
exposure at most 2.5 (collector) and 3.5 (agent). The units are checked as installed into this
environment: ``ExecStart=`` names this virtual environment's ``spikehound`` instead of
``/opt/spikehound/bin/spikehound`` (verify insists that the command exists). systemd need not be
running: both commands work on unit files (Debian package ``systemd``; ``.ci/run`` installs it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from spikehound.config import SECTIONS, Config
from spikehound.live_config import flat_items
from tests.support.ci import IN_CI
from tests.support.systemd_units import service_section

ROOT = Path(__file__).resolve().parents[1]
UNITS = ROOT / "systemd"
INSTALLED = "/opt/spikehound/bin/spikehound"
MAX_EXPOSURE = {"spikehound-collector.service": 2.5, "spikehound-agent.service": 3.5}


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        if IN_CI:
            pytest.fail("systemd-analyze is missing; .ci/run installs Debian's systemd package for these tests")
        pytest.skip("systemd-analyze is not installed (Debian/Ubuntu package: systemd)")
    return found


def installed(unit: str, directory: Path, text: str | None = None) -> Path:
    """The unit file as installed into this environment, in ``directory``."""
    text = (UNITS / unit).read_text() if text is None else text
    path = directory / unit
    path.write_text(text.replace(INSTALLED, str(Path(sys.executable).parent / "spikehound")))
    return path


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([systemd_analyze(), *args], capture_output=True, text=True, timeout=120)




@pytest.mark.parametrize("unit", sorted(MAX_EXPOSURE))
def test_systemd_analyze_verify_accepts_the_unit(unit, tmp_path):
    done = analyze("verify", "--man=no", str(installed(unit, tmp_path)))
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_systemd_analyze_verify_would_catch_a_broken_unit(tmp_path):
    broken = (UNITS / "spikehound-collector.service").read_text().replace("Type=notify", "Type=notifyy")
    done = analyze("verify", "--man=no", str(installed("spikehound-collector.service", tmp_path, broken)))
    assert "Failed to parse service type" in done.stderr


@pytest.mark.parametrize("unit", sorted(MAX_EXPOSURE))
def test_systemd_analyze_security_exposure_is_within_bounds(unit, tmp_path):
    done = analyze("security", "--offline=true", "--no-pager", str(installed(unit, tmp_path)))
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    assert found, done.stdout + done.stderr
    exposure = float(found.group(1))
    print(f"systemd-analyze security {unit}: exposure {exposure}")
    assert exposure <= MAX_EXPOSURE[unit], done.stdout


@pytest.mark.parametrize(("unit", "role"), [("spikehound-collector.service", "collector"),
                                            ("spikehound-agent.service", "agent")])
def test_units_notify_watchdog_restart_and_keep_secrets_and_state_in_their_places(unit, role):
    s = service_section(unit)
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert s["ExecStart"] == [f"{INSTALLED} {role} --config /etc/spikehound/{role}.toml"]
    assert s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert s["EnvironmentFile"] == [f"-/etc/spikehound/{role}.env"]
    assert s["StateDirectory"] == [f"spikehound-{role}"] and s["LogsDirectory"] == [f"spikehound-{role}"]
    assert s["Restart"] == ["on-failure"] and s["RestartPreventExitStatus"] == ["2"]  # 2: bad configuration
    assert int(s["WatchdogSec"][0]) >= 10
    assert s["DynamicUser"] == ["yes"] and s["CapabilityBoundingSet"] == [""]
    # The stop deadline covers the daemon's own: the collector's 30 s, the agent's drain_seconds + 20 s.
    own_deadline = 30.0 if role == "collector" else Config().agent.drain_seconds + 20
    assert float(s["TimeoutStopSec"][0]) > own_deadline


def test_the_agent_keeps_the_gpus_and_proc_that_its_samplers_read():
    s = service_section("spikehound-agent.service")
    assert s["DevicePolicy"] == ["closed"]
    assert "char-nvidia-frontend rw" in s["DeviceAllow"]  # /dev/nvidia0..N and /dev/nvidiactl, for NVML
    assert s.get("PrivateDevices", ["no"]) == ["no"]
    assert s["ProcSubset"] == ["all"] and s["ProtectProc"] == ["default"]  # /proc/stat, /proc/net, other PIDs
    assert "PrivateNetwork" not in s  # /proc/net/dev and /proc/net/snmp must be the host's


# --- example configuration files ---------------------------------------------------------------------------


KEY_LINE = re.compile(r"#?\s?(\w+) = ")


def documented_keys(path: Path) -> set[str]:
    """``section.key`` of every key written in ``path`` (set, or commented out to show its default) under a
    comment that explains it; keys on adjacent lines may share one comment."""
    keys, section, explained = set(), "", False
    for line in path.read_text().splitlines():
        if m := re.fullmatch(r"\[(\w+)\]", line.strip()):
            section, explained = m.group(1) + ".", False
        elif m := KEY_LINE.match(line):
            if explained:
                keys.add(section + m.group(1))
        else:
            explained = line.startswith("# ") and len(line) > 10
    return keys


@pytest.mark.parametrize(("example", "sections"), [
    ("collector.toml", SECTIONS - {"agent"}),  # every section the collector reads, new ones included
    ("agent.toml", {"agent", "log"}),
])
def test_example_configuration_documents_every_key(example, sections):
    wanted = {key for key, _ in flat_items(Config()) if "." not in key or key.partition(".")[0] in sections}
    missing = wanted - documented_keys(UNITS / example)
    assert not missing, f"{example} lacks (or does not explain) {sorted(missing)}"


@pytest.mark.parametrize("example", ["collector.toml", "agent.toml"])
def test_example_configuration_passes_check_config(example, tmp_path):
    tomllib.loads((UNITS / example).read_text())

    def check(**env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(Path(sys.executable).parent / "spikehound"), "check-config", str(UNITS / example)],
                              capture_output=True, text=True, timeout=60,
                              env={"HOME": str(tmp_path), "PATH": "/usr/bin", **env})

    # The collector's example listens for OTLP beyond loopback: its environment file supplies the token.
    done = check(SPIKEHOUND_COLLECTOR_OTLP_TOKEN="t0ken") if example == "collector.toml" else check()
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "# configuration is valid"
    if example == "collector.toml":  # without it, check-config says that a collector would refuse to start
        bare = check()
        assert bare.returncode == 0 and "a collector would refuse to start" in bare.stderr


def test_environment_files_hold_only_secrets_named_as_settings():
    for example in ("collector.env", "agent.env"):
        names = re.findall(r"^#?(SPIKEHOUND_\w+)=", (UNITS / example).read_text(), re.M)
        assert names, example
        for name in names:  # each is a real setting, and a secret one
            assert name.endswith(("_TOKEN", "_URL")), name
            section, _, key = name.removeprefix("SPIKEHOUND_").lower().partition("_")
            assert section in SECTIONS and hasattr(getattr(Config(), section), key), name


def test_check_config_names_the_bad_key_of_a_file(tmp_path):
    bad = tmp_path / "collector.toml"
    bad.write_text((UNITS / "collector.toml").read_text().replace("metric_retention_max_points = 200000000",
                                                                 "metric_retention_max_points = -1"))
    done = subprocess.run([str(Path(sys.executable).parent / "spikehound"), "check-config", str(bad)],
                          capture_output=True, text=True, timeout=60, env={"HOME": str(tmp_path), "PATH": "/usr/bin"})
    assert done.returncode == 2
    assert done.stderr.strip() == (f"spikehound: bad configuration: storage.metric_retention_max_points (from {bad}): "
                                   "must not be negative, got -1")
