"""Alerts to a Slack-compatible incoming webhook, never in the run's way.

    alerter = Alerter(url, run="tiny-0", record=lambda row: ...)
    alerter.alert(key="nonfinite:rl:5", event="nonfinite", message=..., evidence=..., action=...)
    alerter.close()                     # waits (bounded) for what is queued

Choices:

1. **The format is Slack's incoming webhook**: an HTTP POST of
   ``{"text": "..."}`` as JSON, the text naming the run, the event, the evidence and
   the action taken. Mattermost, Discord's ``/slack`` endpoints and most chat tools
   accept the same body. The URL comes from the watchdog's config or
   ``$CURSOR_RL_ALERT_WEBHOOK``; without one, alerts only go to the event log.
2. **Never blocks training**: ``alert`` puts the message on a bounded queue and
   returns; one background thread posts with a timeout. A full queue drops the
   message (counted), a failed or slow post is counted and given up after
   ``retries``; every alert, sent or not, is first recorded in the event log
   (``record``), so nothing is only in flight. Delivery is at least once: a post
   that times out after the server read it is retried and may arrive twice, which
   we prefer to an alert lost to a slow receiver.
3. **Deduplicated and rate-limited**: one alert per ``key`` (a fault is announced
   once however often it is seen), at most ``max_per_hour`` in all; the rest are
   recorded as suppressed.
4. Only the standard library (``urllib``): nothing to install, no network at import.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

WEBHOOK_ENV = "CURSOR_RL_ALERT_WEBHOOK"


def format_text(
    run: str, event: str, message: str, evidence: Mapping[str, Any], action: str
) -> str:
    """The alert's text: one line each for the run, the event, the evidence, the action."""
    shown = json.dumps(dict(evidence), default=str, sort_keys=True)
    if len(shown) > 1500:
        shown = shown[:1500] + "…"
    return (
        f":rotating_light: *cursor_rl watchdog* — run `{run}`\n"
        f"*event*: {event}: {message}\n"
        f"*evidence*: `{shown}`\n"
        f"*action*: {action}"
    )


class Alerter:
    """Posts alerts from a background thread (see the module docstring)."""

    def __init__(
        self,
        url: str | None,
        *,
        run: str,
        record: Callable[[dict[str, Any]], Any] = lambda row: None,
        timeout_s: float = 5.0,
        retries: int = 2,
        max_queue: int = 64,
        max_per_hour: int = 30,
        clock: Callable[[], float] = time.time,
    ):
        self.url = url if url is not None else os.environ.get(WEBHOOK_ENV) or None
        self.run = run
        self.record = record
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.max_per_hour = int(max_per_hour)
        self.clock = clock
        self.counts = collections.Counter()  # sent, failed, dropped, suppressed, duplicate
        self._seen: set[str] = set()
        self._recent: collections.deque[float] = collections.deque()
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None
        if self.url:
            self._thread = threading.Thread(target=self._post_loop, name="alerts", daemon=True)
            self._thread.start()

    def alert(
        self,
        *,
        key: str,
        event: str,
        message: str,
        evidence: Mapping[str, Any] | None = None,
        action: str = "none",
    ) -> str:
        """Records the alert and queues it for the webhook; returns its fate
        (``queued``, ``logged`` without a URL, ``duplicate``, ``suppressed``, ``dropped``)."""
        evidence = dict(evidence or {})
        row = {"event": "alert", "key": key, "kind": event, "message": message, "action": action}
        if key in self._seen:
            self.counts["duplicate"] += 1
            return "duplicate"
        self._seen.add(key)
        now = self.clock()
        while self._recent and now - self._recent[0] > 3600:
            self._recent.popleft()
        if len(self._recent) >= self.max_per_hour:
            self.counts["suppressed"] += 1
            self.record({**row, "delivery": "suppressed"})
            return "suppressed"
        self._recent.append(now)
        if not self.url:
            self.record({**row, "delivery": "logged"})
            return "logged"
        text = format_text(self.run, event, message, evidence, action)
        try:
            self._queue.put_nowait({"key": key, "text": text})
        except queue.Full:
            self.counts["dropped"] += 1
            self.record({**row, "delivery": "dropped (queue full)"})
            return "dropped"
        self.record({**row, "delivery": "queued"})
        return "queued"

    def _post_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._post(item)

    def _post(self, item: dict[str, Any]) -> None:
        body = json.dumps({"text": item["text"]}).encode()
        error = None
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(
                self.url, data=body, headers={"Content-Type": "application/json"}, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    response.read()
                self.counts["sent"] += 1
                return
            except (urllib.error.URLError, OSError, ValueError) as e:
                error = e
                time.sleep(min(0.5 * (attempt + 1), 2.0))
        self.counts["failed"] += 1
        log.warning("alert %s not delivered: %s", item["key"], error)
        self.record({"event": "alert_failed", "key": item["key"], "error": str(error)})

    def close(self, timeout_s: float = 10.0) -> None:
        """Lets queued alerts go out (for at most ``timeout_s``), then stops the thread."""
        if self._thread is None:
            return
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)
        self._thread = None
