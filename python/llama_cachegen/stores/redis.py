"""A store in a Redis server (redis-py): `redis://host:port[/db][?prefix=name:]`.

Values are plain Redis strings under `<prefix><key>`; a sorted set `<prefix>__lru__` holds each
key's last-use time. Every write is one MULTI/EXEC transaction, so a client that dies mid-send
leaves nothing behind.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

from ..errors import EntryNotFoundError, StoreError
from . import AuthKey, EntryInfo, Store, check_key, is_key


class RedisStore(Store):
    def __init__(self, url: str, *, auth_key: AuthKey = None) -> None:
        super().__init__(auth_key=auth_key)
        try:
            import redis
        except ImportError as exc:
            raise StoreError(
                "redis:// stores need the redis package: pip install 'llama-cachegen[redis]'"
            ) from exc
        parts = urllib.parse.urlsplit(url)
        query = urllib.parse.parse_qs(parts.query)
        self.prefix = query.pop("prefix", ["lcg:"])[0]
        self.url = url
        self._lru = f"{self.prefix}__lru__"
        rest = urllib.parse.urlencode(query, doseq=True)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError,)
        self._closed = False
        try:
            self._redis: Any = redis.Redis.from_url(urllib.parse.urlunsplit(parts._replace(query=rest)))
        except (ValueError, redis.RedisError) as exc:
            raise StoreError(f"cannot open {url}: {exc}") from exc

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._errors as exc:
            raise StoreError(f"redis {what} failed on {self.url}: {exc}") from exc
        except (OSError, ValueError) as exc:
            if not self._closed:
                raise
            # closed by another thread mid-reply: redis-py reads from a closed socket file
            raise StoreError(f"redis {what} on {self.url}: the store was closed") from exc

    def _get(self, key: str) -> bytes:
        value = self._call("GET", self._redis.get, self.prefix + key)
        if value is None:
            raise EntryNotFoundError(f"{key!r} not in {self.url}")
        return bytes(value)

    def _put(self, key: str, data: bytes) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(self.prefix + key, data)
        pipe.zadd(self._lru, {key: time.time()})
        self._call("SET", pipe.execute)

    def delete(self, key: str) -> bool:
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self.prefix + check_key(key))
        pipe.zrem(self._lru, key)
        return bool(self._call("DEL", pipe.execute)[0])

    def exists(self, key: str) -> bool:
        return bool(self._call("EXISTS", self._redis.exists, self.prefix + check_key(key)))

    def list(self, prefix: str = "") -> list[EntryInfo]:
        members = self._call("ZRANGE", self._redis.zrange, self._lru, 0, -1, withscores=True)
        # any client of the server can add members: one that is no key of ours is skipped
        named = ((m.decode("utf-8", "replace"), score) for m, score in members)
        keys = [(key, score) for key, score in named if key.startswith(prefix) and is_key(key)]
        pipe = self._redis.pipeline(transaction=False)
        for key, _ in keys:
            pipe.exists(self.prefix + key)
            pipe.strlen(self.prefix + key)
        replies = self._call("STRLEN", pipe.execute) if keys else []
        # an entry deleted by another client between the two calls is skipped
        return [
            EntryInfo(k, n, t)
            for (k, t), there, n in zip(keys, replies[::2], replies[1::2], strict=False)
            if there
        ]

    def mark_used(self, keys: Sequence[str]) -> None:
        if keys:  # one call; a microsecond apart (xx: a missing key is not added)
            now = time.time()
            scores = {check_key(key): now + i * 1e-6 for i, key in enumerate(keys)}
            self._call("ZADD", self._redis.zadd, self._lru, scores, xx=True)

    def close(self) -> None:
        """Closes the connections, those with a reply being read too (their reads fail)."""
        self._closed = True
        self._redis.close()
