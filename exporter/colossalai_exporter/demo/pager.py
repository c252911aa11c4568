"""The demo's pager: a loopback HTTP server standing in for Slack, the on-call
webhook and the Vigilmon heartbeat, so that ``demo --alerting`` can print what each
would have received.

It answers what the real ones answer (Slack's incoming webhook: 200 ``ok`` to a
JSON POST; a webhook: 2xx; a heartbeat: 200 to a GET) and keeps every request.
The standard library's threading server is enough for a handful of requests a
minute, and needs no event loop in the demo's process.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY = 4 << 20  # Alertmanager truncates its own notifications well below this
LONGEST_URL_SHOWN = 160
SLACK_LINK = re.compile(r"<([^|>]+)\|([^>]+)>")  # Slack's mrkdwn <url|text>


@dataclass(frozen=True)
class Received:
    at: float  # time.time()
    path: str  # /slack/<channel>, /webhook/<target>, /heartbeat/<target>
    body: Any  # the JSON body, or None for a heartbeat's GET


class Pager:
    def __init__(self, host: str, port: int) -> None:
        self._lock = threading.Lock()
        self._received: list[Received] = []
        pager = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                pager._keep(Received(time.time(), self.path, None))
                self._answer(200, b"ok")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    self._answer(413, b"too large")
                    return
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw)
                except ValueError:
                    self._answer(400, b"not JSON")
                    return
                pager._keep(Received(time.time(), self.path, body))
                self._answer(200, b"ok")

            def _answer(self, status: int, text: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, *args: Any) -> None:  # the demo prints what matters
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="demo-pager", daemon=True)
        self._thread.start()

    def _keep(self, received: Received) -> None:
        with self._lock:
            self._received.append(received)

    def received(self, since: int = 0) -> list[Received]:
        """Everything received, from the ``since``-th request on."""
        with self._lock:
            return self._received[since:]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def firing(received: Received) -> bool:
    """A Slack message or webhook notification that says something fires."""
    body = received.body
    if not isinstance(body, dict):
        return False
    if received.path.startswith("/slack/"):
        attachments = body.get("attachments") or [{}]
        return "FIRING" in str(attachments[0].get("title", ""))  # the shipped template's
    return any(a.get("status") == "firing" for a in body.get("alerts", []))


def _link(match: re.Match[str]) -> str:
    """A Slack link as a terminal shows it: the text and, unless it is a query too long
    to read, the URL (the Prometheus UI and the alert's Slack message have it whole)."""
    url, text = match.group(1), match.group(2)
    return f"{text}: {url}" if len(url) <= LONGEST_URL_SHOWN else f"{text} (link)"


def describe(received: Received) -> list[str]:
    """The page as on-call reads it: a Slack message's title and text; a webhook's
    firing alerts, one line each (its summary and description)."""
    body = received.body
    if received.path.startswith("/slack/"):
        attachment = (body.get("attachments") or [{}])[0]
        text = SLACK_LINK.sub(_link, str(attachment.get("text", "")))
        return [str(attachment.get("title", "")), *text.splitlines()]
    lines = []
    for alert in body.get("alerts", []):
        if alert.get("status") != "firing":
            continue
        labels, notes = alert.get("labels", {}), alert.get("annotations", {})
        lines.append(f"{labels.get('alertname')} ({labels.get('severity', 'no severity')}): "
                     f"{notes.get('description') or notes.get('summary', '')}")
    return lines
