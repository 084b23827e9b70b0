"""spikehound: finds why AI model serving has p99 latency spikes.

What others use of it: the ``spikehound`` command (``spikehound.cli``) and ``torch_profiling``, the helper a
PyTorch model server may call. Each component below names what its siblings may import in its own
``__all__`` (tests/test_layout.py holds the imports to them).
"""

__version__ = "0.1.0"

__all__ = ["__version__", "torch_profiling"]
