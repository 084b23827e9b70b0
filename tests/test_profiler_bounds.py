"""How much of the host the profiler can be made to attach to: a cap on tracked processes and on py-spy children,
and an owner filter.

Any local user can start a process whose ``argv[0]`` matches ``agent.process_patterns``. These tests start
dozens of real such processes (``sleep`` under a chosen ``argv[0]``, as ``exec -a`` does) and find them with the
real CPU sampler; py-spy is a stand-in shell script (the profiler takes its path), which holds until the test
lets go, so that every child of a window is seen running at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
import shutil
import stat
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from spikehound.agent.daemon import default_samplers
from spikehound.agent.forward_queue import ForwardQueue
from spikehound.agent.profiler import Profiler
from spikehound.agent.runtime import run as run_loop
from spikehound.agent.samplers.cpu import CpuSampler
from spikehound.agent.spool import DiskSpool
from spikehound.config import ConfigError, load

SLEEP = shutil.which("sleep") or "/bin/sleep"


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[ForwardQueue]:
    q = ForwardQueue(1 << 22, DiskSpool(tmp_path / "spool", 1 << 26))
    yield q
    q.close()


class LookAlikes:
    """``count`` sleeping processes whose argv[0] is ``name``, started one after another."""

    def __init__(self, name: str, count: int) -> None:
        self.name = name
        self.children: list[subprocess.Popen[bytes]] = []
        self.start(count)

    def start(self, count: int) -> None:
        for _ in range(count):
            self.children.append(subprocess.Popen([self.name, "300"], executable=SLEEP, stdin=subprocess.DEVNULL))

    @property
    def pids(self) -> list[int]:
        """Those still running."""
        return [c.pid for c in self.children if c.returncode is None]

    def oldest(self, n: int) -> list[int]:
        """The ``n`` running longest, ties by pid: those the cap keeps."""
        return sorted(self.pids, key=lambda pid: (psutil.Process(pid).create_time(), pid))[:n]

    def kill(self, pids: list[int]) -> None:
        for child in self.children:
            if child.pid in pids:
                child.kill()
                child.wait()

    def close(self) -> None:
        for child in self.children:
            child.kill()
        for child in self.children:
            child.wait()


@pytest.fixture
def look_alikes() -> Iterator[Callable[[int], LookAlikes]]:
    made: list[LookAlikes] = []

    def make(count: int) -> LookAlikes:
        made.append(LookAlikes(f"vllm-look-alike-{uuid.uuid4().hex[:12]}", count))
        return made[-1]

    yield make
    for group in made:
        group.close()


def holding_py_spy(tmp_path: Path) -> tuple[str, Path, Path, Path]:
    """A stand-in py-spy that says how many of its kind run as it starts, then holds until ``release`` exists.

    Returns its path, the running directory (one file per live child), the release file and the log of counts.
    """
    running, release, counts = tmp_path / "running", tmp_path / "release", tmp_path / "counts"
    running.mkdir()
    script = tmp_path / "py-spy"
    script.write_text(f"""#!/bin/sh
touch '{running}'/$$
ls '{running}' | wc -l >> '{counts}'
while [ ! -e '{release}' ]; do sleep 0.02; done
rm -f '{running}'/$$
pid=; prev=
for a in "$@"; do [ "$prev" = --pid ] && pid=$a; prev=$a; done
echo "main (app.py:1);leaf_$pid (app.py:2) 3"
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script), running, release, counts


def held_window(profiler: Profiler, running: Path, release: Path, counts: Path, expected: int) -> set[int]:
    """One window whose children are let go once ``expected`` of them run at once and have said how many they
    saw; the pids it profiled."""

    def said() -> int:
        return len(counts.read_text().split()) if counts.exists() else 0

    async def window() -> set[int]:
        release.unlink(missing_ok=True)
        before = said()
        task = asyncio.ensure_future(profiler.window())
        deadline = asyncio.get_running_loop().time() + 30
        while (len(os.listdir(running)) < expected or said() - before < expected) and not task.done():
            assert asyncio.get_running_loop().time() < deadline, f"{expected} py-spy children never ran at once"
            await asyncio.sleep(0.01)
        release.touch()
        return {s.pid for s in await task}

    return run_loop(window())


def sampled_processes(sampler: CpuSampler) -> dict[int, str]:
    sampler.sample()
    return {pid: str(a["process.executable.name"]) for pid, a in sampler.processes.items()}


# --- the cap --------------------------------------------------------------------------------------------------


def test_forty_look_alikes_get_at_most_the_default_32_py_spy_children_and_the_rest_are_counted(
        tmp_path, queue, look_alikes, caplog):
    group = look_alikes(40)
    sampler = CpuSampler(process_patterns=[group.name], rescan_interval_s=0)
    assert sampler.start()
    py_spy, running, release, counts = holding_py_spy(tmp_path)
    profiler = Profiler(lambda: sampled_processes(sampler), queue, "gpu-1", py_spy=py_spy, window_seconds=1)

    with caplog.at_level(logging.WARNING):
        profiled = held_window(profiler, running, release, counts, expected=32)
        again = held_window(profiler, running, release, counts, expected=32)

    most_at_once = max(int(n) for n in counts.read_text().split())
    assert most_at_once == 32, most_at_once  # all of a window's children side by side, never more
    assert profiled == again == set(group.oldest(32))  # the same ones each window: those running longest
    assert sampler.left_out["max_processes"] == 8  # each left-out process counted once, not once a scan
    assert sampler.left_out_now("max_processes") == 8
    warnings = [r.getMessage() for r in caplog.records if "agent.profile_max_processes" in r.getMessage()]
    assert len(warnings) == 1 and "40 model-server processes" in warnings[0], warnings


def test_a_cap_episode_is_logged_once_when_it_begins_and_once_when_it_ends(look_alikes, caplog):
    group = look_alikes(12)
    sampler = CpuSampler(process_patterns=[group.name], rescan_interval_s=0, max_processes=4)
    assert sampler.start()
    with caplog.at_level(logging.INFO, logger="spikehound.agent.samplers.cpu"):
        first = sampled_processes(sampler)
        assert list(first) == group.oldest(4)  # ranked: longest-running first
        sampled_processes(sampler)
        assert sampler.left_out["max_processes"] == 8
        group.kill(list(first))  # the tracked ones exit: the next oldest take their places
        assert list(sampled_processes(sampler)) == group.oldest(4)
        assert sampler.left_out["max_processes"] == 8  # already counted while they waited
        group.kill(group.oldest(6))
        assert len(sampled_processes(sampler)) == 2 and sampler.left_out_now("max_processes") == 0
        group.start(3)  # a new burst: 5 match
        assert list(sampled_processes(sampler)) == group.oldest(4)
    said = [r.getMessage() for r in caplog.records if "agent.profile_max_processes" in r.getMessage()]
    assert len(said) == 3, said  # over, within again, over
    assert "leaving 8 out" in said[0] and "within" in said[1] and "leaving 1 out" in said[2]
    assert sampler.left_out["max_processes"] == 9


def test_the_profiler_caps_its_children_whatever_it_is_handed(tmp_path, queue, look_alikes, caplog):
    group = look_alikes(10)
    py_spy, running, release, counts = holding_py_spy(tmp_path)
    profiler = Profiler(lambda: {pid: "sleep" for pid in group.pids}, queue, "gpu-1", py_spy=py_spy,
                        window_seconds=1, max_processes=3)
    with caplog.at_level(logging.WARNING, logger="spikehound.agent.profiler"):
        assert held_window(profiler, running, release, counts, expected=3) == set(group.pids[:3])  # in the order given
        assert held_window(profiler, running, release, counts, expected=3) == set(group.pids[:3])
    assert max(int(n) for n in counts.read_text().split()) == 3
    assert profiler.stats.failures["max_processes"] == 14  # 7 left out of each of two windows
    assert profiler.profiled_processes == 3
    assert len([r for r in caplog.records if "agent.profile_max_processes" in r.getMessage()]) == 1


# --- the owner filter -----------------------------------------------------------------------------------------


def test_only_processes_of_the_users_named_are_tracked(look_alikes, caplog):
    group = look_alikes(3)
    me = pwd.getpwuid(os.getuid()).pw_name
    for users in ([me], [str(os.getuid())]):
        mine = CpuSampler(process_patterns=[group.name], rescan_interval_s=0, users=users)
        assert mine.start()
        assert set(sampled_processes(mine)) == set(group.pids)
        assert mine.left_out["user"] == 0
    other = str(os.getuid() + 4242)
    theirs = CpuSampler(process_patterns=[group.name], rescan_interval_s=0, users=[other])
    assert theirs.start()
    with caplog.at_level(logging.WARNING, logger="spikehound.agent.samplers.cpu"):
        assert sampled_processes(theirs) == {}
        assert sampled_processes(theirs) == {}
    assert theirs.left_out["user"] == 3 and theirs.left_out_now("user") == 3
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "agent.profile_users" in said[0] and f"uid {os.getuid()}" in said[0], said


def test_a_user_this_host_does_not_know_stops_the_agent_naming_the_key(tmp_path):
    cfg = load(env={"SPIKEHOUND_AGENT_PROFILE_USERS": "vllm,no-such-user-7f3a", "SPIKEHOUND_DATA_DIR": str(tmp_path)})
    assert cfg.agent.profile_users == ["vllm", "no-such-user-7f3a"]
    with pytest.raises(ConfigError, match=r"^agent\.profile_users: .*'(vllm|no-such-user-7f3a)'"):
        default_samplers(cfg)


@pytest.mark.parametrize(("env", "key"), [
    ({"SPIKEHOUND_AGENT_PROFILE_MAX_PROCESSES": "0"}, "agent.profile_max_processes"),
    ({"SPIKEHOUND_AGENT_PROFILE_MAX_PROCESSES": "100000"}, "agent.profile_max_processes"),
    ({"SPIKEHOUND_AGENT_PROFILE_USERS": "vllm,../etc"}, "agent.profile_users"),
])
def test_bad_caps_and_user_names_are_configuration_errors(env, key):
    with pytest.raises(ConfigError, match=rf"^{key}"):
        load(env=env)


def test_the_default_cap_is_32():
    assert load(env={}).agent.profile_max_processes == 32 and load(env={}).agent.profile_users == []
