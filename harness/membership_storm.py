"""A rename storm against a membership file, as a local user who can write its directory could run one.

In a loop, what sits at the path is replaced (by ``rename``, atomically) with a symbolic link to ``target``
(``/dev/zero``, a huge file), with a FIFO, and with a regular file holding a good membership, so that a
reader that checks the path and then opens it again sees one thing and reads another. Run it as a child
process (``storm``), so that it races the reader on another core instead of taking turns with it under one
interpreter lock; ``python -m harness.membership_storm PATH TARGET SECONDS [link,fifo]`` runs it by
hand (``kinds`` narrows it to links or FIFOs).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(path: Path, target: str, seconds: float, kinds: str = "link,fifo") -> int:
    """Storm ``path`` for ``seconds``, leaving the good membership there at the end; the rounds made."""
    good = path.read_text()
    link, fifo, fresh = (path.with_name(f".{path.name}.{what}") for what in ("link", "fifo", "fresh"))
    deadline = time.monotonic() + seconds

    def write(tmp: Path) -> None:
        tmp.write_text(good)

    rounds = 0
    steps: list[tuple[Callable[[Path], None], Path]] = []
    if "link" in kinds:
        steps += [(lambda p: os.symlink(target, p), link), (write, fresh)]
    if "fifo" in kinds:
        steps += [(os.mkfifo, fifo), (write, fresh)]
    while time.monotonic() < deadline:
        # The good file between the others: a reader that checked it then opens a link or a FIFO.
        for make, tmp in steps:
            try:
                tmp.unlink(missing_ok=True)
                make(tmp)
                os.rename(tmp, path)
            except OSError:
                continue
        rounds += 1
    write(fresh)
    os.rename(fresh, path)
    return rounds


class Storm:
    """A storm running in a child process; ``rounds`` once it has ended."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.rounds = 0

    @property
    def running(self) -> bool:
        return self.proc.poll() is None


@contextmanager
def storm(path: Path, target: str, seconds: float, kinds: str = "link,fifo") -> Iterator[Storm]:
    """The storm in a child process for ``seconds``; the block's end waits for it to end (and kills a stuck one)."""
    proc = subprocess.Popen([sys.executable, "-m", "harness.membership_storm", str(path), target,
                             str(seconds), kinds], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    running = Storm(proc)
    try:
        yield running
        out, _ = proc.communicate(timeout=seconds + 30)
        running.rounds = int(out.strip() or 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


if __name__ == "__main__":
    print(run(Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), *sys.argv[4:5]))
