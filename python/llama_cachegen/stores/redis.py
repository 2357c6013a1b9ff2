"""A store in a Redis server (redis-py): `redis://host:port[/db][?prefix=name:]`.

Values are plain Redis strings under `<prefix><key>`; a sorted set `<prefix>__lru__` holds each
key's last-use time, on the server's clock (TIME: clients on hosts whose clocks differ evicted
each other's newest entries). Every write is one MULTI/EXEC transaction, so a client that dies
mid-send leaves nothing behind. A use (`mark_used`) registers a value the set lacks again (the
set lost, or written by a client of another prefix layout); a listing drops members whose value
is gone.
"""

from __future__ import annotations

import contextlib
import urllib.parse
from collections.abc import Sequence
from typing import Any

from ..errors import EntryNotFoundError, InvalidArgumentError, StoreError
from . import AuthKey, EntryInfo, Store, check_key, is_key, redact

_LRU = "__lru__"  # the sorted set's name after the prefix: no key may take it
# marks KEYS[2..] (values) used now on the server's clock, a microsecond apart, in the set KEYS[1]
# under the members ARGV; a value that is gone is not added
_MARK_USED = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for i = 1, #ARGV do
  if redis.call('EXISTS', KEYS[i + 1]) == 1 then
    redis.call('ZADD', KEYS[1], now + (i - 1) / 1000000, ARGV[i])
  end
end
"""
# deletes the value KEYS[2] and its member ARGV[1] of the set KEYS[1] unless the member's time is
# past ARGV[2] (used since); 1 if deleted
_DELETE_UNUSED = """
local t = redis.call('ZSCORE', KEYS[1], ARGV[1])
if t and tonumber(t) > tonumber(ARGV[2]) then
  return 0
end
redis.call('ZREM', KEYS[1], ARGV[1])
return redis.call('DEL', KEYS[2])
"""
# removes from the set KEYS[1] the members ARGV whose value KEYS[2..] is still gone (a client that
# wrote one again since a listing saw it gone keeps its member)
_FORGET = """
for i = 1, #ARGV do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then
    redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
"""


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
        self.url = redact(url)
        self._lru = self.prefix + _LRU
        rest = urllib.parse.urlencode(query, doseq=True)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError,)
        self._closed = False
        try:
            self._redis: Any = redis.Redis.from_url(urllib.parse.urlunsplit(parts._replace(query=rest)))
        except ValueError as exc:  # a value redis-py refuses ("socket_timeout=abc")
            raise InvalidArgumentError(f"cannot open {self.url}: {exc}") from None
        except redis.RedisError as exc:
            raise StoreError(f"cannot open {self.url}: {exc}") from exc
        pool = self._redis.connection_pool
        try:  # a connection object, not connected: a misspelt option fails here, not at first use
            pool.connection_class(**pool.connection_kwargs)
        except (TypeError, ValueError, redis.RedisError) as exc:
            raise InvalidArgumentError(
                f"cannot open {self.url}: an option redis-py does not take, or a value it refuses ({exc})"
            ) from exc
        self._mark = self._redis.register_script(_MARK_USED)
        self._forget = self._redis.register_script(_FORGET)
        self._delete_unused = self._redis.register_script(_DELETE_UNUSED)

    def _name(self, key: str) -> str:
        """The Redis key of a store key (checked; the LRU set's own name is none)."""
        if check_key(key) == _LRU:
            raise InvalidArgumentError(f"{_LRU!r} names the store's LRU set in a Redis store: not a key")
        return self.prefix + key

    def _now(self) -> float:
        seconds, micros = self._call("TIME", self._redis.time)
        return seconds + micros / 1e6

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

    def _get(self, key: str, limit: int | None) -> bytes:
        name = self._name(key)
        pipe = self._redis.pipeline(transaction=True)
        pipe.type(name)
        if limit is None:
            pipe.get(name)
        else:  # at most limit + 1 bytes come back (GETRANGE of a missing key is empty: TYPE says)
            pipe.getrange(name, 0, limit)
        # another type than a string (a list another client put there) fails its read: a miss, as
        # a key that is not there, which the next save writes over (SET replaces any type)
        kind, value = self._call("GET", pipe.execute, raise_on_error=False)
        if kind != b"string":
            what = "" if kind == b"none" else f" (a {kind.decode(errors='replace')} there)"
            raise EntryNotFoundError(f"{key!r} not in {self.url}{what}")
        if isinstance(value, Exception):
            raise StoreError(f"redis GET failed on {self.url}: {value}")
        if limit is not None and len(value) > limit:
            raise self._over(key, limit)
        return bytes(value)

    def _put(self, key: str, data: bytes) -> None:
        name, now = self._name(key), self._now()
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(name, data)
        pipe.zadd(self._lru, {key: now})
        self._call("SET", pipe.execute)

    def delete(self, key: str, *, unused_since: float | None = None) -> bool:
        name = self._name(key)
        if unused_since is not None:  # one call (_DELETE_UNUSED): no use comes between
            args = [key, repr(float(unused_since))]
            return bool(self._call("EVALSHA", self._delete_unused, keys=[self._lru, name], args=args))
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(name)
        pipe.zrem(self._lru, key)
        return bool(self._call("DEL", pipe.execute)[0])

    def exists(self, key: str) -> bool:
        return self.exists_many([key])[0]

    bulk_exists = True

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Keys holding a string: a value of another type is no entry of this store (see _get)."""
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.type(self._name(key))
        return [kind == b"string" for kind in self._call("TYPE", pipe.execute)]

    def list(self, prefix: str = "") -> list[EntryInfo]:
        members = self._call("ZRANGE", self._redis.zrange, self._lru, 0, -1, withscores=True)
        # any client of the server can add members: one that is no key of ours is skipped
        named = ((m.decode("utf-8", "replace"), score) for m, score in members)
        keys = [
            (key, score) for key, score in named if key.startswith(prefix) and is_key(key) and key != _LRU
        ]
        pipe = self._redis.pipeline(transaction=False)
        for key, _ in keys:
            pipe.type(self.prefix + key)
            pipe.strlen(self.prefix + key)
        # a value of another type (its STRLEN fails) is no entry: skipped, as one that is gone
        replies = self._call("STRLEN", pipe.execute, raise_on_error=False) if keys else []
        replies[::2] = [kind == b"string" for kind in replies[::2]]
        # an entry deleted by another client between the two calls is skipped; a member whose value
        # is gone otherwise (evicted by Redis, deleted by hand) goes, or the set grows for good
        gone = [k for (k, _), there in zip(keys, replies[::2], strict=False) if not there]
        if gone:
            # best effort: a client that may only read (an ACL, a replica) still lists
            with contextlib.suppress(StoreError):
                names = [self.prefix + k for k in gone]
                self._call("EVALSHA", self._forget, keys=[self._lru, *names], args=gone)
        return [
            EntryInfo(k, n, t)
            for (k, t), there, n in zip(keys, replies[::2], replies[1::2], strict=False)
            if there
        ]

    def mark_used(self, keys: Sequence[str]) -> None:
        if keys:  # one call (_MARK_USED)
            self._call("EVALSHA", self._mark, keys=[self._lru, *map(self._name, keys)], args=list(keys))

    def close(self) -> None:
        """Closes the connections, those with a reply being read too (their reads fail)."""
        self._closed = True
        self._redis.close()
