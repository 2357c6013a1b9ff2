"""Byte stores addressed by URL: `file://` (a local directory), `redis://`, `http(s)://`.

A store maps keys (slash-separated segments of `[A-Za-z0-9._-]`, no `..`) to immutable byte
values. Every `put` is atomic: a reader sees the whole old value, the whole new one, or nothing,
even if the writer dies mid-write. Nothing read from a store is ever unpickled or evaluated.
"""

from __future__ import annotations

import re
import urllib.parse
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidArgumentError

_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class EntryInfo:
    key: str
    size: int
    mtime: float  # seconds since the epoch of the last write or touch: the LRU clock


def check_key(key: str) -> str:
    """Returns `key` if it is a valid store key, else raises InvalidArgumentError."""
    if not key or not all(_SEGMENT.fullmatch(seg) for seg in key.split("/")):
        raise InvalidArgumentError(f"invalid store key {key!r}: use '/'-separated [A-Za-z0-9._-] segments")
    return key


class Store(ABC):
    """A key -> bytes store; see the module docstring for the guarantees."""

    url: str

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The value of `key`; raises EntryNotFoundError when absent."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Stores `data` under `key` atomically, replacing any previous value."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Removes `key`; False when it was not there."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[EntryInfo]:
        """Every entry whose key starts with `prefix` (a folder-like prefix ending in '/' or '')."""

    @abstractmethod
    def touch(self, key: str) -> None:
        """Marks `key` as just used (for LRU eviction); a missing key is ignored."""

    def sweep(self, max_age_s: float = 3600.0) -> int:
        """Removes leftovers of writers that died; returns how many (most stores leave none)."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Releases connections."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(url: str) -> Store:
    """Opens the store at `url`: `file:///dir` or a plain path, `redis://host:port[/db][?prefix=p]`,
    `http(s)://host:port[/path]` (a `llama-cachegen serve` server)."""
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if _is_local(url):
        from .file import FileStore

        return FileStore(url)
    if scheme in ("redis", "rediss", "unix"):
        from .redis import RedisStore

        return RedisStore(url)
    if scheme in ("http", "https"):
        from .http import HttpStore

        return HttpStore(url)
    raise InvalidArgumentError(f"unsupported store URL scheme {scheme!r} in {url!r}")


def _is_local(url: str) -> bool:
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    return scheme in ("", "file") or len(scheme) == 1  # one letter: a Windows drive, i.e. a path


def split_url(url: str) -> tuple[str, str]:
    """Splits a remote object URL into (store URL, key).

    `http://h:p/a/b` -> `http://h:p` and `a/b`; `redis://h:p/0/a/b` (db number optional) ->
    `redis://h:p/0` and `a/b`.
    """
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    segments = [s for s in parts.path.split("/") if s]
    if scheme in ("redis", "rediss"):
        db = segments.pop(0) if segments and segments[0].isdigit() else "0"
        base = urllib.parse.urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, ""))
    elif scheme in ("http", "https"):
        base = urllib.parse.urlunsplit((parts.scheme, parts.netloc, "", "", ""))
    else:
        raise InvalidArgumentError(f"unsupported URL scheme {scheme!r} in {url!r}")
    if not segments:
        raise InvalidArgumentError(f"URL {url!r} names no object")
    return base, "/".join(segments)


def read_url(url: str | Path) -> bytes:
    """The bytes of one object named by a URL or a local path (EntryNotFoundError if absent)."""
    from .file import path_of, read_path

    if _is_local(str(url)):
        return read_path(path_of(url))
    base, key = split_url(str(url))
    with open_store(base) as store:
        return store.get(key)


def write_url(url: str | Path, data: bytes) -> str:
    """Writes `data` atomically to the object named by a URL or a local path; returns the URL."""
    from .file import atomic_write, path_of

    if _is_local(str(url)):
        atomic_write(path_of(url), data)
    else:
        base, key = split_url(str(url))
        with open_store(base) as store:
            store.put(key, data)
    return str(url)


__all__ = ["EntryInfo", "Store", "check_key", "open_store", "read_url", "split_url", "write_url"]
