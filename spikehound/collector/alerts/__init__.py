"""Alerts: routing, silences, the durable outbox and its delivery (notifiers live in spikehound/collector/notifiers)."""

# What the rest of the collector uses: the daemon and the cluster's leader run ``alerting``; the notifiers
# render a ``notification``; the API reads and writes ``silences``.
__all__ = ["alerting", "notification", "silences"]
