"""Whether this run is CI's, where a missing tool fails a test instead of skipping it."""

from __future__ import annotations

import os

IN_CI = os.environ.get("CI") == "true"
