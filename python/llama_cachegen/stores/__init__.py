"""Byte stores addressed by URL: `file://` (a local directory), `redis://`, `http(s)://`.

A store maps keys (slash-separated segments of `[A-Za-z0-9._-]`, no `..`) to immutable byte
values. Every `put` is atomic: a reader sees the whole old value, the whole new one, or nothing,
even if the writer dies mid-write. Nothing read from a store is ever unpickled or evaluated.

Authenticated objects: with a key (`auth_key=`, else the environment variable
LLAMA_CACHEGEN_KEY), every object a store writes is stored as

    b"LCGTAG\x00\x01" (8 bytes) + tag (32 bytes) + value
    tag = HMAC-SHA256(key, b"llama-cachegen object v1\x00" + name + b"\x00" + value)

where `name` is the object's name (`Store.tag_name`: its key in the store, the path on the server
for an HTTP store, the final path component for a local file), so a tagged object cannot be
replayed under another name. A reader with the key returns only values whose tag verifies and
raises AuthenticationError otherwise, before handing out any byte. Without a key nothing is
verified: the header of a tagged object is dropped and the value returned as it is.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import AuthenticationError, EntryNotFoundError, InvalidArgumentError, LimitExceededError

KEY_ENV = "LLAMA_CACHEGEN_KEY"
TAG_MAGIC = b"LCGTAG\x00\x01"
TAG_DOMAIN = b"llama-cachegen object v1\x00"
TAG_HEADER_SIZE = len(TAG_MAGIC) + hashlib.sha256().digest_size

_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_PASSWORD_OPTION = re.compile(r"([?&](?:ssl_)?password=)[^&#]*", re.IGNORECASE)
_AUTHORITY = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*:)?//([^/?#]*)")

AuthKey = bytes | str | None


# after a store error, its users (the prompt cache, the proxy) skip it for this long: a store that
# stalls makes each call wait out its timeout
STORE_BACKOFF_S = 10.0


@dataclass(frozen=True)
class EntryInfo:
    key: str
    size: int  # bytes stored, the tag header included
    mtime: float  # seconds since the epoch of the last write or use (mark_used): the LRU clock


def is_key(key: str) -> bool:
    """Whether `key` is a valid store key: what a store lists is only what it can also delete (an
    entry planted under another name would stop an eviction that cannot pass it)."""
    return bool(key) and all(_SEGMENT.fullmatch(seg) for seg in key.split("/"))


def check_key(key: str) -> str:
    """Returns `key` if it is a valid store key, else raises InvalidArgumentError."""
    if not is_key(key):
        raise InvalidArgumentError(f"invalid store key {key!r}: use '/'-separated [A-Za-z0-9._-] segments")
    return key


def resolve_key(auth_key: AuthKey) -> bytes | None:
    """The HMAC key to use: `auth_key`, or LLAMA_CACHEGEN_KEY when None; "" or b"" means none."""
    if auth_key is None:
        auth_key = os.environ.get(KEY_ENV, "")
    if isinstance(auth_key, str):
        auth_key = auth_key.encode()
    return bytes(auth_key) or None


def object_tag(key: bytes, name: str, value: bytes | bytearray | memoryview) -> bytes:
    """HMAC-SHA256 of an object's value under its name (see the module docstring)."""
    mac = hmac.new(key, TAG_DOMAIN, hashlib.sha256)
    mac.update(name.encode())
    mac.update(b"\x00")
    mac.update(value)
    return mac.digest()


def seal(key: bytes | None, name: str, value: bytes | bytearray | memoryview) -> bytes:
    """The bytes to store for `value` under `name`: tagged with `key`, or the value itself."""
    if key is not None:
        return TAG_MAGIC + object_tag(key, name, value) + value
    if bytes(value[: len(TAG_MAGIC)]) == TAG_MAGIC:
        # a reader would take it for a tagged object and drop its first bytes
        raise InvalidArgumentError(f"{name!r}: a value starting with {TAG_MAGIC!r} needs a key to be stored")
    return bytes(value)


def unseal(key: bytes | None, name: str, stored: bytes) -> bytes:
    """The value inside `stored` (as written by `seal`); with a key, only if its tag verifies."""
    tagged = stored[: len(TAG_MAGIC)] == TAG_MAGIC and len(stored) >= TAG_HEADER_SIZE
    if key is None:
        return stored[TAG_HEADER_SIZE:] if tagged else stored
    if not tagged:
        raise AuthenticationError(f"{name!r} carries no authentication tag (written without the key)")
    value = memoryview(stored)[TAG_HEADER_SIZE:]
    if not hmac.compare_digest(stored[len(TAG_MAGIC) : TAG_HEADER_SIZE], object_tag(key, name, value)):
        raise AuthenticationError(f"{name!r}: authentication tag does not match (another key or name)")
    return bytes(value)


class Store(ABC):
    """A key -> bytes store; see the module docstring for the guarantees.

    Subclasses implement the raw `_get` / `_put`; `get` / `put` add and check the tag.
    """

    url: str
    auth_key: bytes | None = None
    bulk_exists = False  # exists_many asks in one round trip (else key by key)
    local = False  # keys are looked up without a network (a directory): many cost little

    def __init__(self, *, auth_key: AuthKey = None) -> None:
        self.auth_key = resolve_key(auth_key)

    def tag_name(self, key: str) -> str:
        """The name a tag binds for `key` (the key itself; an HTTP store prefixes its root path)."""
        return key

    def get(self, key: str, max_size: int | None = None) -> bytes:
        """The value of `key`; raises EntryNotFoundError when absent, AuthenticationError when a
        key is configured and the object's tag is missing or wrong, LimitExceededError when the
        value is over `max_size` bytes (read no further: 2 GiB planted where a 300 KB chunk goes
        were read whole by every keyed lookup before the tag refused them)."""
        key = check_key(key)
        limit = None if max_size is None else max_size + TAG_HEADER_SIZE
        value = unseal(self.auth_key, self.tag_name(key), self._get(key, limit))
        if max_size is not None and len(value) > max_size:  # an untagged value may take the tag's room
            raise self._over(key, max_size)
        return value

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Stores `data` under `key` atomically (tagged when a key is configured), replacing any
        previous value."""
        self._put(check_key(key), seal(self.auth_key, self.tag_name(key), data))

    @abstractmethod
    def _get(self, key: str, limit: int | None) -> bytes:
        """The stored bytes of a checked `key`; EntryNotFoundError when absent, `_over(key, limit)`
        past `limit` bytes."""

    def _over(self, key: str, limit: int) -> LimitExceededError:
        return LimitExceededError(f"{key!r} in {self.url} holds more than the {limit} bytes it can")

    @abstractmethod
    def _put(self, key: str, data: bytes) -> None:
        """Stores `data` under a checked `key` atomically."""

    @abstractmethod
    def delete(self, key: str, *, unused_since: float | None = None) -> bool:
        """Removes `key`; False when it was not there, or with `unused_since` (the mtime a listing
        gave) when it was written or used after that. An evicting process's listing is stale by
        the time it deletes: another process may have used the entry meanwhile (a hit that reads
        it, a save that keeps it), and the entry is newer than others the listing had as newer."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """exists() of each key, in order; stores over a network ask in one round trip."""
        return [self.exists(k) for k in keys]

    def has(self, key: str, max_size: int | None = None) -> bool:
        """Whether `get(key, max_size)` would return a value: existence, and with a key configured
        a valid tag (the object is read, no further than `max_size` bytes). Content-addressed
        writers keep what `has`: an untagged object, one of another key, or one larger than any
        such object can be must be written over, or every keyed load of it fails."""
        if self.auth_key is None:
            return self.exists(key)
        try:
            self.get(key, max_size)
        except (EntryNotFoundError, AuthenticationError, LimitExceededError):
            return False
        return True

    def has_many(self, keys: Sequence[str], max_size: int | None = None) -> list[bool]:
        """has() of each key, in order: one round trip (exists_many) when no key is configured."""
        return self.exists_many(keys) if self.auth_key is None else [self.has(k, max_size) for k in keys]

    @abstractmethod
    def list(self, prefix: str = "") -> list[EntryInfo]:
        """Every entry whose key starts with `prefix` (a folder-like prefix ending in '/' or '')."""

    @abstractmethod
    def mark_used(self, keys: Sequence[str]) -> None:
        """Marks `keys` used now for LRU eviction, in this order: each later than the one before
        (on the store's clock: an HTTP store's server sets them). Missing keys are ignored."""

    def temporaries(self, prefix: str = "") -> list[EntryInfo]:
        """Partial writes under `prefix` still taking space (in progress, or left by writers that
        died and not swept yet); most stores have none."""
        return []

    def sweep(self, max_age_s: float = 3600.0) -> int:
        """Removes leftovers of writers that died; returns how many (most stores leave none)."""
        return 0

    def evict(self, prefix: str, capacity_bytes: int) -> int:
        """Deletes the least recently used entries under `prefix` until they and the partial
        writes among them take at most `capacity_bytes` (leftovers of dead writers swept first);
        returns the bytes freed. An entry used since the listing (another process's read or
        write meanwhile) is newer than the rest: kept."""
        self.sweep()
        entries = self.list(prefix)
        size = sum(i.size for i in self.temporaries(prefix)) + sum(i.size for i in entries)
        freed = 0
        for info in sorted(entries, key=lambda i: i.mtime):
            if size <= capacity_bytes:
                break
            if not self.delete(info.key, unused_since=info.mtime) and self.exists(info.key):
                continue
            size -= info.size
            freed += info.size
        return freed

    def received(self, thread_id: int) -> int | None:
        """Bytes the `get`s on thread `thread_id` have received so far, all of them together (one
        in flight included); None when this store cannot tell, or that thread has read nothing."""
        return None

    def cancel(self, thread_id: int) -> bool:
        """Ends the `get` in flight on thread `thread_id`, and any that thread starts later (they
        raise StoreError), so that the link is free for another reader; False when this store
        cannot (its reads are local, or the client library cannot end one), and the read goes on."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Releases connections."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(url: str, *, auth_key: AuthKey = None, token: str | None = None) -> Store:
    """Opens the store at `url`: `file:///dir` or a plain path, `redis://host:port[/db][?prefix=p]`,
    `http(s)://host:port[/path]` (a `llama-cachegen serve` server).

    `auth_key` tags and verifies every object (default: LLAMA_CACHEGEN_KEY; "" for none); `token`
    is an HTTP store's bearer token (default: LLAMA_CACHEGEN_TOKEN), ignored by other stores.
    """
    scheme = _urlsplit(url).scheme.lower()
    if is_local(url):
        from .file import FileStore

        return FileStore(url, auth_key=auth_key)
    if scheme in ("redis", "rediss", "unix"):
        from .redis import RedisStore

        return RedisStore(url, auth_key=auth_key)
    if scheme in ("http", "https"):
        from .http import HttpStore

        return HttpStore(url, auth_key=auth_key, token=token)
    raise InvalidArgumentError(f"unsupported store URL scheme {scheme!r} in {redact(url)!r}")


def redact(url: str | Path) -> str:
    """`url` with the password of its user part as `***`: what messages and logs show of a URL
    (`redis://:secret@host` -> `redis://:***@host`). Never raises, even on a malformed URL."""
    url = _PASSWORD_OPTION.sub(r"\1***", str(url))  # redis-py takes ?password= too
    match = _AUTHORITY.match(url)
    if match is None or "@" not in match.group(2):
        return url
    userinfo, _, host = match.group(2).rpartition("@")
    if ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return url[: match.start(2)] + f"{user}:***@{host}" + url[match.end(2) :]


def _urlsplit(url: str) -> urllib.parse.SplitResult:
    try:
        return urllib.parse.urlsplit(url)
    except ValueError as exc:  # "Invalid IPv6 URL", a port out of range
        raise InvalidArgumentError(f"malformed URL {redact(url)!r}: {exc}") from None


def is_local(url: str) -> bool:
    """True for a plain path or a `file://` URL."""
    scheme = _urlsplit(url).scheme.lower()
    return scheme in ("", "file") or len(scheme) == 1  # one letter: a Windows drive, i.e. a path


def split_url(url: str) -> tuple[str, str]:
    """Splits a remote object URL into (store URL, key).

    `http://h:p/a/b` -> `http://h:p` and `a/b`; `redis://h:p/0/a/b` (db number optional) ->
    `redis://h:p/0` and `a/b`.
    """
    parts = _urlsplit(url)
    scheme = parts.scheme.lower()
    segments = [s for s in parts.path.split("/") if s]
    if scheme in ("redis", "rediss"):
        db = segments.pop(0) if segments and segments[0].isdigit() else "0"
        base = urllib.parse.urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, ""))
    elif scheme in ("http", "https"):
        base = urllib.parse.urlunsplit((parts.scheme, parts.netloc, "", "", ""))
    else:
        raise InvalidArgumentError(f"unsupported URL scheme {scheme!r} in {redact(url)!r}")
    if not segments:
        raise InvalidArgumentError(f"URL {redact(url)!r} names no object")
    return base, "/".join(segments)


def read_url(url: str | Path, *, auth_key: AuthKey = None) -> bytes:
    """The bytes of one object named by a URL or a local path (EntryNotFoundError if absent;
    AuthenticationError if a key is configured and its tag does not verify)."""
    from .file import path_of, read_path

    if is_local(str(url)):
        path = path_of(url)
        return unseal(resolve_key(auth_key), path.name, read_path(path))
    base, key = split_url(str(url))
    with open_store(base, auth_key=auth_key) as store:
        return store.get(key)


def write_url(url: str | Path, data: bytes | bytearray | memoryview, *, auth_key: AuthKey = None) -> str:
    """Writes `data` atomically to the object named by a URL or a local path (tagged when a key is
    configured); returns the URL."""
    from .file import atomic_write, path_of

    if is_local(str(url)):
        path = path_of(url)
        atomic_write(path, seal(resolve_key(auth_key), path.name, data))
    else:
        base, key = split_url(str(url))
        with open_store(base, auth_key=auth_key) as store:
            store.put(key, data)
    return str(url)


__all__ = [
    "KEY_ENV",
    "EntryInfo",
    "Store",
    "check_key",
    "is_local",
    "object_tag",
    "open_store",
    "read_url",
    "resolve_key",
    "seal",
    "split_url",
    "unseal",
    "write_url",
]
