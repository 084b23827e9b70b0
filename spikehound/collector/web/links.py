"""URLs of the web pages, for whoever links to them (the CLI, alerts, the pages themselves).

>>> spike_page_url("http://collector:8470/", "e4953d46f76c6733")
'http://collector:8470/ui/spikes/e4953d46f76c6733'
>>> trace_page_path("4BF92F3577B34DA6A3CE929D0E0E4736", "00f067aa0ba902b7")
'/ui/traces/4bf92f3577b34da6a3ce929d0e0e4736#span-00f067aa0ba902b7'
>>> trace_page_path("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", expand="00f067aa0ba902b7")
'/ui/traces/4bf92f3577b34da6a3ce929d0e0e4736?expand=00f067aa0ba902b7#span-00f067aa0ba902b7'
"""

from __future__ import annotations

from urllib.parse import quote

PREFIX = "/ui"


def spike_page_path(spike_id: str) -> str:
    return f"{PREFIX}/spikes/{quote(spike_id, safe='')}"


def trace_page_path(trace_id: str, span_id: str | None = None, *, expand: str | None = None) -> str:
    """The trace's page, scrolled to ``span_id``; ``expand`` names a group of repeated spans to show unfolded."""
    path = f"{PREFIX}/traces/{quote(trace_id.lower(), safe='')}"
    if expand:
        path += f"?expand={quote(expand, safe='')}"
    return f"{path}#span-{quote(span_id, safe='')}" if span_id else path


def spike_page_url(base_url: str, spike_id: str) -> str:
    """The spike's page on the collector whose API is at ``base_url``."""
    return base_url.rstrip("/") + spike_page_path(spike_id)
