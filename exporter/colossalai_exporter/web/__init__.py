"""HTTP serving shared by every server of the project.

* :mod:`.config` reads the exporter web config file (TLS, client certificates,
  bcrypt ``basic_auth_users``) that Go exporters share.
* :mod:`.app` is a small ASGI application: exact-path routes, body size cap,
  JSON errors, basic auth, sync handlers run off the event loop.
* :mod:`.server` runs it under uvicorn on a socket bound up front (so a bad
  listen address is a clear error) and returns a handle that stops it.
"""

from colossalai_exporter.web.app import App, Request, Response, json_response, text_response
from colossalai_exporter.web.config import WebConfig, load_web_config
from colossalai_exporter.web.metrics import metrics_response
from colossalai_exporter.web.server import (
    ServerHandle,
    parse_listen_address,
    serve,
    stop_on_signals,
)

__all__ = [
    "App",
    "Request",
    "Response",
    "ServerHandle",
    "WebConfig",
    "json_response",
    "load_web_config",
    "metrics_response",
    "parse_listen_address",
    "serve",
    "stop_on_signals",
    "text_response",
]
