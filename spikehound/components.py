"""Components with a lifecycle, and the stack that starts and stops them in order.

A daemon is a stack of components: each is started in the order given, and
they are stopped in the reverse order, so that a component is only ever used
by components started after it (receivers stop first, what they feed drains
next, storage goes last). When a component fails to start, the ones already
started are stopped before the error goes on; a component that fails to start
cleans up its own partial start.

>>> import asyncio
>>> seen = []
>>> class Part:
...     def __init__(self, name):
...         self.name = name
...     async def start(self):
...         seen.append(f"start {self.name}")
...     async def stop(self):
...         seen.append(f"stop {self.name}")
>>> async def start_then_stop():
...     stack = ComponentStack()
...     await stack.start(Part("storage"), Part("receiver"))
...     await stack.stop()
>>> asyncio.run(start_then_stop())
>>> seen
['start storage', 'start receiver', 'stop receiver', 'stop storage']
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

log = logging.getLogger("spikehound.components")


class Component(Protocol):
    """A part of a daemon: ``start`` returns once it can be used, ``stop`` releases what it holds."""

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def _nothing() -> None:
    return None


class Stage:
    """A component made of two coroutine functions, for a part whose start or stop is a call or two."""

    def __init__(self, name: str, *, start: Callable[[], Awaitable[None]] = _nothing,
                 stop: Callable[[], Awaitable[None]] = _nothing) -> None:
        self.name = name
        self._start = start
        self._stop = stop

    async def start(self) -> None:
        await self._start()

    async def stop(self) -> None:
        await self._stop()

    def __repr__(self) -> str:
        return f"Stage({self.name!r})"


class ComponentStack:
    """Starts components in order and stops the started ones in reverse order; ``stop`` may be called again."""

    def __init__(self) -> None:
        self._started: list[Component] = []

    @property
    def started(self) -> list[str]:
        """The names of the running components, in start order."""
        return [c.name for c in self._started]

    async def start(self, *components: Component) -> None:
        """Start ``components`` one after the other, after those of earlier calls.

        When one fails, every component started so far (earlier calls included) is stopped, then the error
        is raised: a daemon that could not start holds nothing.
        """
        for component in components:
            try:
                await component.start()
            except BaseException:
                with contextlib.suppress(Exception):  # logged by stop(); what to raise is why the start failed
                    await self.stop()
                raise
            self._started.append(component)

    async def stop(self) -> None:
        """Stop the started components, the last started first.

        Every one is stopped even when another fails to (the error is logged); the first error is raised once
        all are stopped.
        """
        first: Exception | None = None
        while self._started:
            component = self._started.pop()
            try:
                await component.stop()
            except Exception as exc:
                log.error("stopping the %s failed: %s: %s", component.name, exc.__class__.__name__, exc)
                first = first or exc
        if first is not None:
            raise first
