"""The NVML GPU sampler, driven by recorded NVML answers (RecordedNvml) and, where present, by the real driver.

The fixtures in tests/fixtures/nvml are in the recorder's format; see their "source" field for their provenance.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import pynvml
import pytest

from spikehound.agent.sample import Kind, Sample
from spikehound.agent.samplers import nvml as nvml_module
from spikehound.agent.samplers.nvml import REASONS, NvmlSampler, decode_reasons, record
from spikehound.agent.samplers.nvml_replay import RecordedNvml

FIXTURES = Path(__file__).parent / "fixtures" / "nvml"
MIB = 1024 * 1024

H100_0 = "GPU-5c1e8a37-8f3b-2e0d-9a41-6b7c3d2e1f00"
H100_1 = "GPU-a2d94f16-03c7-7b58-e1f4-90c2b8d65a13"
A100_0 = "GPU-1f7b3c2a-9e45-d812-6c0b-4a5e7f9d2c31"


def started(source: str | Path | dict[str, Any]) -> tuple[NvmlSampler, RecordedNvml]:
    nvml = RecordedNvml(FIXTURES / f"{source}.json" if isinstance(source, str) else source)
    sampler = NvmlSampler(nvml=nvml)
    assert sampler.start() is True
    return sampler, nvml


def values(samples: list[Sample], name: str, **attrs: Any) -> dict[str, float]:
    """{hw.id: value} of the samples named `name` whose attributes include attrs (dots spelled as __)."""
    want = {key.replace("__", "."): value for key, value in attrs.items()}
    return {str(s.attributes["hw.id"]): s.value for s in samples
            if s.name == name and all(s.attributes.get(k) == v for k, v in want.items())}


def throttles(samples: list[Sample], uuid: str) -> dict[str, float]:
    return {str(s.attributes["nvidia.throttle.reason"]): s.value for s in samples
            if s.name == "nvidia.gpu.throttle" and s.attributes["hw.id"] == uuid}


def test_reason_bits_match_pynvml() -> None:
    for bit, name in REASONS.items():
        camel = "".join(part.capitalize() for part in name.split("_"))
        assert getattr(pynvml, f"nvmlClocksEventReason{camel}") == bit, name
        assert getattr(pynvml, f"nvmlClocksThrottleReason{camel}") == bit, name
    assert decode_reasons(pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwSlowdown) == [
        "sw_power_cap", "hw_slowdown"]


def test_idle_gpu() -> None:
    sampler, _ = started("idle")
    samples = sampler.sample()
    assert values(samples, "hw.gpu.utilization") == {H100_0: 0.0}
    assert values(samples, "hw.gpu.memory.utilization") == {H100_0: 0.0}
    assert values(samples, "hw.power") == {H100_0: pytest.approx(69.874)}
    assert throttles(samples, H100_0) == {name: (1.0 if name == "gpu_idle" else 0.0) for name in REASONS.values()}
    assert values(samples, "nvidia.gpu.clock_event_reasons") == {H100_0: 1.0}
    assert values(samples, "nvidia.gpu.clock.sm") == {H100_0: 345.0}
    assert values(samples, "hw.temperature", hw__type="gpu") == {H100_0: 31.0}
    # Every sample names its GPU three ways.
    assert {(s.attributes["hw.id"], s.attributes["gpu.index"], s.attributes["hw.name"]) for s in samples} == {
        (H100_0, 0, "NVIDIA H100 80GB HBM3")}
    assert not [s for s in samples if s.name.startswith("nvidia.gpu.process.")]
    assert sampler.errors == {} and sampler.unsupported == set()
    sampler.close()
    sampler.close()  # idempotent
    assert sampler.sample() == []


def test_busy_two_gpus() -> None:
    sampler, _ = started("busy")
    samples = sampler.sample()
    assert values(samples, "hw.gpu.utilization") == {H100_0: 0.98, H100_1: 0.41}
    assert values(samples, "hw.gpu.memory.utilization") == {H100_0: 0.61, H100_1: 0.22}
    assert values(samples, "hw.power") == {H100_0: pytest.approx(651.234), H100_1: pytest.approx(312.456)}
    assert values(samples, "nvidia.gpu.power.limit") == {H100_0: 700.0, H100_1: 700.0}
    assert values(samples, "hw.gpu.memory.limit") == {H100_0: 81559 * MIB, H100_1: 81559 * MIB}
    assert values(samples, "hw.gpu.memory.usage") == {H100_0: (553 + 75776) * MIB, H100_1: (553 + 40960) * MIB}
    assert values(samples, "nvidia.gpu.memory.free") == {H100_0: (81559 - 553 - 75776) * MIB,
                                                         H100_1: (81559 - 553 - 40960) * MIB}
    assert values(samples, "nvidia.gpu.clock.memory") == {H100_0: 2619.0, H100_1: 2619.0}
    assert values(samples, "nvidia.gpu.pcie.throughput", network__io__direction="transmit") == {
        H100_0: 1843 * 1024, H100_1: 604 * 1024}
    assert values(samples, "nvidia.gpu.pcie.throughput", network__io__direction="receive") == {
        H100_0: 5310 * 1024, H100_1: 1220 * 1024}
    ecc = [s for s in samples if s.name == "nvidia.gpu.ecc.errors"]
    assert {(s.attributes["hw.id"], s.attributes["error.type"], s.value, s.kind) for s in ecc} == {
        (uuid, kind, 0.0, Kind.COUNTER) for uuid in (H100_0, H100_1) for kind in ("corrected", "uncorrected")}
    assert throttles(samples, H100_0) == dict.fromkeys(REASONS.values(), 0.0)
    # per process, keyed by pid
    assert values(samples, "nvidia.gpu.process.memory.usage", process__pid=48213) == {H100_0: 75776 * MIB}
    assert values(samples, "nvidia.gpu.process.memory.usage", process__pid=48214) == {H100_1: 40960 * MIB}
    assert values(samples, "nvidia.gpu.process.utilization", process__pid=48213) == {H100_0: 0.98}
    assert values(samples, "nvidia.gpu.process.utilization", process__pid=48214) == {H100_1: 0.41}
    # The next tick steps on: new readings, and only process samples newer than the last seen timestamp.
    second = sampler.sample()
    assert values(second, "hw.gpu.utilization") == {H100_0: 0.99, H100_1: 0.43}
    assert values(second, "nvidia.gpu.process.utilization", process__pid=48213) == {H100_0: 0.99}
    sampler.close()


def test_throttled_gpu() -> None:
    sampler, _ = started("throttled")
    first = sampler.sample()
    assert throttles(first, A100_0) == dict.fromkeys(REASONS.values(), 0.0)
    assert values(first, "nvidia.gpu.clock.sm") == {A100_0: 1410.0}
    second = sampler.sample()
    expected = {name: (1.0 if name in ("sw_power_cap", "hw_slowdown") else 0.0) for name in REASONS.values()}
    assert throttles(second, A100_0) == expected
    assert values(second, "nvidia.gpu.clock_event_reasons") == {A100_0: 12.0}
    assert values(second, "nvidia.gpu.clock.sm") == {A100_0: 1095.0}
    assert values(second, "hw.gpu.utilization") == {A100_0: 1.0}
    assert values(second, "hw.power") == {A100_0: pytest.approx(401.234)}
    third = sampler.sample()
    assert throttles(third, A100_0) == expected
    assert values(third, "nvidia.gpu.clock.sm") == {A100_0: 930.0}
    # past the end of the recording the last reading repeats
    assert values(sampler.sample(), "nvidia.gpu.clock.sm") == {A100_0: 930.0}
    sampler.close()


def test_xid_event_counts_on_its_gpu() -> None:
    sampler, _ = started("xid")
    first = sampler.sample()
    assert values(first, "nvidia.gpu.xid.errors") == {H100_0: 0.0, H100_1: 0.0}
    assert all(s.kind is Kind.COUNTER for s in first if s.name == "nvidia.gpu.xid.errors")
    assert values(first, "nvidia.gpu.xid.last") == {}
    second = sampler.sample()
    assert values(second, "nvidia.gpu.xid.errors") == {H100_0: 0.0, H100_1: 1.0}
    assert values(second, "nvidia.gpu.xid.last", nvidia__xid=79) == {H100_1: 79.0}
    # GPU 1 fell off the bus: its queries fail (counted, not fatal); GPU 0 reads on.
    assert values(second, "hw.gpu.utilization") == {H100_0: 0.90}
    assert sampler.errors["utilization"] == 1 and sampler.errors["power"] == 1
    third = sampler.sample()
    assert values(third, "nvidia.gpu.xid.errors") == {H100_0: 0.0, H100_1: 1.0}  # cumulative, no new event
    assert values(third, "hw.gpu.utilization") == {H100_0: 0.31}
    assert sampler.errors["utilization"] == 2
    sampler.close()


def test_unsupported_query_is_not_retried_and_errors_are_counted(tmp_path: Path) -> None:
    fixture = json.loads((FIXTURES / "busy.json").read_text())
    calls = fixture["devices"][0]["calls"]
    calls["nvmlDeviceGetPowerUsage"] = [{"error": pynvml.NVML_ERROR_NOT_SUPPORTED, "name": "NVMLError_NotSupported"}]
    calls["nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)"] = [{"error": pynvml.NVML_ERROR_UNKNOWN,
                                                                 "name": "NVMLError_Unknown"}]
    path = tmp_path / "variant.json"
    path.write_text(json.dumps(fixture))
    sampler, nvml = started(path)
    for _ in range(3):
        samples = sampler.sample()
    assert nvml.calls[(0, "nvmlDeviceGetPowerUsage")] == 1  # asked once, then remembered
    assert (H100_0, "power") in sampler.unsupported
    assert nvml.calls[(0, "nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)")] == 3  # a failure is retried
    assert sampler.errors == {"temperature": 3}
    assert values(samples, "hw.power") == {H100_1: pytest.approx(305.877)}
    assert values(samples, "hw.temperature") == {H100_1: 53.0}
    assert values(samples, "hw.gpu.utilization") == {H100_0: 0.97, H100_1: 0.39}
    assert values(samples, "hw.gpu.memory.usage").keys() == {H100_0, H100_1}
    sampler.close()


def test_throttle_reasons_fall_back_to_the_older_call() -> None:
    fixture = json.loads((FIXTURES / "throttled.json").read_text())
    calls = fixture["devices"][0]["calls"]
    calls["nvmlDeviceGetCurrentClocksThrottleReasons"] = calls.pop("nvmlDeviceGetCurrentClocksEventReasons")
    sampler, _ = started(fixture)
    sampler.sample()
    assert throttles(sampler.sample(), A100_0)["hw_slowdown"] == 1.0
    assert (A100_0, "clock_event_reasons") in sampler.unsupported
    sampler.close()


def test_recorder_round_trip(tmp_path: Path) -> None:
    """record() on a (replayed) NVML writes a fixture that replays to the same readings."""
    path = tmp_path / "again.json"
    written = record(RecordedNvml(FIXTURES / "xid.json"), path, samples=3, interval=0)
    assert written["source"].startswith("recorded on ")
    assert written["pynvml_version"] == pynvml_version()
    assert json.loads(path.read_text())["devices"][1]["uuid"] == H100_1
    original, _ = started("xid")
    again, _ = started(path)
    for _ in range(4):
        assert again.sample() == original.sample()


def pynvml_version() -> str:
    from importlib import metadata

    return metadata.version("nvidia-ml-py")


def driver_present() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_no_driver_real_module(caplog: pytest.LogCaptureFixture) -> None:
    if driver_present():
        pytest.skip("an NVIDIA driver is present here")
    sampler = NvmlSampler(nvml=pynvml)
    with caplog.at_level(logging.DEBUG, logger=nvml_module.__name__):
        assert sampler.start() is False
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "NVML unavailable (" in warnings[0].getMessage()
    assert "GPU sampling disabled" in warnings[0].getMessage()
    assert sampler.sample() == []
    sampler.close()


def test_no_pynvml(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml now raises ImportError
    sampler = NvmlSampler()
    with caplog.at_level(logging.WARNING, logger=nvml_module.__name__):
        assert sampler.start() is False
    assert [r.getMessage() for r in caplog.records] == [
        "NVML unavailable (import of pynvml halted; None in sys.modules): GPU sampling disabled"]
    assert sampler.sample() == []


def test_recorder_cli_without_driver(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if driver_present():
        pytest.skip("an NVIDIA driver is present here")
    assert nvml_module.main(["--record", str(tmp_path / "f.json"), "--samples", "1"]) == 1
    assert "NVML unavailable" in capsys.readouterr().err
    assert not (tmp_path / "f.json").exists()


@pytest.mark.gpu
def test_real_gpu(tmp_path: Path) -> None:
    if not driver_present():
        pytest.skip("no NVIDIA driver (nvmlInit failed)")
    sampler = NvmlSampler(nvml=pynvml)
    assert sampler.start() is True
    try:
        gpus = {str(gpu["hw.id"]) for gpu in sampler.gpus}
        assert gpus
        sampler.sample()
        time.sleep(1.0)
        live = sampler.sample()
    finally:
        sampler.close()
    utilization = values(live, "hw.gpu.utilization")
    assert utilization.keys() == gpus and all(0.0 <= v <= 1.0 for v in utilization.values())
    assert values(live, "hw.gpu.memory.limit").keys() == gpus
    assert all(v > 0 for v in values(live, "hw.gpu.memory.limit").values())
    temperatures = values(live, "hw.temperature")
    assert temperatures.keys() == gpus and all(0 < v < 120 for v in temperatures.values())

    path = tmp_path / "recorded.json"
    record(pynvml, path, samples=2, interval=1.0)
    replayed, _ = started(path)
    replayed.sample()
    again = replayed.sample()
    replayed.close()
    # Processes come and go and an XID may not occur: compare the names every GPU always reports.
    volatile = {"nvidia.gpu.process.memory.usage", "nvidia.gpu.process.utilization", "nvidia.gpu.xid.last"}
    assert {s.name for s in again} - volatile == {s.name for s in live} - volatile
