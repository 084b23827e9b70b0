"""Alerts: routing, silences, the durable outbox and its delivery (notifiers live in spikehound/collector/notifiers)."""
