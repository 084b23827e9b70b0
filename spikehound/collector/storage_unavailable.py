"""The error a sender's wait for its commit ends with when storage failed.

Its own module, so that the receivers' shared path (``spikehound.collector.ingest``) and
the pipeline that raises it can both import it without importing the detection
engine.
"""

from __future__ import annotations


class StorageUnavailable(Exception):
    """The batch could not be committed; the sender should retry."""
