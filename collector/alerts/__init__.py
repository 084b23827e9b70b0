"""Alerts: routing, silences, the durable outbox and its delivery (notifiers live in collector/notifiers)."""
