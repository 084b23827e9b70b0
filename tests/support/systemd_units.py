"""The unit files in systemd/ as systemd reads them: the [Service] settings the daemons' tests rely on."""

from __future__ import annotations

import configparser
from pathlib import Path

UNITS = Path(__file__).resolve().parents[2] / "systemd"  # tests/support/ -> the repository root


def unit_seconds(unit: str, key: str) -> float:
    """A time setting of the unit's [Service] section, in seconds."""
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.read(UNITS / unit)
    return float(parser["Service"][key])


def service_section(unit: str) -> dict[str, list[str]]:
    """The [Service] section with every value of repeated keys."""
    values: dict[str, list[str]] = {}
    section = ""
    for line in (UNITS / unit).read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values.setdefault(key, []).append(value)
    return values
