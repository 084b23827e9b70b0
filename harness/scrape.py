"""A daemon's Prometheus ``/metrics``, scraped and parsed: the one way the tests and the harness read it.

A sample is keyed by its name and its labels, sorted: ``("spikehound_ingest_queue_items", ())`` is the
unlabelled one. Which sample a caller means is the caller's to say: ``sample`` is the one with exactly the
labels given, ``total`` the sum of every sample whose labels include them.

>>> samples = parse('a_total{kind="x"} 2.5\\na_total{kind="y"} 3.5\\nb 7.5\\n')
>>> sample(samples, "a_total", kind="x"), sample(samples, "b"), sample(samples, "a_total")
(2.5, 7.5, None)
>>> total(samples, "a_total"), total(samples, "a_total", kind="y"), total(samples, "c")
(6.0, 3.5, 0.0)
"""

from __future__ import annotations

import requests
from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]


def scrape_text(url: str, timeout: float = 10) -> str:
    """The exposition text of ``{url}/metrics``."""
    r = requests.get(f"{url}/metrics", timeout=timeout)
    r.raise_for_status()
    return r.text


def parse(text: str) -> Samples:
    """Every sample of an exposition text: (name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str, timeout: float = 10) -> Samples:
    """Every sample ``{url}/metrics`` shows now."""
    return parse(scrape_text(url, timeout))


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample called ``name`` with exactly ``labels`` (none: the unlabelled one); None when there is none."""
    return samples.get((name, tuple(sorted(labels.items()))))


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``; 0 when there are none."""
    wanted = set(labels.items())
    return sum((value for (sample_name, sample_labels), value in samples.items()
                if sample_name == name and wanted <= set(sample_labels)), 0.0)
