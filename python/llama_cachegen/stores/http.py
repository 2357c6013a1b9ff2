"""A store over HTTP: the client (urllib3, pooled keep-alive connections) and the server behind
`llama-cachegen serve` (aiohttp).

Protocol: `GET /key` returns the value (and marks it used), `PUT /key` stores the request body
atomically, `HEAD /key` answers 200 with Content-Length or 404, `DELETE /key` removes it (with
`X-Unused-Since: <mtime>` only if it was not written or used since: else 412),
`GET /prefix/` (a path ending in '/') lists the entries under it as JSON
`[{"key": ..., "size": ..., "mtime": ...}]`, `POST /prefix/` with the JSON
`{"mark_used": [key, ...]}` marks those keys under the prefix used now, in that order (on the
server's clock: a client's may differ), and with `{"exists": [key, ...]}` answers a JSON list of
booleans, one HEAD per key in one request (a prefix lookup asks about every level of every
chunk). The server keeps the values in a FileStore.

Access: a server started with a token (`--token-file`, or LLAMA_CACHEGEN_TOKEN) takes writes,
deletes and listings only with `Authorization: Bearer <token>`; reads of single keys stay open
unless it is private. Without a token it listens on loopback addresses only. The client sends
its `token=` or LLAMA_CACHEGEN_TOKEN. A token decides who may write; an object's HMAC tag
(`auth_key`, see stores/__init__.py) decides whether a reader trusts what it gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import socket
import sys
import threading
import time
import urllib.parse
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import urllib3
from aiohttp import HttpVersion11, web

from ..errors import EntryNotFoundError, InvalidArgumentError, StoreError
from . import AuthKey, EntryInfo, Store, check_key, is_key, redact
from .file import FileStore, PendingWrite

TOKEN_ENV = "LLAMA_CACHEGEN_TOKEN"
MAX_BODY = 8 << 30  # refuse uploads beyond this: a state of 8 GiB is already far past any real one
MAX_POST_BODY = 1 << 20  # a mark_used or exists request's JSON: ~10,000 keys (a 128K context's chain: ~1,500)
POSTS_AT_ONCE = 4  # such requests parsed at once: one takes ~20 MB of Python objects at most
EXISTS_BODY = MAX_POST_BODY // 2  # bytes of keys per exists request a client sends (~5,000 chunk keys)
# an exists request answered so: a server that does not take it (or not from this client)
_REFUSED = frozenset({400, 401, 403, 405, 413, 501})
BODY_TIMEOUT_S = 60.0  # an upload that sends nothing for this long is dropped
KEEPALIVE_S = 30.0  # idle connections (and connections that never send a request) are closed
SWEEP_EVERY_S = 600.0  # how often the server removes the temporaries of uploads that died
_CHUNK = 1 << 20
_log = logging.getLogger("llama_cachegen.serve")
_READ_PIECE = 1 << 18  # the most a client's read takes at once (it counts its progress per read)
# bytes/s a reply's body must average past the read timeout: the timeout bounds each read only,
# and a server sending a byte every 2 s held a get (a prompt cache's completion) for as long as
# its body lasted
_MIN_BODY_RATE = 4 << 10


def _too_slow(began: float, timeout: float, size: int) -> bool:
    """Whether a body begun at `began` (time.monotonic) has come, `size` bytes so far, under
    _MIN_BODY_RATE past `timeout`: the rule a client's reads and the server's uploads share."""
    late = time.monotonic() - began - timeout
    return late > 0 and size < late * _MIN_BODY_RATE


# a DELETE's condition: the entry's mtime (from a listing) it must not be past, else 412
_UNUSED_SINCE = "X-Unused-Since"


def load_token(token_file: str | Path | None = None, env: str = TOKEN_ENV) -> str | None:
    """The server's token: the stripped content of `token_file`, else the variable `env`."""
    if token_file is None:
        token = os.environ.get(env, "").strip()
        return _check_token(token) if token else None
    try:
        token = Path(token_file).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(f"cannot read the token file {token_file}: {exc}") from exc
    if not token:
        raise InvalidArgumentError(f"the token file {token_file} is empty")
    return _check_token(token)


def _check_token(token: str) -> str:
    """A token an HTTP header can carry (visible ASCII): any other cannot be sent, so no client
    could be let in (and the client failed with a traceback)."""
    if not re.fullmatch(r"[\x21-\x7e]+", token):
        raise InvalidArgumentError("a token must be visible ASCII characters (no spaces, no control bytes)")
    return token


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name, or "" (every interface)
        return False


def _loopback_name(host: str) -> bool:
    """True when a request's Host header (a name or address, with or without a port) is loopback."""
    try:
        name = urllib.parse.urlsplit("//" + host).hostname or ""
    except ValueError:  # an unbalanced bracket
        return False
    return is_loopback(name.rstrip("."))


def bearer_ok(header: str | None, token: str) -> bool:
    """True when an Authorization header carries `token` (constant-time comparison)."""
    scheme, _, given = (header or "").partition(" ")
    # aiohttp keeps a header's undecodable bytes as surrogates: they compare, never raise
    given_bytes = given.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(given_bytes, token.encode())


class _Reader:
    """A thread's GET in flight on one HttpStore, for close() to end."""

    __slots__ = ("connection", "response", "cancelled", "stopped", "received", "__weakref__")

    def __init__(self) -> None:
        self.connection: Any = None  # while its request is sent and waits for the reply's headers
        self.response: urllib3.BaseHTTPResponse | None = None  # once its reply's headers are in
        self.cancelled = False  # closed while its request waited for the reply (or was retried)
        self.stopped = False  # cancel(): this read and every later one on the thread end at once
        self.received = 0  # body bytes this thread's gets have read, in all

    def end(self) -> None:
        """Shuts the reply in flight down, or the connection still waiting for one."""
        response, connection = self.response, self.connection  # read once: the reader clears them
        sock = getattr(connection, "sock", None)  # read once: the reading thread may close it
        with contextlib.suppress(RuntimeError, ValueError, OSError):  # already back in the pool
            if response is not None:
                response.shutdown()
            elif sock is not None:
                sock.shutdown(socket.SHUT_RDWR)


# the _Reader whose GET this thread is sending: its connection registers there (_Cancellable)
_sending = threading.local()


class _Cancellable:
    """A connection that a reader's cancel() or close() ends while its request waits for the
    reply's headers (a server that never answered held each fetch a streaming load had given up on
    for the whole read timeout, its thread and socket with it: 130 of them after 12 loads)."""

    def request(self, *args: Any, **kwargs: Any) -> None:
        reader = getattr(_sending, "reader", None)
        if reader is not None:
            reader.connection = self
        super().request(*args, **kwargs)  # type: ignore[misc]

    def getresponse(self) -> Any:
        reader = getattr(_sending, "reader", None)
        if reader is not None and reader.cancelled:  # cancelled before the socket was there to shut
            raise urllib3.exceptions.ProtocolError("the read was cancelled")
        response = super().getresponse()  # type: ignore[misc]
        if reader is not None:  # the headers are in: cancel() shuts the response from now on, and
            reader.connection = None  # this connection may go back to the pool for another request
        return response


class _Connection(_Cancellable, urllib3.connection.HTTPConnection):
    pass


class _TlsConnection(_Cancellable, urllib3.connection.HTTPSConnection):
    pass


class _Pool(urllib3.HTTPConnectionPool):
    ConnectionCls = _Connection


class _TlsPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _TlsConnection


class _Retry(urllib3.Retry):
    """urllib3's retries, but not after a read timeout: the server took the request and did not
    answer for the whole timeout; trying again would triple the wait (a frozen server held a
    load 3 minutes)."""

    def increment(self, *args: Any, **kwargs: Any) -> urllib3.Retry:
        reader = getattr(_sending, "reader", None)
        cancelled = reader is not None and reader.cancelled  # a shut connection is not tried again
        error = kwargs.get("error")  # None for a redirect or a status to retry
        if error is not None and (cancelled or isinstance(error, urllib3.exceptions.ReadTimeoutError)):
            raise error
        return super().increment(*args, **kwargs)


class HttpStatusError(StoreError):
    """A store error the server answered with an HTTP status (http_status)."""

    def __init__(self, http_status: int, message: str) -> None:
        super().__init__(message)
        self.http_status = http_status


def _batches(keys: list[str], max_bytes: int) -> Iterator[list[str]]:
    """`keys` in order, in runs whose JSON list stays under max_bytes."""
    batch: list[str] = []
    size = 0
    for key in keys:
        if batch and size + len(key) + 4 > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(key)
        size += len(key) + 4  # quotes, comma, space
    if batch:
        yield batch


class HttpStore(Store):
    def __init__(
        self,
        url: str,
        *,
        auth_key: AuthKey = None,
        token: str | None = None,
        timeout: float = 60.0,
        connect_timeout: float = 10.0,
    ) -> None:
        super().__init__(auth_key=auth_key)
        parts = urllib.parse.urlsplit(url)
        if "@" in parts.netloc:  # urllib3 never sends a URL's user:password: they went unused
            raise InvalidArgumentError(f"{redact(url)}: no credentials in an HTTP store's URL; use token=")
        self.url = redact(url.rstrip("/"))  # for messages; requests go to _base
        self._timeout = timeout
        self._base = urllib.parse.urlunsplit((parts.scheme, parts.netloc, "", "", ""))
        self._root = "/".join(s for s in parts.path.split("/") if s)  # a key prefix on the server
        token = os.environ.get(TOKEN_ENV, "").strip() if token is None else token
        self._headers = {"Authorization": f"Bearer {_check_token(token)}"} if token else {}
        self.bulk_exists = True  # False once the server refused an exists request
        # each reading thread's GET in flight (close ends them); an entry lives as long as its
        # thread (a thread-local holds it)
        self._local = threading.local()
        self._readers: weakref.WeakValueDictionary[int, _Reader] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        # idempotent requests only: a dropped keep-alive connection is retried on a fresh one
        # (before the reply's headers; a body cut short is the caller's to fetch again)
        self._pool = urllib3.PoolManager(
            maxsize=4,
            timeout=urllib3.Timeout(connect=connect_timeout, read=timeout),
            # a reply's Retry-After is not obeyed: urllib3 waits up to 6 hours per retry, past any
            # timeout and cancel() (a 503 with Retry-After: 10 held a get for 20 s)
            retries=_Retry(total=2, redirect=False, raise_on_status=False, respect_retry_after_header=False),
        )
        self._pool.pool_classes_by_scheme = {"http": _Pool, "https": _TlsPool}

    def tag_name(self, key: str) -> str:
        """The key's path on the server: the same object read through `read_url` verifies too."""
        return "/".join(s for s in (self._root, key) if s)

    def _url(self, key: str, *, listing: bool = False) -> str:
        path = self.tag_name(key)
        return f"{self._base}/{urllib.parse.quote(path)}" + ("/" if listing and path else "")

    def _request(
        self,
        method: str,
        key: str,
        data: bytes | None = None,
        *,
        listing: bool = False,
        preload: bool = True,
        headers: dict[str, str] | None = None,
    ) -> urllib3.BaseHTTPResponse:
        url = self._url(key if listing else check_key(key), listing=listing)
        headers = {**self._headers, **(headers or {})}
        if data is not None:
            headers["Content-Type"] = "application/octet-stream"
        try:
            # bodies as sent: the server never compresses, and a reply that says gzip would be
            # inflated without bound (50 KB became 50 MiB)
            response = self._pool.request(
                method, url, body=data, headers=headers, preload_content=preload, decode_content=False
            )
        except urllib3.exceptions.HTTPError as exc:
            raise StoreError(f"HTTP {method} {redact(url)}: {exc}") from exc
        head = response.data[:300] if preload else b""
        if response.status >= 300 and not preload:  # an error's body: read here, or the connection is lost
            try:
                head = response.read(300)
                response.drain_conn()
            except urllib3.exceptions.HTTPError as exc:  # a timeout, or a cancel() meanwhile
                raise StoreError(f"HTTP {method} {redact(url)}: {response.status}, then: {exc}") from exc
            finally:
                response.release_conn()
        if response.status == 404:
            raise EntryNotFoundError(f"{key!r} not in {self.url}")
        if response.status in (401, 403):
            hint = (
                "the server refused this token"
                if "Authorization" in self._headers
                else f"the server needs a token: token= or {TOKEN_ENV}"
            )
            raise HttpStatusError(
                response.status, f"HTTP {method} {redact(url)}: {response.status} {response.reason} ({hint})"
            )
        if response.status >= 300:  # a redirect is not followed (redirect=False): nothing was stored or read
            detail = head.decode("utf-8", "replace").strip()
            raise HttpStatusError(
                response.status, f"HTTP {method} {redact(url)}: {response.status} {response.reason}: {detail}"
            )
        return response

    def _get(self, key: str, limit: int | None) -> bytes:
        reader = getattr(self._local, "reader", None)
        if reader is None:
            reader = self._local.reader = _Reader()
            with self._lock:
                self._readers[threading.get_ident()] = reader
        reader.cancelled = reader.stopped
        if reader.stopped:
            raise StoreError(f"HTTP GET {self._url(key)}: reads on this thread were cancelled")
        _sending.reader = reader
        try:
            response = self._request("GET", key, preload=False)
        finally:
            _sending.reader = reader.connection = None
        began = time.monotonic()  # the body's clock: the headers had their own timeout (and retries)
        reader.response = response
        try:
            if reader.cancelled:
                response.shutdown()
                raise StoreError(f"HTTP GET {self._url(key)}: the read was cancelled")
            declared = response.headers.get("Content-Length", "")
            if limit is not None and declared.isdigit() and int(declared) > limit:
                response.shutdown()
                raise self._over(key, limit)
            pieces, size = [], 0
            while piece := response.read1(_READ_PIECE):  # what has arrived, up to a piece
                pieces.append(piece)
                reader.received += len(piece)
                size += len(piece)
                if limit is not None and size > limit:
                    response.shutdown()
                    raise self._over(key, limit)
                if _too_slow(began, self._timeout, size):
                    response.shutdown()
                    raise StoreError(
                        f"HTTP GET {self._url(key)}: {size} bytes in {time.monotonic() - began:.0f} s, "
                        f"under {_MIN_BODY_RATE} bytes/s past the {self._timeout:g} s timeout"
                    )
            if reader.cancelled:  # shut down between two pieces: what came is not the whole body
                raise StoreError(f"HTTP GET {self._url(key)}: the read was cancelled")
            return b"".join(pieces)
        except urllib3.exceptions.HTTPError as exc:
            raise StoreError(f"HTTP GET {self._url(key)}: the body broke off: {exc}") from exc
        finally:
            reader.response = None
            response.release_conn()

    def _put(self, key: str, data: bytes) -> None:
        self._request("PUT", key, data)

    def delete(self, key: str, *, unused_since: float | None = None) -> bool:
        headers = {} if unused_since is None else {_UNUSED_SINCE: repr(float(unused_since))}
        try:
            self._request("DELETE", key, headers=headers)
        except EntryNotFoundError:
            return False
        except HttpStatusError as exc:
            if exc.http_status != 412:  # 412: used since (a server before the header deletes)
                raise
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
            body = self._request("GET", folder, listing=True).data
        except EntryNotFoundError:
            return []
        root = f"{self._root}/" if self._root else ""
        try:
            entries = [
                EntryInfo(e["key"][len(root) :], int(e["size"]), float(e["mtime"]))
                for e in json.loads(body)
                if e["key"].startswith(root)  # a server's keys outside this store are none of its own
            ]
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as exc:
            raise StoreError(f"unreadable listing from {self.url}: {exc}") from exc
        return [e for e in entries if e.key.startswith(prefix) and is_key(e.key)]

    def mark_used(self, keys: Sequence[str]) -> None:
        if keys:  # one request (the server marks each GET too, but in the order of the reads)
            body = json.dumps({"mark_used": [check_key(k) for k in keys]}).encode()
            self._request("POST", "", body, listing=True)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """One request per EXISTS_BODY bytes of keys. A server that refuses it (a token this client
        lacks: POSTs need one; a server before this request) is asked key by key from then on,
        as reads are; one that fails raises, as a HEAD would."""
        out: list[bool] = []
        for batch in _batches([check_key(k) for k in keys], EXISTS_BODY) if self.bulk_exists else ():
            try:
                answer = self._request("POST", "", json.dumps({"exists": batch}).encode(), listing=True)
                flags = json.loads(answer.data)
            except (EntryNotFoundError, HttpStatusError) as exc:
                if isinstance(exc, HttpStatusError) and exc.http_status not in _REFUSED:
                    raise
                self.bulk_exists = False
                break
            except ValueError as exc:
                raise StoreError(f"HTTP POST {self.url}: the exists answer is not JSON ({exc})") from exc
            if not (
                isinstance(flags, list)
                and len(flags) == len(batch)
                and all(isinstance(f, bool) for f in flags)
            ):
                raise StoreError(f"HTTP POST {self.url}: the exists answer is not one boolean per key")
            out += flags
        return out + [self.exists(k) for k in keys[len(out) :]]

    def _reader_of(self, thread_id: int) -> _Reader | None:
        with self._lock:
            return self._readers.get(thread_id)

    def received(self, thread_id: int) -> int | None:
        reader = self._reader_of(thread_id)
        return None if reader is None else reader.received

    def cancel(self, thread_id: int) -> bool:
        reader = self._reader_of(thread_id)
        if reader is None:  # no read begun on that thread
            return False
        reader.cancelled = reader.stopped = True
        reader.end()
        return True

    def close(self) -> None:
        """Ends the reads still in flight too (a fetch a streaming load gave up on, still on its
        thread), which would otherwise take the link's bandwidth from the requests after them."""
        with self._lock:
            readers = list(self._readers.values())
        for reader in readers:
            reader.cancelled = True
            reader.end()
        self._pool.clear()


# --- server ------------------------------------------------------------------------------------


def _text(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=message + "\n")


def _closing(status: int, message: str) -> web.Response:
    """A reply after which the connection closes: its unread body is never parsed."""
    response = _text(status, message)
    response.force_close()
    return response


class _Server:
    def __init__(
        self, store: FileStore, token: str | None, private: bool, max_body: int, body_timeout: float
    ):
        self.store, self.token, self.private = store, token, private
        self.max_body, self.body_timeout = max_body, body_timeout
        self.posts = asyncio.Semaphore(POSTS_AT_ONCE)

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def sweeping(self, _app: web.Application) -> AsyncIterator[None]:
        """Removes the temporaries of uploads that never finished (a server killed mid-PUT; a
        client's partial write is removed as it fails) at start-up and every SWEEP_EVERY_S: they
        take space, and no client sees them to count or sweep."""

        async def sweep_forever() -> None:
            while True:
                try:
                    await self._run(self.store.sweep)
                except Exception:  # logged; the next round tries again
                    _log.exception("sweep failed")
                await asyncio.sleep(SWEEP_EVERY_S)

        task = asyncio.create_task(sweep_forever())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def _refusal(self, request: web.Request) -> web.StreamResponse | None:
        """The answer to a request refused on its head alone (method, token, encoding, the size its
        body declares); None: go on."""
        path = request.path
        listing = path.endswith("/") or not path.strip("/")
        if self.token is None and (not _loopback_name(request.host) or "Origin" in request.headers):
            # without a token only this machine's clients are served, and a web page is none: a
            # name rebound to 127.0.0.1 reaches the port with its own Host, and a cross-site form
            # POST needs no preflight (both wrote, read and deleted entries)
            return _closing(421, "without a token only requests to a loopback name, from no web page")
        if request.method not in ("GET", "HEAD", "PUT", "DELETE", "POST"):
            return _text(405, f"method {request.method} not allowed")
        needs_token = self.private or listing or request.method in ("PUT", "DELETE", "POST")
        if (
            self.token is not None
            and needs_token
            and not bearer_ok(request.headers.get("Authorization"), self.token)
        ):
            # a refused upload's body is never read: close rather than parse it
            refuse = _closing if request.method in ("PUT", "POST") else _text
            response = refuse(401, "a bearer token is required")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        if (
            request.method in ("PUT", "POST")
            and request.headers.get("Content-Encoding", "identity") != "identity"
        ):
            # aiohttp would inflate it: a gzip bomb of 51 KB stored 50 MB
            return _closing(415, "a body with a Content-Encoding is not accepted: send its bytes as they are")
        declared = request.content_length
        if request.method == "PUT":
            if declared is None and "chunked" not in request.headers.get("Transfer-Encoding", "").lower():
                return _closing(411, "Content-Length required")
            if declared is not None and declared > self.max_body:
                return _closing(413, f"body over {self.max_body} bytes")
        if request.method == "POST":
            if declared is None:
                return _closing(411, "Content-Length required")
            if declared > MAX_POST_BODY:
                return _closing(413, f"body over {MAX_POST_BODY} bytes")
        return None

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        """The route's Expect handler: `100 Continue` only for a request the head checks let
        through (aiohttp's default answered it first, so a client without the token was asked
        for its body, and sent it)."""
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        if request.headers.get("Expect", "").lower() != "100-continue":
            return _closing(417, f"Expect: {request.headers.get('Expect')} is not supported")
        if request.version == HttpVersion11:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            # as aiohttp's own handler: no byte of the response is out yet (a route that raises
            # then gets its 500 instead of a dropped connection)
            request.writer.output_size = 0
        return None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        key = path.strip("/")
        listing = path.endswith("/") or not key
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        try:
            if request.method == "POST":
                if not listing:
                    return _closing(405, "POST only to a folder (mark_used, exists)")
                return await self._post(request, key)
            if listing:
                if request.method != "GET":
                    return _text(405, "folders are only listed (GET)")
                return await self._list(key)
            check_key(key)
            if request.method == "PUT":
                return await self._put(request, key)
            if request.method == "DELETE":
                return await self._delete(request, key)
            return await self._get(request, key)
        except EntryNotFoundError:
            return _text(404, "not found")
        except InvalidArgumentError as exc:
            return _text(400, str(exc))
        except StoreError as exc:  # a folder where a file should be, a link, a full disk
            return _text(409, str(exc))

    async def _delete(self, request: web.Request, key: str) -> web.Response:
        since = request.headers.get(_UNUSED_SINCE)
        try:
            unused_since = None if since is None else float(since)
        except ValueError:
            unused_since = math.nan
        if unused_since is not None and not math.isfinite(unused_since):
            return _text(400, f"{_UNUSED_SINCE} takes an mtime as a listing gives it, not {since[:40]!r}")
        if await self._run(partial(self.store.delete, key, unused_since=unused_since)):
            return web.Response(status=204)
        if unused_since is not None and await self._run(self.store.exists, key):
            return _text(412, "used since the listing")
        return _text(404, "not found")

    async def _list(self, key: str) -> web.Response:
        if key:
            check_key(key)
        entries = await self._run(self.store.list, f"{key}/" if key else "")
        body = [{"key": e.key, "size": e.size, "mtime": e.mtime} for e in entries]
        return web.json_response(body)

    async def _get(self, request: web.Request, key: str) -> web.StreamResponse:
        f = await self._run(self.store.open, key)
        try:
            size = os.fstat(f.fileno()).st_size
            if request.method == "HEAD":
                return web.Response(status=200, headers={"Content-Length": str(size)})
            await self._run(self.store.mark_used, [key])
            response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            response.content_length = size
            await response.prepare(request)
            try:
                while chunk := await self._run(f.read, _CHUNK):
                    # a client that stops reading held the handler, its socket and the open file
                    # (a deleted object's disk space too) for good
                    await asyncio.wait_for(response.write(chunk), self.body_timeout)
                await asyncio.wait_for(response.write_eof(), self.body_timeout)  # it drains too
            except ConnectionResetError:  # the client left: one that gives up a fetch does so
                pass
            except asyncio.TimeoutError:
                _log.info("GET %s: the client took nothing for %g s: dropped", key, self.body_timeout)
                if request.transport is not None:
                    request.transport.abort()
            return response
        finally:
            f.close()

    async def _post(self, request: web.Request, folder: str) -> web.StreamResponse:
        """`{"mark_used": [keys]}` or `{"exists": [keys]}`, keys under `folder` (a body of at most
        MAX_POST_BODY bytes: _refusal)."""
        try:
            body = await asyncio.wait_for(request.read(), self.body_timeout)
        except asyncio.TimeoutError:
            return _closing(408, f"no body data for {self.body_timeout:g} s")
        async with self.posts:  # parsed, a body takes ~5x its size: 40 at once took 900 MB
            try:
                request_body = json.loads(body)
                if not isinstance(request_body, dict) or len(request_body) != 1:
                    raise TypeError("expected one of mark_used, exists")
                ((op, keys),) = request_body.items()
                if op not in ("mark_used", "exists"):
                    raise KeyError(op)
                if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                    raise TypeError(f"{op} is not a list of keys")
            except (ValueError, TypeError, KeyError, RecursionError) as exc:
                return _text(400, f"not a mark_used or exists request: {exc}")
            keys = [check_key(f"{folder}/{k}" if folder else k) for k in keys]
            if op == "exists":
                return web.json_response(await self._run(lambda: [self.store.exists(k) for k in keys]))
            await self._run(self.store.mark_used, keys)
        return web.Response(status=204)

    async def _put(self, request: web.Request, key: str) -> web.StreamResponse:
        declared = request.content_length  # at most max_body (_refusal)
        pending: PendingWrite = await self._run(self.store.begin_write, key)
        began = time.monotonic()
        try:
            while chunk := await asyncio.wait_for(request.content.readany(), self.body_timeout):
                if pending.size + len(chunk) > self.max_body:
                    pending.abort()
                    return _closing(413, f"body over {self.max_body} bytes")
                # a byte now and then within the timeout held a connection and a temporary for
                # good: past the timeout, a body comes at _MIN_BODY_RATE, as the client's reads ask
                if _too_slow(began, self.body_timeout, pending.size + len(chunk)):
                    pending.abort()
                    return _closing(408, f"body under {_MIN_BODY_RATE} bytes/s past {self.body_timeout:g} s")
                try:
                    await self._run(pending.write, chunk)
                except OSError as exc:
                    pending.abort()
                    return _closing(507, f"cannot store {key!r}: {exc.strerror or exc}")
            if declared is not None and pending.size != declared:  # the client went away mid-upload
                pending.abort()
                return _closing(400, "body shorter than its Content-Length")
            try:
                await self._run(pending.commit)
            except OSError as exc:
                pending.abort()
                return _closing(507, f"cannot store {key!r}: {exc.strerror or exc}")
        except asyncio.TimeoutError:
            pending.abort()
            return _closing(408, f"no body data for {self.body_timeout:g} s")
        except ConnectionResetError:  # the client left mid-upload: nothing stored, nobody to answer
            pending.abort()
            _log.info("upload of %s: the client left after %d bytes", key, pending.size)
            return _closing(400, "connection lost")
        except BaseException:
            pending.abort()
            raise
        return web.Response(status=201)


def make_app(
    directory: str | Path,
    *,
    token: str | None = None,
    private: bool = False,
    max_body: int = MAX_BODY,
    body_timeout: float = BODY_TIMEOUT_S,
) -> web.Application:
    """The store server's aiohttp application over `directory` (never tags or verifies objects:
    clients do)."""
    if private and token is None:
        raise InvalidArgumentError("a private store needs a token (--token-file or LLAMA_CACHEGEN_TOKEN)")
    server = _Server(FileStore(directory, auth_key=b""), token, private, max_body, body_timeout)
    app = web.Application(client_max_size=max_body)
    app.router.add_route("*", "/{tail:.*}", server.handle, expect_handler=server.expect)
    app.cleanup_ctx.append(server.sweeping)
    return app


async def _serve(
    app: web.Application, host: str, port: int, verbose: bool, ready: Callable[[str], None]
) -> None:
    runner = web.AppRunner(
        app, keepalive_timeout=KEEPALIVE_S, access_log=web.access_logger if verbose else None
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        bound_host, bound_port = runner.addresses[0][:2]
        ready(f"http://{bound_host}:{bound_port}/")
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def serve(
    directory: str | Path,
    host: str = "127.0.0.1",
    port: int = 8080,
    *,
    token: str | None = None,
    private: bool = False,
    verbose: bool = False,
    max_body: int = MAX_BODY,
    body_timeout: float = BODY_TIMEOUT_S,
) -> None:
    """Serves `directory` until interrupted; prints the URL once listening. Without a token only a
    loopback host is accepted."""
    if token is None and not is_loopback(host):
        raise InvalidArgumentError(
            f"refusing to serve on {host or 'every interface'} without a token: anyone who reaches it "
            f"could write and delete; give --token-file or {TOKEN_ENV}, or listen on 127.0.0.1"
        )
    app = make_app(directory, token=token, private=private, max_body=max_body, body_timeout=body_timeout)
    if verbose:
        import logging

        logging.basicConfig(level=logging.INFO)

    def ready(url: str) -> None:
        access = "token required for writes" + (" and reads" if private else "") if token else "no token"
        print(
            f"llama-cachegen: serving {Path(directory).resolve()} at {url} ({access})",
            file=sys.stderr,
            flush=True,
        )

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(app, host, port, verbose, ready))


__all__ = ["TOKEN_ENV", "HttpStore", "bearer_ok", "is_loopback", "load_token", "make_app", "serve"]
