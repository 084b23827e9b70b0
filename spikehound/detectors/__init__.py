"""Pure computation on the core model: the streaming detectors and the regression gate's statistics.

No I/O and no clock (tests/test_layout.py): time comes in with the data. What the collector and the CLI use:
``engine`` (the detectors wired together) with its ``settings``; ``critical_path`` (the trace pages); the
regression gate and serving analysis (``profile``, ``compare``, ``batching``, ``breakdown``); and the profile
diff at spike time (``stack_diff``). The other modules are the engine's parts.
"""

__all__ = ["batching", "breakdown", "compare", "critical_path", "engine", "profile", "settings", "stack_diff"]
