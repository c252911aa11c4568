"""A small ASGI application shared by the project's servers.

Why not Starlette or FastAPI: every server here has a handful of exact-path
routes, and the node agent must stay small in memory and quick to start
(bench/RESULTS.md). What they need — exact routes, HEAD for GET, JSON errors,
a body size cap with a read deadline, basic auth from the web config, and sync
handlers (a scrape) run off the event loop — is about a hundred lines here.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qs

from colossalai_exporter.web.auth import BasicAuthenticator

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes = b""
    client: tuple[str, int] | None = None
    scheme: str = "http"

    def arg(self, name: str) -> str | None:
        """The last value of a query parameter, or None."""
        values = self.query.get(name)
        return values[-1] if values else None

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    content_type: str = "text/plain; charset=utf-8"


# One encoder for every answer: json.dumps(..., sort_keys=True) builds a new
# JSONEncoder on each call, which cost more than encoding a short answer.
_ENCODER = json.JSONEncoder(sort_keys=True)


def json_response(status: int, payload: Any, headers: Iterable[tuple[str, str]] = ()) -> Response:
    return Response(status, (_ENCODER.encode(payload) + "\n").encode(),
                    list(headers), "application/json")


def text_response(status: int, text: str, content_type: str = "text/plain; charset=utf-8",
                  headers: Iterable[tuple[str, str]] = ()) -> Response:
    return Response(status, text.encode(), list(headers), content_type)


def error_response(status: int, reason: str, message: str,
                   headers: Iterable[tuple[str, str]] = ()) -> Response:
    """The one shape of every error the servers return: ``{"error": reason, "message": …}``."""
    return json_response(status, {"error": reason, "message": message}, headers)


Handler = Callable[[Request], Response | Awaitable[Response]]
# Runs before the body is read: returns a Response to refuse the request (a bearer
# token or content type check, say) so that an unauthenticated client cannot make
# the server read its body. Must be quick: it runs on the event loop.
Guard = Callable[[Request], Response | None]
# Sees every response the App sends (errors the App produces itself included), for
# counters such as "requests rejected by reason".
Observer = Callable[[Request, Response], None]


class BodyTooLarge(Exception):
    pass


class App:
    """Routes exact paths to handlers; sync handlers run in a worker thread.

    ``max_body_bytes`` caps request bodies (413), ``body_timeout`` bounds how long
    a client may take to send one (408), and ``authenticator`` applies the web
    config's basic auth to every route (401 with ``WWW-Authenticate``).
    """

    def __init__(
        self,
        *,
        authenticator: BasicAuthenticator | None = None,
        max_body_bytes: int = 1 << 20,
        body_timeout: float = 10.0,
        extra_headers: dict[str, str] | None = None,
        realm: str = "colossalai-exporter",
        observer: Observer | None = None,
    ) -> None:
        self._routes: dict[str, dict[str, Handler]] = {}
        self._guards: dict[str, Guard] = {}
        self._coroutines: set[Handler] = set()
        self._observer = observer
        self._auth = authenticator
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self._extra_headers = list((extra_headers or {}).items())
        self._realm = realm

    def route(self, path: str, methods: Iterable[str] = ("GET",)) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            self.add_route(path, handler, methods)
            return handler

        return register

    def add_route(self, path: str, handler: Handler, methods: Iterable[str] = ("GET",),
                  *, guard: Guard | None = None) -> None:
        """Route ``methods`` on ``path`` to ``handler``; ``guard`` runs before the body is read."""
        table = self._routes.setdefault(path, {})
        for method in methods:
            table[method.upper()] = handler
        if inspect.iscoroutinefunction(handler):  # asked once here, not on every request
            self._coroutines.add(handler)
        if guard is not None:
            self._guards[path] = guard

    async def _read_body(self, receive: Receive, declared: int | None) -> bytes:
        if declared is not None and declared > self.max_body_bytes:
            raise BodyTooLarge
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ConnectionResetError("client went away")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def handle(self, request: Request, receive: Receive) -> Response:
        table = self._routes.get(request.path)
        if table is None:
            return error_response(404, "not_found", f"no route {request.path}")
        method = "GET" if request.method == "HEAD" and "HEAD" not in table else request.method
        handler = table.get(method)
        if handler is None:
            allow = ", ".join(sorted(set(table) | ({"HEAD"} if "GET" in table else set())))
            return error_response(405, "method_not_allowed",
                                  f"{request.method} is not allowed on {request.path}",
                                  [("Allow", allow)])
        if self._auth is not None and self._auth.enabled:
            ok = await asyncio.get_running_loop().run_in_executor(
                None, self._auth.check, request.header("authorization"))
            if not ok:
                return error_response(401, "unauthorized", "missing or wrong credentials",
                                      [("WWW-Authenticate", f'Basic realm="{self._realm}"')])
        guard = self._guards.get(request.path)
        if guard is not None:
            refused = guard(request)
            if refused is not None:
                return refused
        declared = request.header("content-length")
        length = int(declared) if declared and declared.isdigit() else None
        if length == 0 or (declared is None and "transfer-encoding" not in request.headers):
            # No body (HTTP/1.1: neither Content-Length nor Transfer-Encoding, as in a
            # scrape): nothing to read, and no deadline to arm (wait_for costs a task).
            return await self._call(handler, request)
        try:
            # asyncio.wait_for, not asyncio.timeout: the latter needs Python 3.11.
            request.body = await asyncio.wait_for(self._read_body(receive, length),
                                                  self.body_timeout)
        except BodyTooLarge:
            return error_response(413, "too_large",
                                  f"request body over {self.max_body_bytes} bytes")
        except asyncio.TimeoutError:
            return error_response(408, "body_timeout",
                                  f"request body not received within {self.body_timeout:g}s")
        return await self._call(handler, request)

    async def _call(self, handler: Handler, request: Request) -> Response:
        if handler in self._coroutines:
            return await cast("Awaitable[Response]", handler(request))
        result = await asyncio.get_running_loop().run_in_executor(None, handler, request)
        if inspect.isawaitable(result):
            return await result
        return result

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; websockets are not served
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request = Request(
            method=scope["method"],
            path=scope["path"],
            query=parse_qs(scope.get("query_string", b"").decode("latin-1")),
            headers=headers,
            client=tuple(scope["client"]) if scope.get("client") else None,
            scheme=scope.get("scheme", "http"),
        )
        try:
            response = await self.handle(request, receive)
        except ConnectionResetError:
            return
        except Exception:
            log.exception("handler failed", extra={"path": request.path})
            response = error_response(500, "internal", "internal error; see the server log")
        if self._observer is not None:
            try:
                self._observer(request, response)
            except Exception:
                log.exception("response observer failed", extra={"path": request.path})
        raw_headers = [(b"content-type", response.content_type.encode()),
                       (b"content-length", str(len(response.body)).encode())]
        raw_headers += [(k.lower().encode(), v.encode())
                        for k, v in [*self._extra_headers, *response.headers]]
        await send({"type": "http.response.start", "status": response.status,
                    "headers": raw_headers})
        body = b"" if request.method == "HEAD" else response.body
        await send({"type": "http.response.body", "body": body})
