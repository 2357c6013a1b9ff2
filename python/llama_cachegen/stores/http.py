"""A store over HTTP: the client (urllib) and the server behind `llama-cachegen serve`.

Protocol: `GET /key` returns the value (and marks it used), `PUT /key` stores the request body
atomically, `HEAD /key` answers 200 with Content-Length or 404, `DELETE /key` removes it,
`GET /prefix/` (a path ending in '/') lists the entries under it as JSON
`[{"key": ..., "size": ..., "mtime": ...}]`. The server keeps the values in a FileStore.
"""

from __future__ import annotations

import contextlib
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ..errors import CacheGenError, EntryNotFoundError, StoreError
from . import EntryInfo, Store, check_key
from .file import FileStore

MAX_BODY = 8 << 30  # refuse uploads beyond this: a state of 8 GiB is already far past any real one


class HttpStore(Store):
    def __init__(self, url: str, *, timeout: float = 60.0) -> None:
        parts = urllib.parse.urlsplit(url)
        self.url = url.rstrip("/")
        self._base = urllib.parse.urlunsplit((parts.scheme, parts.netloc, "", "", ""))
        self._root = "/".join(s for s in parts.path.split("/") if s)  # a key prefix on the server
        self._timeout = timeout

    def _url(self, key: str, *, listing: bool = False) -> str:
        path = "/".join(s for s in (self._root, key) if s)
        return f"{self._base}/{urllib.parse.quote(path)}" + ("/" if listing and path else "")

    def _request(self, method: str, key: str, data: bytes | None = None, *, listing: bool = False) -> Any:
        url = self._url(key if listing else check_key(key), listing=listing)
        request = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/octet-stream")
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                return response.status, response.headers, response.read()
        except urllib.error.HTTPError as exc:
            if exc.code == HTTPStatus.NOT_FOUND:
                raise EntryNotFoundError(f"{key!r} not in {self.url}") from None
            raise StoreError(f"HTTP {method} {url}: {exc.code} {exc.reason}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise StoreError(f"HTTP {method} {url}: {exc}") from exc

    def get(self, key: str) -> bytes:
        return self._request("GET", key)[2]

    def put(self, key: str, data: bytes) -> None:
        self._request("PUT", key, bytes(data))

    def delete(self, key: str) -> bool:
        try:
            self._request("DELETE", key)
        except EntryNotFoundError:
            return False
        return True

    def exists(self, key: str) -> bool:
        try:
            self._request("HEAD", key)
        except EntryNotFoundError:
            return False
        return True

    def list(self, prefix: str = "") -> list[EntryInfo]:
        # the server lists folders; filter the rest of the prefix here
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        try:
            body = self._request("GET", folder, listing=True)[2]
        except EntryNotFoundError:
            return []
        strip = len(self._root) + 1 if self._root else 0
        entries = (EntryInfo(e["key"][strip:], int(e["size"]), float(e["mtime"])) for e in json.loads(body))
        return [e for e in entries if e.key.startswith(prefix)]

    def touch(self, key: str) -> None:
        """Nothing to do: the server marks an entry used on every GET."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _StoreServer

    def _key(self) -> tuple[str, bool]:
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        key = path.strip("/")
        return key, path.endswith("/")

    def _reply(
        self,
        status: HTTPStatus,
        body: bytes = b"",
        content_type: str = "application/octet-stream",
        length: int | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _fail(self, status: HTTPStatus, message: str) -> None:
        self._reply(status, message.encode() + b"\n", "text/plain; charset=utf-8")

    def _guard(self, fn: Any) -> None:
        try:
            fn()
        except EntryNotFoundError:
            self._fail(HTTPStatus.NOT_FOUND, "not found")
        except CacheGenError as exc:  # a bad key or a store failure: answer, never crash the server
            self._fail(HTTPStatus.BAD_REQUEST, str(exc))

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        key, listing = self._key()

        def run() -> None:
            store = self.server.store
            if listing or not key:
                if key:
                    check_key(key)
                entries = store.list(f"{key}/" if key else "")
                body = json.dumps(
                    [{"key": e.key, "size": e.size, "mtime": e.mtime} for e in entries]
                ).encode()
                self._reply(HTTPStatus.OK, body, "application/json")
                return
            data = store.get(key)
            store.touch(key)
            self._reply(HTTPStatus.OK, data)

        self._guard(run)

    def do_HEAD(self) -> None:  # noqa: N802
        key, _ = self._key()

        def run() -> None:
            path = self.server.store.root.joinpath(*check_key(key).split("/"))
            if not path.is_file():
                raise EntryNotFoundError(key)
            self._reply(HTTPStatus.OK, length=path.stat().st_size)

        self._guard(run)

    def do_PUT(self) -> None:  # noqa: N802
        key, _ = self._key()

        def run() -> None:
            check_key(key)
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._fail(HTTPStatus.LENGTH_REQUIRED, "Content-Length required")
                return
            if not 0 <= length <= MAX_BODY:
                self._fail(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY} bytes")
                return
            data = self.rfile.read(length)
            if len(data) != length:  # the client went away mid-upload: store nothing
                self.close_connection = True
                return
            self.server.store.put(key, data)
            self._reply(HTTPStatus.CREATED)

        self._guard(run)

    def do_DELETE(self) -> None:  # noqa: N802
        key, _ = self._key()

        def run() -> None:
            if not self.server.store.delete(key):
                raise EntryNotFoundError(key)
            self._reply(HTTPStatus.NO_CONTENT)

        self._guard(run)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if self.server.verbose:
            super().log_message(format, *args)


class _StoreServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], store: FileStore, verbose: bool) -> None:
        super().__init__(address, _Handler)
        self.store = store
        self.verbose = verbose


def make_server(
    directory: str | Path, host: str = "127.0.0.1", port: int = 0, *, verbose: bool = False
) -> ThreadingHTTPServer:
    """An HTTP store server over `directory`; port 0 picks a free port (see `server_address`)."""
    return _StoreServer((host, port), FileStore(directory), verbose)


def serve(directory: str | Path, host: str = "127.0.0.1", port: int = 8080, *, verbose: bool = False) -> None:
    """Serves `directory` until interrupted; prints the URL once listening."""
    with make_server(directory, host, port, verbose=verbose) as server:
        bound_host, bound_port = server.server_address[:2]
        print(
            f"llama-cachegen: serving {Path(directory).resolve()} at http://{bound_host}:{bound_port}/",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever()
