"""spikehound: finds why AI model serving has p99 latency spikes."""

__version__ = "0.1.0"
