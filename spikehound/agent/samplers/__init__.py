"""Agent samplers: each has a ``name``, ``start() -> bool``, ``sample() -> list[Sample]`` and ``close()``."""
