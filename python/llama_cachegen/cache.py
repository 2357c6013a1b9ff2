"""A compressed prompt cache for llama-cpp-python (`llm.set_cache(CompressedStateCache(...))`), on
the chunk store of chunks.py.

A cached context is its complete token chunks, content-addressed by the chained keys of its tokens
under the model fingerprint: a hit assembles the longest run of stored chunks that starts the
prompt (llama-cpp-python evaluates the rest), a save writes only the chunks the store lacks.
Decoded K/V is never encoded again, so repeated hit-extend-save cycles lose nothing: the chunks of
a restored prefix are already stored, and every chunk written holds K/V that llama.cpp computed
(the partial last chunk of a context is not stored; a hit recomputes fewer than chunk_tokens
tokens). Processes and hosts sharing one store share every chunk they have in common; keys embed
the fingerprint, so different models or KV layouts never meet.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp.llama_cache import BaseLlamaCache

from . import chunks, codec
from .errors import (
    CacheGenError,
    CorruptDataError,
    EntryNotFoundError,
    InvalidArgumentError,
    NativeMemoryError,
    StoreError,
)
from .llama import (
    Llama,
    StateMeta,
    better_level,
    check_fingerprint,
    fingerprint_key,
    has_kv_cache,
    has_recurrent_state,
    lossy_level_anywhere,
    model_fingerprint,
    record_load,
    record_possible_load,
    worse_load,
)
from .model import cache_dir
from .stores import STORE_BACKOFF_S, Store, open_store

_log = logging.getLogger("llama_cachegen.cache")
SNAPSHOTS = f"{chunks.PREFIX}snapshots/"  # whole contexts of models with a recurrent state


# what a store that answered says when it takes no more writes: read-only or full (file system,
# HTTP 403 / 413 / 507, Redis READONLY / OOM); its reads still serve
_REFUSED_ERRNOS = frozenset((errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM))
_REFUSED_HTTP = frozenset((403, 413, 507))
try:
    from redis.exceptions import OutOfMemoryError, ReadOnlyError

    _REDIS_REFUSALS: tuple[type[BaseException], ...] = (ReadOnlyError, OutOfMemoryError)
except ImportError:  # the redis extra is optional
    _REDIS_REFUSALS = ()


def _write_refused(exc: BaseException) -> bool:
    """Whether a failed save was a store refusing the write (not one that is down or stalled)."""
    for e in (exc, exc.__cause__):
        if isinstance(e, OSError) and e.errno in _REFUSED_ERRNOS:
            return True
        if getattr(e, "http_status", None) in _REFUSED_HTTP:
            return True
        if isinstance(e, _REDIS_REFUSALS):
            return True
    return False


class _CachedState(llama_cpp.llama.LlamaState):
    """A cache hit; `discard` drops its chunks if llama.cpp refuses the state after all, `loaded`
    records it once a context loaded it (llama_cachegen.Llama.load_state calls both)."""

    def __init__(self, discard: Any, loaded: Any, **fields: Any) -> None:
        super().__init__(**fields)
        self.discard, self.loaded = discard, loaded


class CompressedStateCache(BaseLlamaCache):
    """llama-cpp-python's prompt cache with compressed, shared chunks.

    `store` is a store URL (`file://dir`, `redis://…`, `http://…`) or a Store; the default is a
    folder in the llama-cachegen cache directory. Give the cache a store (or folder) of its own:
    `capacity_bytes` bounds every chunk object in it, partial writes included, once each save has
    ended (while one runs, its new chunks may be over it), and evicts the least recently used
    first, saved contexts' chunks included. Chunks hold `chunk_tokens` tokens at `level` (128 by
    default, finer than a save's 256: a prompt keeps all but its last partial chunk); other
    readers find them with `load_prefix` or `longest_prefix`, which try every power-of-two size.

    The cache must know its model (`model=`, or `llama_cachegen.Llama.set_cache` binds it): the
    fingerprint is part of every key. One cache serves one Llama (a hit replaces that context's
    state, its seed kept); Llamas share a store, each with its own cache. No logits travel with
    chunks: with `logits_all=True` the rows of the cached positions are NaN (prompt logprobs over
    them are unknown). A hit is reported only once every chunk passed its checks
    (authentication tag when the store has a key, key chain, tokens, fingerprint, checksums) and
    decoded; anything that fails, or that llama.cpp still refuses (llama_cachegen.Llama), is
    removed and counts as a miss.

    A recurrent or hybrid model's state holds the recurrent state of its last position only, so no
    prefix can be cut from it: for such a model the cache stores whole contexts instead, one
    container each (`lcg4/snapshots/<fingerprint key>/<level>/<tokens>-<hash of the tokens>`), and
    a hit is the longest one at the cache's level whose tokens all start the prompt (found by
    listing them, longest first). A context holding K/V decoded from a lossy level is stored
    losslessly, with that record (a hit-extend-save cycle would otherwise quantize the same K/V
    again at every turn); one holding several sequences, or larger than `capacity_bytes`, is not
    stored. Eviction and `clear` take snapshots only (the chunks of `save_chunked` in the same
    store are left alone). A purely recurrent model has no KV cache: its cache stores nothing and
    always misses.
    """

    def __init__(
        self,
        store: str | Path | Store | None = None,
        *,
        level: str = "balanced",
        chunk_tokens: int = 128,
        capacity_bytes: int = 2 << 30,
        model: llama_cpp.Llama | None = None,
        threads: int | None = None,
    ) -> None:
        super().__init__(capacity_bytes)
        if store is None:
            store = cache_dir() / "prompt-cache"
        self.store = store if isinstance(store, Store) else open_store(str(store))
        self.level = chunks._check_levels([level])[0]
        self.chunk_tokens = chunks._check_chunk_tokens(chunk_tokens)
        self.threads = threads
        self.namespace = "unbound"
        self.hits = self.misses = 0
        self._down_until = 0.0  # time.monotonic() until which the store is skipped (a read failed)
        self._writes_down_until = 0.0  # ... until which saves skip it (a write failed: full, read-only)
        self._fingerprint: dict[str, Any] | None = None
        self._llm: weakref.ref[llama_cpp.Llama] | None = None
        self._n_ctx: int | None = None
        self._recurrent = False
        self._no_kv = False
        # the last hit's tokens, and the statistics and skeleton its chunks name (see _store_state)
        self._hit_support: tuple[np.ndarray, list[str]] = (np.zeros(0, np.intc), [])
        if model is not None:
            self.bind(model)

    def bind(self, llm: llama_cpp.Llama) -> None:
        """Ties the cache to `llm` and its model fingerprint: chunks of other models are never seen.
        A cache bound to another Llama is refused: it would look up under one fingerprint and load
        into a context of another (RoPE, n_ctx, ...)."""
        bound = None if self._llm is None else self._llm()
        if bound is not None and bound is not llm:
            raise InvalidArgumentError(
                "this CompressedStateCache serves another Llama: give each Llama its own cache (on one store)"
            )
        self._llm = weakref.ref(llm)
        self._fingerprint = model_fingerprint(llm)
        self.namespace = fingerprint_key(self._fingerprint)
        self._n_ctx = len(llm.input_ids)
        self._recurrent = has_recurrent_state(llm)
        self._no_kv = not has_kv_cache(llm)  # nothing this library codes

    def _bound(self) -> dict[str, Any]:
        if self._fingerprint is None:
            raise InvalidArgumentError(
                "CompressedStateCache needs its model: pass model=llm, or use llama_cachegen.Llama.set_cache"
            )
        return self._fingerprint

    @property
    def _objects(self) -> str:
        """The prefix of what the cache counts and evicts: every chunk object, or a recurrent
        model's snapshots."""
        return SNAPSHOTS if self._recurrent else chunks.PREFIX

    @property
    def cache_size(self) -> int:
        """Bytes of the cache's objects in the store and of the partial writes among them."""
        pending = sum(info.size for info in self.store.temporaries(self._objects))
        return pending + sum(info.size for info in self.store.list(self._objects))

    def _snapshot_key(self, tokens: np.ndarray) -> str:
        digest = chunks._sha256(self.namespace.encode() + tokens.astype("<i4").tobytes())
        return f"{SNAPSHOTS}{self.namespace}/{self.level}/{tokens.size}-{digest[:32]}"

    def _match_snapshot(self, tokens: np.ndarray) -> chunks.PrefixMatch:
        """The longest stored whole context whose tokens start `tokens` and leave some to evaluate
        (llama-cpp-python evaluates a prompt's last token again, which a recurrent state cannot be
        cut back for), as one "chunk"."""
        room = tokens.size if self._n_ctx is None else min(tokens.size, self._n_ctx)
        stored = []
        for info in self.store.list(f"{SNAPSHOTS}{self.namespace}/{self.level}/"):
            n, _, _ = info.key.rpartition("/")[2].partition("-")
            if n.isdigit() and 0 < int(n) < room:
                stored.append((int(n), info.key))
        for n, key in sorted(stored, reverse=True):
            if self._snapshot_key(tokens[:n]) == key:
                return chunks.PrefixMatch(self.chunk_tokens, 1, n, [key], [(self.level,)])
        return chunks.PrefixMatch(self.chunk_tokens, 0, 0, [], [])

    def _match(self, key: Sequence[int]) -> chunks.PrefixMatch:
        """The stored complete chunks at this cache's level that start `key` (recurrent state: the
        stored whole context)."""
        tokens = np.asarray(key, dtype=np.intc)
        c = self.chunk_tokens
        fingerprint = self._bound()
        if self._no_kv:
            return chunks.PrefixMatch(c, 0, 0, [], [])
        if self._recurrent:
            return self._match_snapshot(tokens)
        room = tokens.size if self._n_ctx is None else min(tokens.size, self._n_ctx)
        return chunks._match(self.store, fingerprint, tokens[: room // c * c], c, (self.level,))

    def _store_ok(self, write: bool = False) -> bool:
        now = time.monotonic()
        return now >= self._down_until and (not write or now >= self._writes_down_until)

    def _store_failed(self, what: str, exc: BaseException, write: bool = False) -> None:
        # lookups and saves skip it a while (a stalled Redis added ~10 s to every completion); a
        # failed save only saves (a full or read-only store still serves the hits it holds)
        until = time.monotonic() + STORE_BACKOFF_S
        if write:
            self._writes_down_until = until
        else:
            self._down_until = until
        skipped = "saves skipped" if write else "store skipped"
        _log.warning("prompt cache: %s: %s (%s for %g s)", what, exc, skipped, STORE_BACKOFF_S)

    def _lookup(self, key: Sequence[int]) -> chunks.PrefixMatch:
        """_match, with a store that fails (down, unreadable) a miss, warned and skipped for a while
        (STORE_BACKOFF_S): the cache never fails, nor holds up, the completion it serves."""
        nothing = chunks.PrefixMatch(self.chunk_tokens, 0, 0, [], [])
        if not self._store_ok():
            self._bound()
            return nothing
        try:
            return self._match(key)
        except (StoreError, OSError) as exc:  # not a cache without its model: that is raised
            self._store_failed("lookup failed, a miss", exc)
            return nothing

    def _find_longest_prefix_key(self, key: tuple[int, ...]) -> tuple[int, ...] | None:
        match = self._lookup(key)
        return tuple(key[: match.positions]) if match.chunks else None

    def __contains__(self, key: Sequence[int]) -> bool:
        return self._lookup(key).chunks > 0

    def __getitem__(self, key: Sequence[int]) -> llama_cpp.llama.LlamaState:
        fingerprint = self._bound()
        match = self._lookup(key)
        while True:  # a chunk that cannot be read (ChunkMissingError): the chunks before it
            if not match.chunks:
                self.misses += 1
                raise KeyError("no cached prefix")
            prefix = np.asarray(key[: match.positions], dtype=np.intc)
            # everything is checked and decoded here: llama-cpp-python overwrites its token list
            # before it hands the state to llama.cpp
            try:
                state, used, lossy = self._read(match, prefix, fingerprint)
                break
            except chunks.ChunkMissingError as exc:  # evicted by another process since the lookup
                match.cut(exc.chunk)
            except EntryNotFoundError:  # a snapshot evicted since the lookup
                self.misses += 1
                raise KeyError("cached prefix evicted meanwhile") from None
            except (StoreError, NativeMemoryError, OSError) as exc:  # the store or memory failed,
                # not the chunks (they were dropped too, on a timeout): a miss that keeps them
                if isinstance(exc, NativeMemoryError):
                    _log.warning("prompt cache: hit not read, a miss: %s", exc)
                else:
                    self._store_failed("hit not read, a miss", exc)
                self.misses += 1
                raise KeyError(f"cached prefix not read: {exc}") from exc
            except CacheGenError as exc:  # damaged, foreign or forged: drop it, miss rather than fail
                if exc.chunk is not None and not self._recurrent:
                    # one chunk's: it goes, and the chunks before it, which other prompts share,
                    # serve (dropping the whole chain cost every prompt through it its hits)
                    _log.warning(
                        "prompt cache: chunk %d unusable, the prefix ends before it: %s", exc.chunk, exc
                    )
                    self._drop(match.keys[exc.chunk : exc.chunk + 1])
                    match.cut(exc.chunk)
                    if match.chunks:
                        continue
                else:
                    self._drop(match.keys)
                self.misses += 1
                raise KeyError(f"unusable cached prefix: {exc}") from exc
        self._mark_used(used)
        self.hits += 1
        llm = None if self._llm is None else self._llm()
        # what a content-addressed save of this context must know (lossy_level): llama-cpp-python
        # looks up on every completion but loads a hit only when it is longer than what the
        # context holds (recorded as lossless at every lookup, balanced K/V held went into the
        # store as exact). A plain llama_cpp.Llama does not say whether it loaded: recorded worse.
        if llm is not None and not isinstance(llm, Llama) and lossy is not None:
            record_possible_load(llm, prefix, lossy[1])
        input_ids = np.zeros(self._n_ctx or prefix.size, dtype=np.intc)
        input_ids[: prefix.size] = prefix
        n_vocab = int(fingerprint.get("n_vocab") or 1)
        # no logits travel with chunks: llama-cpp-python evaluates at least the prompt's last token
        # again; load_state spreads this row over the cached positions (logits_all: NaN, unknown)
        unknown = np.nan if llm is not None and llm._logits_all else 0.0
        return _CachedState(
            lambda: self._discard(match),
            lambda into: record_load(into, None, prefix, lossy),
            input_ids=input_ids,
            scores=np.full((1, n_vocab), unknown, np.single),
            n_tokens=int(prefix.size),
            llama_state=bytes(state),
            llama_state_size=len(state),
            seed=getattr(llm, "_seed", 0),  # llama-cpp-python's load_state sets it: kept
        )

    def _read(
        self, match: chunks.PrefixMatch, prefix: np.ndarray, fingerprint: dict[str, Any]
    ) -> tuple[np.ndarray, list[str], tuple[int, str] | None]:
        """The state of a match, checked and decoded, the keys it used, and its lossy record."""
        if self._recurrent:
            state, lossy = self._read_snapshot(match.keys[0], prefix, fingerprint)
            return state, [match.keys[0]], lossy
        levels = [(self.level,)] * match.chunks
        reader = chunks._ChunkReader(self.store, fingerprint, prefix, self.chunk_tokens, match.keys, levels)
        state, skeleton, _ = chunks._assemble(reader, None, self.threads)
        if codec.inspect(skeleton)["kind"] != "full_buffer":
            raise InvalidArgumentError("the chunks' skeleton is not a whole-context state")
        support = reader.support()
        self._hit_support = (prefix, support)
        used = [*(chunks._chunk_key(k, self.level) for k in reversed(match.keys)), *support]
        return state, used, None if self.level == "lossless" else (0, self.level)

    def _mark_used(self, keys: list[str]) -> None:
        """Sets the LRU clock of `keys`, each a microsecond after the one before: a chain's chunks
        are given last first, so that its first chunks, which every hit of it needs, are the last
        evicted (a cache smaller than a prompt keeps a shorter prefix instead of its useless tail),
        then the statistics and skeletons they need (the last to go: without them the chunks are a
        miss, dropped). Best effort: a read-only store still serves hits."""
        with contextlib.suppress(OSError, CacheGenError):
            self.store.mark_used(keys)

    def _read_snapshot(
        self, key: str, tokens: np.ndarray, fingerprint: dict[str, Any]
    ) -> tuple[np.ndarray, tuple[int, str] | None]:
        """A stored whole context, checked (its tokens, the fingerprint, a quality at least the
        cache's level) and decoded, and its lossy record: its container's level and the one it
        carries (K/V decoded from a lossy level, stored losslessly)."""
        blob = self.store.get(key, chunks.whole_bound(fingerprint, int(tokens.size)))
        meta = StateMeta.unpack(codec.user_meta(blob))
        check_fingerprint(meta.fingerprint, fingerprint)
        info = codec.inspect(blob)
        if not np.array_equal(meta.tokens, tokens) or info["kind"] != "full_buffer":
            raise CorruptDataError(f"{key} holds another context")
        lossy = meta.lossy if info["level"] == "lossless" else worse_load(meta.lossy, 0, info["level"])
        if lossy is not None and better_level(self.level, lossy[1]):
            raise CorruptDataError(f"{key} holds K/V of {lossy[1]}, below the cache's {self.level}")
        state = codec.empty_buffer(codec.decoded_size(blob))
        codec.decode_into(blob, state, threads=self.threads)
        return state, lossy

    def _drop(self, keys: list[str]) -> None:
        """Deletes the chunks of these chain keys (snapshots: these keys)."""
        for k in keys:
            with contextlib.suppress(CacheGenError, OSError):  # a store that fails: the miss stands
                self.store.delete(k if self._recurrent else chunks._chunk_key(k, self.level))

    def _discard(self, match: chunks.PrefixMatch) -> None:
        """A prefix llama.cpp refused after all (see llama_cachegen.Llama.load_state): a miss."""
        self._drop(match.keys)
        self.hits -= 1
        self.misses += 1

    def __setitem__(self, key: Sequence[int], value: llama_cpp.llama.LlamaState) -> None:
        """Stores the state's complete chunks the store lacks. A store that fails (full, read-only,
        down) loses the cache entry, never the completion llama-cpp-python is returning: warned."""
        fingerprint = self._bound()  # a cache without its model is the caller's error: raised
        if not self._store_ok(write=True):
            return
        try:
            self._store_state(value, fingerprint)
        except (StoreError, OSError) as exc:
            self._store_failed("state not stored", exc, write=_write_refused(exc))
        except CacheGenError as exc:
            _log.warning("prompt cache: state not stored: %s", exc)

    def _store_state(self, value: llama_cpp.llama.LlamaState, fingerprint: dict[str, Any]) -> None:
        n = int(value.n_tokens)
        if self._no_kv:
            return
        if self._recurrent:
            if not self._holds_worse(value):
                self._put_snapshot(value, fingerprint)
            return
        if n < self.chunk_tokens or self._holds_worse(value) or fingerprint.get("attention") is not None:
            # no complete chunk, K/V that would pass for better than it is, or a prefix's K/V that
            # saw the tokens after it (non-causal attention)
            return
        state = bytes(value.llama_state[: value.llama_state_size])
        info = codec.inspect_state(state, "full_buffer")
        if not info["chunkable"] or info["positions"] != (0, n):
            # several sequences, a state the tokens do not describe, or a sliding cache whose
            # cells out of the window llama.cpp gave to later positions (after a hit past the
            # window: README): nothing to share
            return
        meta = StateMeta(
            fingerprint, "all", None, len(value.input_ids), np.asarray(value.input_ids[:n], np.intc)
        )
        manifest = chunks.Manifest(meta, self.chunk_tokens)
        uploads = chunks._Uploads(self.store)
        named: list[str] = []

        def stored_before(present: list[int]) -> list[str]:
            named.extend(self._named_by(manifest, present))
            return [
                *(chunks._chunk_key(manifest.chunks[i].key, self.level) for i in reversed(present)),
                *named,
            ]

        try:
            chunks._save_chunks(
                self.store,
                uploads,
                manifest,
                state,
                "full_buffer",
                (self.level,),
                self.threads,
                full_only=True,
                evicting=stored_before,
            )
            uploads.finish()
        finally:
            uploads.close()
        # the prompt's whole chain (chunks stored by earlier saves too) is now the most recent, then
        # what its chunks name: the statistics and skeleton this save wrote, and those of chunks
        # stored before (_named_by; marked before the chain, they were older and went first)
        used = [chunks._chunk_key(e.key, self.level) for e in reversed(manifest.chunks)]
        if manifest.stats.get(self.level):
            used.append(chunks._stats_key(manifest.stats[self.level]))
        assert manifest.skeleton is not None
        used.append(chunks._skeleton_key(manifest.skeleton))
        self._mark_used(used + named)
        self._evict()

    def _named_by(self, manifest: chunks.Manifest, present: list[int]) -> list[str]:
        """The statistics and skeletons that chunks `present` of the chain (stored before this
        save) name: from the hit llama-cpp-python looked up before the save, where it read them;
        else read from the chunks (another process stored them since, or the hit failed at one).
        Best effort: a chunk that cannot be read fails its next hit and is removed then."""
        held, support = self._hit_support
        tokens = manifest.meta.tokens
        read = held.size // self.chunk_tokens if np.array_equal(tokens[: held.size], held) else 0
        named = list(support) if read else []
        for i in present:
            if i < read:
                continue
            with contextlib.suppress(CacheGenError, OSError, ValueError):
                key = chunks._chunk_key(manifest.chunks[i].key, self.level)
                chunk = self.store.get(
                    key, max_size=chunks.chunk_bound(manifest.meta.fingerprint, self.chunk_tokens)
                )
                meta = chunks.ChunkMeta.unpack(codec.user_meta(chunk))
                named += [chunks._stats_key(meta.stats_id), chunks._skeleton_key(meta.skeleton_id)]
        return list(dict.fromkeys(named))

    def _holds_worse(self, value: llama_cpp.llama.LlamaState) -> bool:
        """Whether the state holds K/V this library loaded at a level worse than the cache's (or
        computed on top of it; llama.lossy_level_anywhere: the state does not name its context):
        stored under its tokens at the cache's level, it would pass for K/V of that level."""
        tokens = np.asarray(value.input_ids[: int(value.n_tokens)], np.intc)
        worst = lossy_level_anywhere(tokens)
        return worst is not None and better_level(self.level, worst)

    def _put_snapshot(self, value: llama_cpp.llama.LlamaState, fingerprint: dict[str, Any]) -> None:
        """The whole context, one container, unless stored already, of several sequences (a hit
        would put the saver's other sequences into the reader's) or larger than the capacity (its
        eviction would empty the cache, itself last). K/V decoded from a lossy level (a hit's, and
        what was computed on top of it) is stored losslessly with its record: quantized again at
        every hit-extend-save cycle, a conversation's first tokens drifted further each turn."""
        n = int(value.n_tokens)
        tokens = np.asarray(value.input_ids[:n], np.intc)
        key = self._snapshot_key(tokens)
        if n == 0 or self.store.has(key, chunks.whole_bound(fingerprint, n)):
            return
        state = bytes(value.llama_state[: value.llama_state_size])
        info = codec.inspect_state(state, "full_buffer")
        if info["cells"] != n or info["positions"] != (0, n):
            return
        worst = lossy_level_anywhere(tokens)
        lossy = None if worst is None else (0, worst)
        meta = StateMeta(fingerprint, "all", None, len(value.input_ids), tokens, lossy=lossy).pack()
        level = self.level if lossy is None else "lossless"
        blob = codec.encode(state, level, kind="full_buffer", threads=self.threads, user_meta=meta)
        if len(blob) > self.capacity_bytes:
            _log.warning("prompt cache: a context of %d bytes exceeds capacity_bytes: not stored", len(blob))
            return
        self.store.put(key, blob)
        self._evict()

    def _evict(self) -> None:
        self.store.evict(self._objects, self.capacity_bytes)

    def clear(self) -> None:
        """Removes the cache's objects from the store (every chunk object, or a recurrent model's
        snapshots)."""
        for info in self.store.list(self._objects):
            self.store.delete(info.key)
