"""Slack incoming webhooks: one Block Kit message per notification.

The message names the stream, its p99 against the baseline and the top
causes with their numbers (and the function that took the CPU when the
spike's profile names one clearly), with buttons to the spike and to its slowest
trace (links on ``collector.public_url``). A resolve notice is a new message
(incoming webhooks cannot edit the first). Block Kit's limits are kept
whatever the names and summaries hold: at most 50 blocks, section text of at
most 3,000 characters, a header of 150, button labels of 75, URLs of 3,000.
Text is escaped, so a service called ``<!channel>`` pings nobody.

>>> escape("a <!here> & b")
'a &lt;!here&gt; &amp; b'
>>> clip("abcdef", 4)
'abc…'
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson

from spikehound.collector.alerts.notification import (
    NO_CAUSE,
    AlertItem,
    Notification,
    affected_summary,
    milliseconds,
    ratio,
)

MAX_BLOCKS = 50
SECTION_TEXT_MAX = 3000
HEADER_TEXT_MAX = 150
BUTTON_TEXT_MAX = 75
URL_MAX = 3000
FALLBACK_TEXT_MAX = 3000
ALERTS_SHOWN = 10  # four blocks each, plus the header and two context lines: 43 blocks at most
CAUSES_SHOWN = 3


def escape(text: str) -> str:
    """Slack's mrkdwn escaping: the three characters that start links, mentions and entities."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _when(unix_nano: int | None) -> str:
    if unix_nano is None:
        return "?"
    return datetime.fromtimestamp(unix_nano / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _cause_lines(item: AlertItem) -> str:
    causes = item.spike.causes
    profile = item.annotations.get("profile")
    if not causes:
        return clip(f"*Top cause:* {NO_CAUSE}" + (f"\n*Profile:* {escape(profile)}" if profile else ""),
                    SECTION_TEXT_MAX)
    lines = ["*Top causes*"]
    for rank, c in enumerate(causes[:CAUSES_SHOWN], 1):
        lines.append(f"{rank}. [{c.kind.value}] {escape(c.summary)} _(explains {c.score:.0%} of the added latency)_")
    # The clear culprit of the spike's profile diff (spikehound/collector/spike_profile.py), when there is one: last.
    tail = [f"*Profile:* {escape(profile)}"] if profile else []
    # Clip cause by cause from the end so the top cause and the profile line always survive.
    text = "\n".join(lines + tail)
    while len(text) > SECTION_TEXT_MAX and len(lines) > 2:
        lines.pop()
        text = "\n".join(lines + tail)
    return clip(text, SECTION_TEXT_MAX)


def _alert_blocks(item: AlertItem, number: int) -> list[dict[str, Any]]:
    s = item.spike
    state = (f"since {_when(item.starts_at_ns)}" if item.status == "firing"
             else f"from {_when(item.starts_at_ns)} to {_when(item.ends_at_ns)}")
    caller = f"{escape(s.peer_service)} -> " if s.peer_service else ""
    # The ratio as the webhook states it (three decimals), so that both receivers show the same number.
    head = (f"{caller}*{escape(s.service)}* `{escape(s.operation)}`\n"
            f"p99 *{milliseconds(s.p99_ns):.1f} ms* against a baseline of *{milliseconds(s.baseline_p99_ns):.1f} ms* "
            f"(*{round(ratio(s), 3):.1f}x*), {state}" + (" — *resolved*" if item.status == "resolved" else ""))
    buttons = []
    if len(item.spike_url) <= URL_MAX:
        buttons.append({"type": "button", "text": {"type": "plain_text", "text": "Spike and causes"},
                        "url": item.spike_url, "action_id": f"spike-{number}"})
    if item.trace_url and len(item.trace_url) <= URL_MAX:
        buttons.append({"type": "button", "text": {"type": "plain_text", "text": "Slowest trace"},
                        "url": item.trace_url, "action_id": f"trace-{number}"})
    blocks: list[dict[str, Any]] = [
        {"type": "section", "text": {"type": "mrkdwn", "text": clip(head, SECTION_TEXT_MAX)}},
        {"type": "section", "text": {"type": "mrkdwn", "text": _cause_lines(item)}},
    ]
    also = affected_summary(s)
    if also:
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": clip(escape(also),
                                                                                       SECTION_TEXT_MAX)}]})
    if buttons:
        blocks.append({"type": "actions", "elements": buttons})
    blocks.append({"type": "divider"})
    return blocks


class SlackNotifier:
    """Renders Block Kit for a Slack incoming webhook (the URL is the credential: ``url_secret``)."""

    def render(self, note: Notification) -> bytes:
        return orjson.dumps(self.message(note))

    def message(self, note: Notification) -> dict[str, Any]:
        items = note.firing if note.status == "firing" else note.alerts
        first = items[0] if items else note.alerts[0]
        s = first.spike
        if note.status == "firing":
            title = (f":red_circle: p99 spike on {s.service} {s.operation}" if len(items) == 1
                     else f":red_circle: p99 spikes on {len(items)} streams of {note.group_labels['service']}")
        else:
            title = f":white_check_mark: Resolved: p99 spike on {s.service} {s.operation}"
        blocks: list[dict[str, Any]] = [
            {"type": "header", "text": {"type": "plain_text", "text": clip(title, HEADER_TEXT_MAX), "emoji": True}}]
        for number, item in enumerate(note.alerts[:ALERTS_SHOWN]):
            blocks.extend(_alert_blocks(item, number))
        hidden = len(note.alerts) - ALERTS_SHOWN
        if hidden > 0:
            blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": clip(
                f"…and {hidden} more streams: {escape(note.external_url)}/api/v1/spikes?state=open",
                SECTION_TEXT_MAX)}]})
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": clip(
            f"spikehound · route {escape(note.route)} · grouped by {escape(note.group_labels['service'])}, "
            f"{escape(note.group_labels['cause'])} · times are event time", SECTION_TEXT_MAX)}]})
        top = s.causes[0].summary if s.causes else NO_CAUSE
        verb = "p99 spike" if note.status == "firing" else "Resolved p99 spike"
        fallback = (f"{verb} on {s.service} {s.operation}: {milliseconds(s.p99_ns):.1f} ms against "
                    f"{milliseconds(s.baseline_p99_ns):.1f} ms. Top cause: {top}")
        return {"text": clip(escape(fallback), FALLBACK_TEXT_MAX), "blocks": blocks[:MAX_BLOCKS]}

    def headers(self, body: bytes, idempotency_key: str, now: float) -> dict[str, str]:
        return {"Content-Type": "application/json; charset=utf-8", "Idempotency-Key": idempotency_key}
