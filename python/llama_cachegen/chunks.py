"""Chunked, content-addressed context storage (container format v4).

A saved context is a manifest plus shared objects in one store (docs/format.md, "Manifest and store
layout"):

    <manifest key>                   the manifest: tokens, fingerprint, chunk keys, levels, sizes
    lcg4/chunks/<H_i>/<level>        K/V of positions [i*C, min((i+1)*C, n)) at one level
    lcg4/stats/<sha256>              statistics of one level of one save (quantizer, tables)
    lcg4/skeletons/<sha256>          a state without its K/V: what llama.cpp needs besides the rows
    lcg4/wholes/<sha256>             a whole container, for states that cannot be chunked

(`lcg<format version>/`: objects of another container format version live apart and are never
taken for this one's.)

Chunk keys chain: H_0 = sha256(domain + canonical JSON of the fingerprint and C), H_i =
sha256(H_{i-1} + tokens of chunk i as int32). Two contexts sharing their first k chunks of tokens
share those k objects, so saving a context uploads only what the store lacks, and the longest stored
prefix of any token list is found with `exists` calls alone. Every chunk carries its key, the key
before it, its tokens and the model fingerprint key in its user_meta: a loader recomputes and
compares them, and refuses anything that does not match before the context is touched.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from . import codec, envelope, stores
from .envelope import MANIFEST_MAGIC, is_int, require
from .errors import (
    AuthenticationError,
    CacheGenError,
    CorruptDataError,
    EntryNotFoundError,
    InvalidArgumentError,
    LimitExceededError,
    ModelMismatchError,
    NotAContainerError,
    StoreError,
    UnsupportedFormatError,
    UnsupportedVersionError,
)
from .llama import (
    LoadReport,
    StateMeta,
    _seq_id_ok,
    _state_array,
    better_level,
    canonical_fingerprint,
    capture_meta,
    check_fingerprint,
    fingerprint_key,
    has_recurrent_state,
    load_compressed_state,
    lossy_level,
    model_fingerprint,
    restore_context,
    room_message,
    seq_room,
    token_ids,
    worse_load,
)

FORMAT_VERSION = codec.version()[1]
KEY_DOMAIN = f"llama-cachegen chunks v{FORMAT_VERSION}\x00".encode()
MANIFEST_VERSION = 2  # 2: ends in its SHA-256
CHUNK_META_MAGIC = b"LCGK"
CHUNK_META_VERSION = 1
MIN_CHUNK_TOKENS, MAX_CHUNK_TOKENS, DEFAULT_CHUNK_TOKENS = 16, 4096, 256
# the chunk sizes a prefix lookup that names none tries (the prompt cache stores 128 by default)
PROBED_CHUNK_TOKENS = tuple(1 << k for k in range(4, 13))
DEFAULT_LEVELS = ("high", "balanced", "compact")
_log = logging.getLogger("llama_cachegen.chunks")
PREFIX = f"lcg{FORMAT_VERSION}/"

_MAX_MANIFEST_HEADER = 64 << 20  # ~100 bytes of JSON per chunk: 2^28 tokens at C = 4096 fit
_MAX_CHUNK_HEADER = 1 << 16
_HEX_ID = re.compile(r"[0-9a-f]{64}")


def _chunk_key(key: str, level: str) -> str:
    return f"{PREFIX}chunks/{key}/{level}"


def _stats_key(stats_id: str) -> str:
    return f"{PREFIX}stats/{stats_id}"


def _skeleton_key(skeleton_id: str) -> str:
    return f"{PREFIX}skeletons/{skeleton_id}"


def _whole_key(whole_id: str) -> str:
    return f"{PREFIX}wholes/{whole_id}"


def _sha256(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_chunk_tokens(chunk_tokens: int) -> int:
    if not is_int(chunk_tokens) or not MIN_CHUNK_TOKENS <= chunk_tokens <= MAX_CHUNK_TOKENS:
        raise InvalidArgumentError(
            f"chunk_tokens must be from {MIN_CHUNK_TOKENS} to {MAX_CHUNK_TOKENS}, got {chunk_tokens!r}"
        )
    return chunk_tokens


def _check_levels(levels: Sequence[str]) -> tuple[str, ...]:
    if isinstance(levels, str) or not isinstance(levels, Sequence) or not levels:
        raise InvalidArgumentError("levels must be a non-empty sequence of level names")
    return tuple(sorted({codec.level_name(level) for level in levels}, key=codec.LEVEL_ORDER.index))


# ---- keys ---------------------------------------------------------------------------------------


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    return np.ascontiguousarray(tokens, dtype="<i4").tobytes()


def root_key(fingerprint: dict[str, Any], chunk_tokens: int) -> bytes:
    """H_0: the model, its KV layout (FINGERPRINT_FIELDS) and the chunk size."""
    canonical = canonical_fingerprint(fingerprint)
    canonical["chunk_tokens"] = chunk_tokens
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(KEY_DOMAIN + text.encode()).digest()


def next_key(prev: bytes, tokens: Sequence[int] | np.ndarray) -> bytes:
    """H_i from H_{i-1} and the tokens of chunk i."""
    return hashlib.sha256(prev + _token_bytes(tokens)).digest()


def chunk_ranges(n_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[begin, end) of every chunk of a context of n_tokens; the last may be shorter."""
    return [(b, min(b + chunk_tokens, n_tokens)) for b in range(0, n_tokens, chunk_tokens)]


def chain_keys(
    fingerprint: dict[str, Any], tokens: Sequence[int] | np.ndarray, chunk_tokens: int
) -> list[str]:
    """The hex keys H_1.. of the chunks of `tokens` (the last chunk may be partial)."""
    _check_chunk_tokens(chunk_tokens)
    keys, prev = [], root_key(fingerprint, chunk_tokens)
    for begin, end in chunk_ranges(len(tokens), chunk_tokens):
        prev = next_key(prev, tokens[begin:end])
        keys.append(prev.hex())
    return keys


def split_manifest_url(url: str | Path) -> tuple[str, str]:
    """(store URL, manifest key): a local path or file:// URL splits into its folder and file name,
    `http://h:p/a/b` into `http://h:p` and `a/b`, `redis://h:p/0/a` into `redis://h:p/0` and `a`."""
    text = str(url)
    if stores.is_local(text):
        from .stores.file import path_of

        path = path_of(text)
        return str(path.parent), stores.check_key(path.name)
    base, key = stores.split_url(text)
    return base, stores.check_key(key)


def _is_hex_id(value: Any) -> bool:
    return isinstance(value, str) and _HEX_ID.fullmatch(value) is not None


def _int32s(data: bytes, offset: int, count: int) -> np.ndarray:
    return np.frombuffer(data, dtype="<i4", count=count, offset=offset).astype(np.intc)


# ---- chunk user_meta ----------------------------------------------------------------------------


@dataclass
class ChunkMeta:
    """What a chunk object says about itself (its user_meta):

    b"LCGK", u32 version, u32 header size, JSON header, i32 tokens[end - begin]
    """

    key: str  # H_i, hex
    prev: str  # H_{i-1}, hex
    level: str
    begin: int
    end: int
    chunk_tokens: int
    fingerprint_key: str  # llama.fingerprint_key of the saving context
    stats_id: str  # sha256 of the statistics object it was coded with
    skeleton_id: str  # sha256 of the skeleton written by the same save (covers at least `end`)
    tokens: np.ndarray

    def pack(self) -> bytes:
        header = {
            "key": self.key,
            "prev": self.prev,
            "level": self.level,
            "begin": self.begin,
            "end": self.end,
            "chunk_tokens": self.chunk_tokens,
            "fingerprint_key": self.fingerprint_key,
            "stats": self.stats_id,
            "skeleton": self.skeleton_id,
        }
        return envelope.pack(
            CHUNK_META_MAGIC, CHUNK_META_VERSION, header, np.ascontiguousarray(self.tokens, dtype="<i4")
        )

    @classmethod
    def unpack(cls, data: bytes) -> ChunkMeta:
        what = "chunk header"
        h, offset = envelope.unpack(
            data, CHUNK_META_MAGIC, CHUNK_META_VERSION, _MAX_CHUNK_HEADER, what, UnsupportedVersionError
        )
        for name in ("key", "prev", "stats", "skeleton"):
            require(_is_hex_id(h.get(name)), what, name)
        require(isinstance(h.get("level"), str) and h["level"] in codec.LEVELS, what, "level")
        require(isinstance(h.get("fingerprint_key"), str), what, "fingerprint_key")
        c, begin, end = h.get("chunk_tokens"), h.get("begin"), h.get("end")
        require(is_int(c) and MIN_CHUNK_TOKENS <= c <= MAX_CHUNK_TOKENS, what, "chunk_tokens")
        require(
            is_int(begin) and is_int(end) and 0 <= begin < end <= begin + c,
            what,
            "begin/end",
        )
        require(len(data) == offset + 4 * (end - begin), what, "token count")
        return cls(
            key=h["key"],
            prev=h["prev"],
            level=h["level"],
            begin=begin,
            end=end,
            chunk_tokens=c,
            fingerprint_key=h["fingerprint_key"],
            stats_id=h["stats"],
            skeleton_id=h["skeleton"],
            tokens=_int32s(data, offset, end - begin),
        )


# ---- manifest -----------------------------------------------------------------------------------


@dataclass
class ChunkEntry:
    key: str  # H_i, hex
    sizes: dict[str, int | None]  # level -> object bytes; None: stored by an earlier save


@dataclass
class Manifest:
    """The object under a context's URL (docs/format.md, "Manifest and store layout"):

        b"LCGM", u32 version, u32 header size, JSON header, StateMeta envelope (llama.py),
        SHA-256 of the bytes before it

    The envelope is the one a whole container carries (fingerprint, scope, n_ctx, tokens, last
    logits); the header says where the K/V is. Chunked (`chunk_tokens` set): the skeleton's id, per
    level the statistics id this save wrote (None when the store had every chunk of that level),
    and per chunk its key and the sizes of its levels. Whole (`chunk_tokens` None): per level the
    id and size of a whole container under `lcg4/wholes/<id>`.
    """

    meta: StateMeta
    chunk_tokens: int | None
    skeleton: str | None = None
    stats: dict[str, str | None] = field(default_factory=dict)
    chunks: list[ChunkEntry] = field(default_factory=list)
    wholes: dict[str, tuple[str, int]] = field(default_factory=dict)

    @property
    def levels(self) -> tuple[str, ...]:
        """Levels stored, best first."""
        names = self.wholes if self.chunk_tokens is None else self.stats
        return tuple(lv for lv in codec.LEVEL_ORDER if lv in names)

    def pack(self) -> bytes:
        header = {
            "chunk_tokens": self.chunk_tokens,
            "skeleton": self.skeleton,
            "stats": self.stats,
            "chunks": [{"key": c.key, "sizes": c.sizes} for c in self.chunks],
            "wholes": {lv: {"id": i, "size": s} for lv, (i, s) in self.wholes.items()},
        }
        body = envelope.pack(MANIFEST_MAGIC, MANIFEST_VERSION, header) + self.meta.pack()
        return envelope.with_digest(body)

    @classmethod
    def unpack(cls, data: bytes) -> Manifest:
        """Verifies, parses and bounds-checks a manifest; anything malformed is a CorruptDataError
        (damaged: ChecksumError; another version: UnsupportedVersionError)."""
        what = "manifest"
        envelope.check_version(data, MANIFEST_MAGIC, MANIFEST_VERSION, what, UnsupportedVersionError)
        data = envelope.check_digest(data, what)
        h, offset = envelope.unpack(
            data, MANIFEST_MAGIC, MANIFEST_VERSION, _MAX_MANIFEST_HEADER, what, UnsupportedVersionError
        )
        manifest = cls(StateMeta.unpack(data[offset:]), h.get("chunk_tokens"))
        c, n_tokens = manifest.chunk_tokens, manifest.meta.tokens.size
        stats, chunks, wholes = h.get("stats"), h.get("chunks"), h.get("wholes")
        require(
            isinstance(stats, dict) and isinstance(chunks, list) and isinstance(wholes, dict), what, "body"
        )
        if c is None:
            require(not chunks and not stats and h.get("skeleton") is None and bool(wholes), what, "wholes")
            for level, entry in wholes.items():
                require(level in codec.LEVELS and isinstance(entry, dict), what, "wholes")
                require(_is_hex_id(entry.get("id")), what, "whole id")
                require(is_int(entry.get("size")) and entry["size"] >= 0, what, "whole size")
                manifest.wholes[level] = (entry["id"], entry["size"])
            return manifest
        require(is_int(c) and MIN_CHUNK_TOKENS <= c <= MAX_CHUNK_TOKENS, what, "chunk_tokens")
        require(not wholes and _is_hex_id(h.get("skeleton")) and bool(stats), what, "skeleton")
        require(n_tokens > 0 and len(chunks) == -(-n_tokens // c), what, "chunk count")
        for level, stats_id in stats.items():
            require(level in codec.LEVELS and (stats_id is None or _is_hex_id(stats_id)), what, "stats")
        for entry in chunks:
            require(isinstance(entry, dict) and _is_hex_id(entry.get("key")), what, "chunk key")
            sizes = entry.get("sizes")
            require(isinstance(sizes, dict) and bool(sizes), what, "chunk sizes")
            for level, size in sizes.items():
                require(
                    level in stats and (size is None or (is_int(size) and size >= 0)),
                    what,
                    "chunk sizes",
                )
            manifest.chunks.append(ChunkEntry(entry["key"], dict(sizes)))
        manifest.skeleton, manifest.stats = h["skeleton"], dict(stats)
        return manifest


def read_manifest(url: str | Path) -> Manifest:
    """The manifest at `url` (parsed and checked; no chunk is fetched)."""
    store_url, key = split_manifest_url(url)
    with stores.open_store(store_url) as store:
        return Manifest.unpack(store.get(key))


# ---- save ---------------------------------------------------------------------------------------


@dataclass
class SaveReport:
    """What `save_chunked` did."""

    url: str
    n_tokens: int
    chunk_tokens: int | None  # None: saved whole (see `fallback`)
    chunks: int
    levels: tuple[str, ...]
    objects_written: int  # chunks, statistics, skeleton, wholes (the manifest not counted)
    objects_present: int  # content-addressed objects the store already had: not uploaded again
    bytes_written: int  # the manifest included
    level_bytes: dict[str, int]  # bytes of the chunks (or whole) written per level
    fallback: str | None  # why the state was saved whole instead of in chunks
    encode_ms: float
    write_ms: float  # time spent waiting on the store (uploads overlap encoding)


class _Uploads:
    """Puts objects from one background thread while the caller encodes the next ones; at most
    `depth` objects wait in memory."""

    def __init__(self, store: stores.Store, depth: int = 2) -> None:
        self._store, self._depth = store, depth
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lcg-upload")
        self._pending: deque[Future[None]] = deque()
        self.objects = self.bytes = 0
        self.wait_s = 0.0

    def put(self, key: str, data: bytes) -> None:
        self._pending.append(self._pool.submit(self._store.put, key, data))
        self.objects += 1
        self.bytes += len(data)
        while len(self._pending) > self._depth:
            self._wait_one()

    def _wait_one(self) -> None:
        start = time.perf_counter()
        try:
            self._pending.popleft().result()
        finally:
            self.wait_s += time.perf_counter() - start

    def mark_used(self, keys: list[str]) -> None:
        """Store.mark_used after the puts before it (best effort, as Store.mark_used is)."""
        self._pending.append(self._pool.submit(self._mark_used, keys))

    def _mark_used(self, keys: list[str]) -> None:
        with contextlib.suppress(OSError, CacheGenError):
            self._store.mark_used(keys)

    def finish(self) -> None:
        while self._pending:
            self._wait_one()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def save_chunked(
    llm: llama_cpp.Llama,
    url: str | Path,
    *,
    levels: Sequence[str] = DEFAULT_LEVELS,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    seq_id: int | None = None,
    tokens: Sequence[int] | None = None,
    threads: int | None = None,
) -> SaveReport:
    """Saves the state of `llm` (every sequence, or `seq_id`) under the manifest URL `url`.

    The state is captured once; per level one chunk encoder quantizes it once; only the chunk,
    statistics and skeleton objects the store lacks are written, and the manifest last (atomic).
    Token ids default to llama-cpp-python's own (seq_id None or 0); more ids than the state holds
    positions are refused (InvalidArgumentError) before anything is written. A state that cannot be
    chunked (several sequences, a sliding-window cache without swa_full, no token ids) is saved as
    one whole container per level instead, referenced by the manifest (`fallback` says why).
    """
    levels = _check_levels(levels)
    chunk_tokens = _check_chunk_tokens(chunk_tokens)
    _seq_id_ok(llm, seq_id)
    store_url, manifest_key = split_manifest_url(url)
    meta = capture_meta(llm, seq_id, tokens)
    state = _state_array(llm, seq_id)  # no copy into bytes: the encoders read any buffer
    kind = "full_buffer" if seq_id is None else "seq_buffer"
    info = codec.inspect_state(state, kind)
    n = int(meta.tokens.size)
    lossy = lossy_level(llm, seq_id, meta.tokens)
    better = [lv for lv in levels if lossy is not None and better_level(lv, lossy)]
    if not info["chunkable"]:
        fallback = _unchunkable(meta.fingerprint)
    elif meta.fingerprint.get("attention") is not None:
        fallback = f"{meta.fingerprint['attention']} attention: a prefix's K/V saw the tokens after it"
    elif info["positions"] != (0, n):
        fallback = f"{n} token ids for a state of positions {info['positions']}: pass tokens="
    elif better:
        # chunks are keyed by their tokens: a better level would pass for their exact K/V
        fallback = f"the context holds K/V loaded at {lossy}, stored whole: as chunks at {', '.join(better)}"
        fallback += " it would pass for the exact K/V of its tokens"
    else:
        fallback = None
    manifest = Manifest(meta, chunk_tokens=None if fallback else chunk_tokens)
    start = time.perf_counter()
    with stores.open_store(store_url) as store:
        uploads = _Uploads(store)
        try:
            if fallback:
                present, level_bytes = _save_wholes(store, uploads, manifest, state, kind, levels, threads)
            else:
                present, level_bytes = _save_chunks(store, uploads, manifest, state, kind, levels, threads)
            uploads.finish()
            blob = manifest.pack()
            put_start = time.perf_counter()
            store.put(manifest_key, blob)  # last: a reader never sees a manifest without its objects
            uploads.wait_s += time.perf_counter() - put_start
        finally:
            uploads.close()
    total_s = time.perf_counter() - start
    return SaveReport(
        url=stores.redact(url),
        n_tokens=n,
        chunk_tokens=manifest.chunk_tokens,
        chunks=len(manifest.chunks),
        levels=levels,
        objects_written=uploads.objects,
        objects_present=present,
        bytes_written=uploads.bytes + len(blob),
        level_bytes=level_bytes,
        fallback=fallback,
        encode_ms=(total_s - uploads.wait_s) * 1e3,
        write_ms=uploads.wait_s * 1e3,
    )


def _unchunkable(fingerprint: dict[str, Any]) -> str:
    """Why a state cannot be cut into one sequence's token chunks, and what to change where a
    setting is the likely cause."""
    why = "the state is not one sequence at positions 0..n-1 (several sequences, or positions missing)"
    if fingerprint.get("swa_full") is False:
        why += (
            "; a sliding-window cache without swa_full keeps the window's last positions only:"
            " a context made with swa_full=True keeps every position and saves in chunks"
        )
    return why


def _put_missing(store: stores.Store, uploads: _Uploads, key: str, data: bytes) -> bool:
    """Uploads a content-addressed object unless the store has it; True when it was there."""
    if store.has(key, max_size=len(data)):  # content-addressed: these very bytes, or not ours
        return True
    uploads.put(key, data)
    return False


def _save_wholes(
    store: stores.Store,
    uploads: _Uploads,
    manifest: Manifest,
    state: np.ndarray,
    kind: str,
    levels: tuple[str, ...],
    threads: int | None,
) -> tuple[int, dict[str, int]]:
    envelope = manifest.meta.pack()  # each whole loads on its own with load_compressed_state too
    present, level_bytes = 0, {}
    for level in levels:
        blob = codec.encode(state, level, threads=threads, kind=kind, user_meta=envelope)
        whole_id = _sha256(blob)
        if _put_missing(store, uploads, _whole_key(whole_id), blob):
            present += 1
        else:
            level_bytes[level] = len(blob)
        manifest.wholes[level] = (whole_id, len(blob))
    return present, level_bytes


def _save_chunks(
    store: stores.Store,
    uploads: _Uploads,
    manifest: Manifest,
    state: np.ndarray,
    kind: str,
    levels: tuple[str, ...],
    threads: int | None,
    *,
    full_only: bool = False,
    evicting: Callable[[list[int]], list[str]] | None = None,
) -> tuple[int, dict[str, int]]:
    """Writes the chunks (with `full_only`, only the complete ones), statistics and skeleton the
    store lacks; chunks already stored are never encoded again.

    `evicting`: into a store another process may evict from least recently used first (a prompt
    cache's) while this writes. What evicting(indices of the chunks stored before) gives is marked
    used first (those chunks and what they name), the new chunks are written last first, and the
    statistics and skeleton marked used after each: an eviction meanwhile takes the chain's tail
    first and what every chunk names last (written first, they went first, with the chain's first
    chunks: every chunk written after was of no use)."""
    c = manifest.chunk_tokens
    assert c is not None
    tokens, fingerprint = manifest.meta.tokens, manifest.meta.fingerprint
    ranges = chunk_ranges(tokens.size, c)
    keys = chain_keys(fingerprint, tokens, c)
    if full_only:
        ranges, keys = ranges[: tokens.size // c], keys[: tokens.size // c]
    manifest.chunks = [ChunkEntry(key, {}) for key in keys]
    skeleton = codec.encode_skeleton(state, kind=kind)
    manifest.skeleton = _sha256(skeleton)
    present = int(_put_missing(store, uploads, _skeleton_key(manifest.skeleton), skeleton))
    fp_key = fingerprint_key(fingerprint)
    level_bytes: dict[str, int] = {}
    for level in levels:
        held = store.has_many([_chunk_key(key, level) for key in keys], max_size=chunk_bound(fingerprint, c))
        stored = [i for i, there in enumerate(held) if there]
        missing = [i for i, there in enumerate(held) if not there]
        present += len(stored)
        if evicting is not None:
            uploads.mark_used(evicting(stored))
            missing.reverse()
        for i in stored:
            manifest.chunks[i].sizes[level] = None  # stored by an earlier save: never re-encoded
        manifest.stats[level] = None
        if not missing:
            continue
        chunker = codec.Chunker(state, level, threads=threads, kind=kind)
        stats = chunker.stats()
        stats_id = hashlib.sha256(stats).digest()
        manifest.stats[level] = stats_id.hex()
        present += _put_missing(store, uploads, _stats_key(stats_id.hex()), stats)
        level_bytes[level] = 0
        for i in missing:
            begin, end = ranges[i]
            meta = ChunkMeta(
                key=keys[i],
                prev=keys[i - 1] if i else root_key(fingerprint, c).hex(),
                level=level,
                begin=begin,
                end=end,
                chunk_tokens=c,
                fingerprint_key=fp_key,
                stats_id=stats_id.hex(),
                skeleton_id=manifest.skeleton,
                tokens=tokens[begin:end],
            )
            blob = chunker.chunk(begin, end, stats_id, meta.pack())
            uploads.put(_chunk_key(keys[i], level), blob)
            if evicting is not None:
                uploads.mark_used([_stats_key(stats_id.hex()), _skeleton_key(manifest.skeleton)])
            manifest.chunks[i].sizes[level] = len(blob)
            level_bytes[level] += len(blob)
        # its quantized state (half the state's size) is released before the next level's is built
        del chunker
    return present, level_bytes


# ---- load ---------------------------------------------------------------------------------------


@dataclass
class _Fetched:
    level: str
    chunk: bytes
    meta: ChunkMeta
    stats: codec.Stats
    fetch_s: float


class _ChunkReader:
    """Fetches chunk objects and the statistics they name, verifying each against what the loader
    expects (key chain, tokens, fingerprint, positions, ids) before anything is decoded."""

    def __init__(
        self,
        store: stores.Store,
        fingerprint: dict[str, Any],
        tokens: np.ndarray,
        chunk_tokens: int,
        keys: list[str],
        candidates: list[tuple[str, ...]],
    ) -> None:
        self.store, self.tokens, self.chunk_tokens = store, tokens, chunk_tokens
        self.fingerprint = fingerprint
        self.fp_key = fingerprint_key(fingerprint)
        self.root = root_key(fingerprint, chunk_tokens).hex()
        self.keys, self.candidates = keys, candidates
        self.ranges = chunk_ranges(len(tokens), chunk_tokens)
        self.chunk_bound = chunk_bound(fingerprint, chunk_tokens)
        self._stats: dict[str, codec.Stats] = {}
        # per chunk fetched: the object read, and the statistics and skeleton it names
        self.read: dict[int, tuple[str, str, str]] = {}
        self.bytes_read = 0
        self._thread_bytes: dict[int, int] = {}  # bytes_read per reading thread

    def support(self) -> list[str]:
        """The statistics, then the skeletons, that the chunks fetched so far name (each once)."""
        named = self.read.values()
        return [*dict.fromkeys(stats for _, stats, _ in named), *sorted({skeleton for *_, skeleton in named})]

    def verified(self, key: str, object_id: str, what: str, data: bytes) -> bytes:
        """`data`, read from `key`: a content-addressed object whose sha256 must be its id; one
        damaged where it is stored is discarded (`discard_damaged`). Kept, damaged statistics
        failed every load of the chunks naming them for good: saving the same state again makes
        statistics of the same id, which a save skips as present (a prompt cache missed and wrote
        those chunks again at every completion)."""
        self._count(len(data))
        if _sha256(data) != object_id:
            raise self.discard_damaged(CorruptDataError(f"{what} {key!r} does not hash to its id"), key, data)
        return data

    def _get_within(self, key: str, bound: int) -> bytes:
        """The object at `key`, read no further than `bound`, which no such object passes: one
        past it is removed, as a damaged one is (it would fail every load naming it, and a save
        skips an object that exists)."""
        try:
            return self.store.get(key, max_size=bound)
        except LimitExceededError:
            with contextlib.suppress(CacheGenError):
                self.store.delete(key)
            raise

    def skeleton(self, skeleton_id: str) -> bytes:
        """The skeleton `skeleton_id`, read no further than one of these tokens can hold (a
        heuristic bound: one past it is refused, not removed)."""
        key = _skeleton_key(skeleton_id)
        data = self.store.get(key, max_size=_skeleton_bound(self.fingerprint, len(self.tokens)))
        return self.verified(key, skeleton_id, "skeleton", data)

    def skeleton_state(self, skeleton_id: str, skeleton: bytes) -> np.ndarray:
        """The state of the tokens' positions with zero K/V, built from `skeleton`. One that hashes
        to its id and is no skeleton, or one whose cells are not those of its positions or whose
        state passes the model's bound, was forged or written by a broken writer: a
        CorruptDataError, and discarded as a damaged one. (A prefix of a state with a recurrent
        part is refused as before: UnsupportedFormatError.)"""
        n_pos, key = len(self.tokens), _skeleton_key(skeleton_id)
        try:
            bound = _state_bound(self.fingerprint, n_pos, skeleton)
            return codec.skeleton_state(skeleton, n_pos, max_size=bound, alloc=codec.empty_buffer)
        except (CorruptDataError, NotAContainerError) as exc:
            bad = CorruptDataError(f"skeleton {key!r} builds no state of {n_pos} positions: {exc}")
            raise self.discard_damaged(bad, key, skeleton) from exc

    def discard_damaged(self, exc: CorruptDataError, key: str, data: bytes) -> CorruptDataError:
        """`exc`, which `data` (read from `key`) failed verification with; the object is deleted
        when the store still holds these very bytes: damaged where it is stored (damage on the way
        does not repeat byte for byte), it would fail every load, and a save skips an object that
        exists. Content-addressed, it is written again by the next save of any context holding it;
        the error says so."""
        if not self._remove(key, data):
            return exc
        note = "damaged where it is stored: removed, so that saving the context again writes it"
        new = type(exc)(f"{exc} ({note})")
        new.__cause__ = exc
        return new

    def _remove(self, key: str, data: bytes) -> bool:
        """Deletes `key` if the store still holds `data` there; False when it did not."""
        try:
            return self.store.get(key, max_size=len(data)) == data and self.store.delete(key)
        except CacheGenError:
            return False  # gone meanwhile, or this reader may not delete: leave it

    def discard_orphan(self, key: str, chunk: bytes, missing: str) -> bool:
        """Deletes the chunk `key` (these bytes) that names the object `missing`, which the store
        no longer has (evicted, deleted): it would fail every load, and a save skips a chunk that
        exists. The next save of its tokens writes it again with objects of its own. True when
        it was removed."""
        if not self._remove(key, chunk):
            return False
        _log.warning("%s names %s, which the store lacks: removed", key, missing)
        return True

    def _count(self, n: int) -> None:
        self.bytes_read += n
        ident = threading.get_ident()
        self._thread_bytes[ident] = self._thread_bytes.get(ident, 0) + n

    def count_this_thread(self) -> None:
        """Starts bytes_of this thread from 0 (a thread id can be one an ended thread had)."""
        self._thread_bytes[threading.get_ident()] = 0

    def bytes_of(self, thread_id: int) -> int:
        """Bytes read so far by the gets of thread `thread_id`, since count_this_thread there."""
        return self._thread_bytes.get(thread_id, 0)

    def fetch(self, i: int, levels: Sequence[str] | None = None) -> _Fetched:
        """Chunk i at the first of `levels` (default: its candidates) that the store has; an error
        of the chunk itself (not of the store) names it (CacheGenError.chunk)."""
        try:
            return self._fetch(i, levels)
        except CacheGenError as exc:
            if not isinstance(exc, StoreError):
                exc.chunk = i
            raise

    def _fetch(self, i: int, levels: Sequence[str] | None) -> _Fetched:
        start = time.perf_counter()
        orphaned = False
        for level in self.candidates[i] if levels is None else levels:
            try:
                chunk = self._get_within(_chunk_key(self.keys[i], level), self.chunk_bound)
            except EntryNotFoundError:
                continue  # evicted since the manifest was written: the next level may be there
            self._count(len(chunk))
            try:
                meta = self._check(i, level, chunk)
            except ModelMismatchError:
                raise
            except CorruptDataError as exc:
                raise self.discard_damaged(exc, _chunk_key(self.keys[i], level), chunk)  # noqa: B904
            if meta.stats_id not in self._stats:
                stats_key = _stats_key(meta.stats_id)
                try:
                    stored = self._get_within(stats_key, _stats_bound(self.fingerprint))
                except EntryNotFoundError:
                    orphaned |= self.discard_orphan(_chunk_key(self.keys[i], level), chunk, stats_key)
                    continue  # the next level may be there
                data = self.verified(stats_key, meta.stats_id, "statistics", stored)
                self._stats[meta.stats_id] = codec.Stats(data, bytes.fromhex(meta.stats_id))
            named = (_stats_key(meta.stats_id), _skeleton_key(meta.skeleton_id))
            self.read[i] = (_chunk_key(self.keys[i], level), *named)
            return _Fetched(level, chunk, meta, self._stats[meta.stats_id], time.perf_counter() - start)
        message = f"chunk {i} ({self.keys[i]}) is stored at none of the levels " + ", ".join(
            self.candidates[i] if levels is None else levels
        )
        if orphaned:
            message += " (one that named statistics the store lacks was removed)"
        raise ChunkMissingError(message, i)

    def _check(self, i: int, level: str, chunk: bytes) -> ChunkMeta:
        meta = ChunkMeta.unpack(codec.user_meta(chunk))  # checksum-verified by the native library
        name = f"chunk {i} ({_chunk_key(self.keys[i], level)})"
        if meta.fingerprint_key != self.fp_key:
            raise ModelMismatchError(f"{name} was saved from another model or KV layout")
        prev = self.keys[i - 1] if i else self.root
        if meta.key != self.keys[i] or meta.prev != prev or meta.level != level:
            raise CorruptDataError(f"{name} holds another chunk (key {meta.key}, level {meta.level})")
        if next_key(bytes.fromhex(meta.prev), meta.tokens).hex() != meta.key:
            raise CorruptDataError(f"{name}: its key does not recompute from its tokens")
        begin, end = self.ranges[i]
        if (meta.begin, meta.end, meta.chunk_tokens) != (begin, end, self.chunk_tokens) or not np.array_equal(
            meta.tokens, self.tokens[begin:end]
        ):
            raise CorruptDataError(f"{name} holds other tokens or positions than expected")
        info = codec.inspect(chunk)
        if info["part"] != "chunk" or info["positions"] != (begin, end) or info["stats_id"] != meta.stats_id:
            raise CorruptDataError(f"{name}: its container disagrees with its header")
        if info["level"] != level:
            raise CorruptDataError(f"{name} is coded at level {info['level']}")
        return meta


class ChunkMissingError(EntryNotFoundError):
    """Chunk `chunk` of a prefix cannot be read (gone since the lookup, or it names statistics or,
    as the prefix's last, a skeleton that are gone): the chunks before it may still serve."""

    def __init__(self, message: str, chunk: int) -> None:
        super().__init__(message)
        self.chunk = chunk


def _cell_bound(fingerprint: dict[str, Any]) -> int:
    """An upper bound on one position's K/V bytes: four times any f32 K+V layout of two caches."""
    return 64 * int(fingerprint.get("n_layer") or 0) * int(fingerprint.get("n_embd") or 0)


def chunk_bound(fingerprint: dict[str, Any], chunk_tokens: int) -> int:
    """The most a chunk object can hold: a store's object past it is read no further."""
    return chunk_tokens * _cell_bound(fingerprint) + _MAX_CHUNK_HEADER + (1 << 20)


def _skeleton_bound(fingerprint: dict[str, Any], n_pos: int) -> int:
    """The most a skeleton can hold (a state but its K/V rows; llama.cpp writes no logits in one):
    the records of its cells (24 bytes at most for a cell of one sequence, in each of two caches)
    for up to 2^20 positions or n_pos, and a recurrent state of 128 cells' worth (a Mamba-2 layer's
    of state size 256 is 32; wider SSMs more). A prefix load's skeleton is the saver's, of as many
    positions as it had."""
    return (1 << 20) + 64 * max(n_pos, 1 << 20) + 128 * _cell_bound(fingerprint)


def _stats_bound(fingerprint: dict[str, Any]) -> int:
    """The most a statistics object can hold: its tables, steps and means are per channel, tens of
    bytes each (a few hundred KB for SmolLM2), not per position."""
    return 64 * _cell_bound(fingerprint) + (1 << 20)


def whole_bound(fingerprint: dict[str, Any], n_pos: int) -> int:
    """The most a container of n_pos positions, or a manifest of that many tokens, can hold: a
    skeleton, the K/V, and the envelope (tokens, the last logits, a header)."""
    envelope_bound = 4 * n_pos + 4 * int(fingerprint.get("n_vocab") or 0) + _MAX_MANIFEST_HEADER
    return _skeleton_bound(fingerprint, n_pos) + n_pos * _cell_bound(fingerprint) + envelope_bound


def _state_bound(fingerprint: dict[str, Any], n_pos: int, skeleton: bytes) -> int:
    """An upper bound on the skeleton's whole state (a prefix of n_pos positions is cut from it),
    plus the skeleton's own bytes. Refuses a forged skeleton asking for far more (a 368-byte one
    asked for 676 MB)."""
    positions = max(n_pos, int(codec.inspect(skeleton)["positions"][1]))
    return len(skeleton) + positions * _cell_bound(fingerprint)


def _assemble(
    reader: _ChunkReader, skeleton_id: str | None, threads: int | None
) -> tuple[np.ndarray, bytes, dict[str, Any]]:
    """Fetches and decodes every chunk into a state built from the skeleton. The fetches run one
    after another on a thread of their own, ahead of the decodes, and each decode takes every chunk
    that has arrived by then (the native decode releases the GIL): `codec.decode_chunks` reads a
    tensor's decode tables once for all of them. With `skeleton_id` None the skeleton named by the
    last chunk is used, so that chunk is fetched first.

    Returns the state, the skeleton and timing/level figures.
    """
    n_chunks = len(reader.keys)
    order = list(range(n_chunks))
    ready: deque[_Fetched] = deque()  # fetched, not decoded, in order
    if skeleton_id is None:
        order = [n_chunks - 1, *range(n_chunks - 1)]
        ready.append(reader.fetch(order[0]))
        skeleton_id = ready[0].meta.skeleton_id
    try:
        skeleton = reader.skeleton(skeleton_id)
        state = reader.skeleton_state(skeleton_id, skeleton)
    except (EntryNotFoundError, CorruptDataError, AuthenticationError) as exc:  # gone, damaged (so
        # removed), or without the key's tag (not ours to remove: a save with the key writes it over)
        if not ready:
            raise
        # the last chunk named it: the prefix cannot end there (the chunk is kept: a longer
        # prefix through it ends at a chunk naming a skeleton that may be there)
        raise ChunkMissingError(f"{exc}, named by the last chunk", len(reader.keys) - 1) from exc
    levels: dict[str, int] = {}
    lossy: tuple[int, str] | None = None  # (first position of lossy K/V, the worst level)
    fetch_s = decode_s = 0.0
    with ThreadPoolExecutor(1, thread_name_prefix="lcg-fetch") as pool:
        fetches = deque(pool.submit(reader.fetch, i) for i in order[len(ready) :])
        try:
            while ready or fetches:
                if not ready:
                    ready.append(fetches.popleft().result())
                while fetches and fetches[0].done():
                    ready.append(fetches.popleft().result())
                batch = [ready.popleft()]
                while ready and ready[0].stats is batch[0].stats:
                    batch.append(ready.popleft())
                start = time.perf_counter()
                try:
                    codec.decode_chunks([got.chunk for got in batch], batch[0].stats, state, threads=threads)
                except CorruptDataError as exc:
                    raise _damaged_in(reader, batch, state, exc)  # noqa: B904
                decode_s += time.perf_counter() - start
                for got in batch:
                    fetch_s += got.fetch_s
                    levels[got.level] = levels.get(got.level, 0) + 1
                    if got.level != "lossless":
                        lossy = worse_load(lossy, _first_lossy(got), got.level)
        finally:
            for pending in fetches:
                pending.cancel()
    return state, skeleton, {"levels": levels, "fetch_s": fetch_s, "decode_s": decode_s, "lossy": lossy}


def _first_lossy(got: _Fetched) -> int:
    """The first position of a lossy chunk's K/V that may not come back exact: a lossy level keeps
    the state's first `sink_tokens` positions (attention sinks) exact."""
    begin, end = got.meta.begin, got.meta.end
    if begin > 0:
        return begin
    return min(max(0, int(codec.inspect(got.chunk)["sink_tokens"])), end)


def _damaged_in(
    reader: _ChunkReader, batch: list[_Fetched], state: np.ndarray, exc: CorruptDataError
) -> CorruptDataError:
    """The error of a batch that failed to decode, from the chunk that fails alone (discarded when
    damaged where it is stored: _ChunkReader.discard_damaged)."""
    for got in batch:
        try:
            codec.decode_chunk(got.chunk, got.stats, state, threads=1)
        except CorruptDataError as alone:
            damaged = reader.discard_damaged(alone, _chunk_key(got.meta.key, got.level), got.chunk)
            damaged.chunk = reader.keys.index(got.meta.key)
            return damaged
    return exc


def _candidates(sizes: dict[str, Any], level: str | int | None, index: int) -> tuple[str, ...]:
    if level is None:
        return tuple(lv for lv in codec.LEVEL_ORDER if lv in sizes)
    level = codec.level_name(level)
    if level not in sizes:
        raise EntryNotFoundError(f"chunk {index} is not stored at level {level!r} (only {', '.join(sizes)})")
    return (level,)


def _target(scope: str, seq_id: int | None) -> int | None:
    """Where a state of `scope` goes: the whole context, or sequence `seq_id` (default 0)."""
    if scope == "all":
        if seq_id is not None:
            raise InvalidArgumentError("this state holds the whole context: load it with seq_id=None")
        return None
    return 0 if seq_id is None else seq_id


def _check_room(llm: llama_cpp.Llama, n_tokens: int) -> None:
    if n_tokens > seq_room(llm):
        raise ModelMismatchError(f"context too small: the state holds {n_tokens} tokens, {room_message(llm)}")


def load_chunked(
    llm: llama_cpp.Llama,
    url: str | Path,
    *,
    level: str | None = None,
    seq_id: int | None = None,
    threads: int | None = None,
    manifest: bytes | None = None,
) -> LoadReport:
    """Loads a context saved by `save_chunked`: per chunk the best level stored (or `level`).

    Every object is verified (key chain, tokens, fingerprint, ids, checksums) and decoded into one
    buffer before the context is touched, which then takes it in one llama.cpp call; on any error
    the context is left as it was. `manifest` passes the manifest's bytes when already read.
    A whole-context state needs seq_id None; a sequence state goes into `seq_id` (default 0).
    A whole container at `url` (a save with `level=`) loads as `load_compressed_state` loads it,
    where `level` is its own or None.
    """
    t0 = time.perf_counter()
    if level is not None:
        level = codec.level_name(level)
    store_url, key = split_manifest_url(url)
    fingerprint = model_fingerprint(llm)
    with stores.open_store(store_url) as store:
        # a manifest, or a whole container, of at most the context's size
        data = store.get(key, whole_bound(fingerprint, llm.n_ctx())) if manifest is None else bytes(manifest)
        if not envelope.is_manifest(data) and _whole_at(data, level, url):
            return load_compressed_state(llm, data, seq_id=seq_id, threads=threads)
        m = Manifest.unpack(data)
        check_fingerprint(m.meta.fingerprint, fingerprint)
        target = _target(m.meta.scope, seq_id)
        _seq_id_ok(llm, target)
        tokens = m.meta.tokens
        _check_room(llm, int(tokens.size))
        if m.chunk_tokens is None:
            return _load_whole(llm, store, m, level, seq_id, threads, len(data))
        keys = chain_keys(fingerprint, tokens, m.chunk_tokens)
        if keys != [c.key for c in m.chunks]:
            raise CorruptDataError("the manifest's chunk keys do not recompute from its tokens")
        candidates = [_candidates(c.sizes, level, i) for i, c in enumerate(m.chunks)]
        reader = _ChunkReader(store, fingerprint, tokens, m.chunk_tokens, keys, candidates)
        t1 = time.perf_counter()
        state, _, figures = _assemble(reader, m.skeleton, threads)
    t2 = time.perf_counter()
    restore_context(llm, state, target, tokens, m.meta.logits, figures["lossy"], m.meta.seed)
    t3 = time.perf_counter()
    bytes_read = len(data) + reader.bytes_read
    return LoadReport(
        tokens=int(tokens.size) if target in (None, 0) else 0,
        cells=int(tokens.size),
        bytes_read=bytes_read,
        state_bytes=len(state),
        ratio=len(state) / bytes_read,
        read_ms=(t1 - t0 + figures["fetch_s"]) * 1e3,
        decode_ms=figures["decode_s"] * 1e3,
        restore_ms=(t3 - t2) * 1e3,
        seq_id=target,
        extra={
            "chunks": len(keys),
            "chunk_tokens": m.chunk_tokens,
            "levels": figures["levels"],
            "assemble_ms": (t2 - t1) * 1e3,  # fetch and decode overlapped
        },
    )


def _whole_at(data: bytes, level: str | None, url: str | Path) -> bool:
    """Whether `data`, where a manifest was expected, is a whole container to load at `level`; one
    of another level is refused, naming its own (it was "not a llama-cachegen manifest"), and so is
    another part of a chunked context. A damaged container raises what is wrong with it."""
    try:
        stored = codec.inspect(data)
    except NotAContainerError:
        return False  # neither: Manifest.unpack says what it found
    where = stores.redact(str(url))
    if stored["part"] != "whole":
        raise InvalidArgumentError(
            f"{where} is a chunked context's {stored['part']} object: load the context from its manifest"
        )
    if level not in (None, stored["level"]):
        raise InvalidArgumentError(
            f"{where} holds one whole container at {stored['level']}, not a chunked context: "
            f"level={level!r} is not stored there"
        )
    return True


def _load_whole(
    llm: llama_cpp.Llama,
    store: stores.Store,
    m: Manifest,
    level: str | None,
    seq_id: int | None,
    threads: int | None,
    manifest_bytes: int,
) -> LoadReport:
    """The fallback of states saved whole: the best level stored, checked against its id, then
    load_compressed_state (which checks its envelope again and rolls back on refusal)."""
    for name in _candidates(m.wholes, level, 0):
        whole_id, _ = m.wholes[name]
        try:
            # the context's size, not the tokens' (a save may name few or none of them)
            blob = store.get(_whole_key(whole_id), whole_bound(m.meta.fingerprint, llm.n_ctx()))
        except EntryNotFoundError:
            continue
        if _sha256(blob) != whole_id:
            raise CorruptDataError(f"whole container {_whole_key(whole_id)!r} does not hash to its id")
        report = load_compressed_state(llm, blob, seq_id=seq_id, threads=threads)
        report.bytes_read += manifest_bytes
        report.extra.update(chunks=0, chunk_tokens=None, levels={name: 1})
        return report
    raise EntryNotFoundError(f"none of the whole containers ({', '.join(m.wholes)}) is in the store")


@dataclass
class PrefixMatch:
    """The longest prefix of a token list whose chunks a store holds."""

    chunk_tokens: int
    chunks: int
    positions: int  # tokens covered (the last matched chunk may be partial)
    keys: list[str]
    levels: list[tuple[str, ...]]  # per chunk the levels stored, best first

    def cut(self, chunks: int) -> None:
        """Keeps the first `chunks` chunks."""
        self.chunks = min(self.chunks, chunks)
        self.positions = min(self.positions, self.chunks * self.chunk_tokens)
        del self.keys[self.chunks :], self.levels[self.chunks :]


def longest_prefix(
    store_url: str | Path,
    llm: llama_cpp.Llama,
    tokens: Sequence[int],
    *,
    chunk_tokens: int | None = None,
) -> PrefixMatch:
    """Walks the chained keys of `tokens` with `exists` calls only (no K/V is fetched), at
    `chunk_tokens` or, with None, at the size the store holds them at (`_match_sized`)."""
    with stores.open_store(str(store_url)) as store:
        return _match_sized(store, model_fingerprint(llm), token_ids(llm, tokens), chunk_tokens)


_MATCH_ROUND = 4  # chunks in a bulk prefix lookup's first round: a miss costs one round trip


def _match(
    store: stores.Store,
    fingerprint: dict[str, Any],
    tokens: np.ndarray,
    chunk_tokens: int,
    probe: Sequence[str] = codec.LEVEL_ORDER,
) -> PrefixMatch:
    """The stored chunks that start `tokens`, each with the levels of `probe` it is stored at (a
    caller of one level asks for it alone: a prompt cache looks up at every completion). A store
    that asks many keys in one round trip (bulk_exists) is asked in rounds of 4, 16, 64, ...
    chunks: one request per key took 0.5 ms each on a local HTTP store, and a proxy asks about
    every level of every chunk of every prompt. Others are asked chunk by chunk, up to the first
    chunk stored at none."""
    chain = chain_keys(fingerprint, tokens, chunk_tokens)
    keys: list[str] = []
    levels: list[tuple[str, ...]] = []
    size = _MATCH_ROUND if store.bulk_exists else 1
    while len(keys) < len(chain):
        batch = chain[len(keys) : len(keys) + size]
        flags = iter(store.exists_many([_chunk_key(key, lv) for key in batch for lv in probe]))
        found = [tuple(lv for lv in probe if next(flags)) for _ in batch]
        n = found.index(()) if () in found else len(found)  # the prefix ends at a chunk stored at none
        keys += batch[:n]
        levels += found[:n]
        if n < len(batch):
            break
        size *= 4 if store.bulk_exists else 1
    positions = min(len(keys) * chunk_tokens, int(tokens.size))
    return PrefixMatch(chunk_tokens, len(keys), positions, keys, levels)


def _match_to_tail(
    store: stores.Store,
    fingerprint: dict[str, Any],
    tokens: np.ndarray,
    chunk_tokens: int,
    probe: Sequence[str],
) -> PrefixMatch:
    """_match, then where it stops before the tokens end, the longest partial chunk stored right
    after its chunks, shorter than the query's chunk there: a save's last chunk is as long as its
    tokens ran, and its key covers only those, so a query that extends a saved context (its
    follow-up question) matched up to the last whole chunk and computed the rest of the save again
    (a 200-token save at 256-token chunks: all of it). Every length is asked in one exists_many,
    at the levels of the chunk before (a save writes every chunk at its levels), on a store that
    answers many keys at once or a local one: elsewhere (HTTP without a token: a HEAD per key) up
    to 1,020 requests would cost more than the tokens they save."""
    match = _match(store, fingerprint, tokens, chunk_tokens, probe)
    c, begin = chunk_tokens, match.chunks * chunk_tokens
    span = min(c, int(tokens.size) - begin)  # the query's chunk there, already asked
    if span < 2 or not (store.bulk_exists or store.local):
        return match
    prev = bytes.fromhex(match.keys[-1]) if match.keys else root_key(fingerprint, c)
    levels = match.levels[-1] if match.levels else probe
    keys = [next_key(prev, tokens[begin : begin + n]).hex() for n in range(1, span)]
    flags = iter(store.exists_many([_chunk_key(key, lv) for key in keys for lv in levels]))
    found = [tuple(lv for lv in levels if next(flags)) for _ in keys]
    for n in range(len(keys), 0, -1):
        if found[n - 1]:
            match.chunks += 1
            match.positions = begin + n
            match.keys.append(keys[n - 1])
            match.levels.append(found[n - 1])
            break
    return match


def _match_sized(
    store: stores.Store,
    fingerprint: dict[str, Any],
    tokens: np.ndarray,
    chunk_tokens: int | None,
    probe: Sequence[str] = codec.LEVEL_ORDER,
) -> PrefixMatch:
    """_match_to_tail at `chunk_tokens`; None: the default size first, and where the store holds not even
    the first chunk at it, the other sizes of PROBED_CHUNK_TOKENS: their first chunks in one request,
    then the chains of those stored, the longest taken. Chunks of the prompt cache (128 tokens) or
    of a save at another size are found without the caller knowing their size (a lookup at the
    default found none, silently); a size that is no power of two is found only when named."""
    if chunk_tokens is not None:
        return _match_to_tail(store, fingerprint, tokens, chunk_tokens, probe)
    match = _match_to_tail(store, fingerprint, tokens, DEFAULT_CHUNK_TOKENS, probe)
    if match.positions >= min(DEFAULT_CHUNK_TOKENS, int(tokens.size)):  # a whole chunk, or all the tokens
        return match
    sizes = [c for c in PROBED_CHUNK_TOKENS if c != DEFAULT_CHUNK_TOKENS]
    # a size past the tokens: one partial chunk of them all (a save as short as they are)
    firsts = [chain_keys(fingerprint, tokens[:c], c)[0] for c in sizes]
    flags = iter(store.exists_many([_chunk_key(key, lv) for key in firsts for lv in probe]))
    for c in [c for c in sizes if any([next(flags) for _ in probe])]:
        found = _match_to_tail(store, fingerprint, tokens, c, probe)
        if found.positions > match.positions:
            match = found
    return match


def load_prefix(
    llm: llama_cpp.Llama,
    store_url: str | Path,
    tokens: Sequence[int],
    *,
    chunk_tokens: int | None = None,
    level: str | None = None,
    seq_id: int | None = None,
    threads: int | None = None,
) -> LoadReport:
    """Loads the longest stored prefix of `tokens` (no manifest needed: any save that stored those
    chunks serves), with the skeleton named by its last chunk; chunks of `chunk_tokens` or, with
    None, of the size the store holds them at (`longest_prefix`). Finds nothing: returns a report of
    0 tokens and leaves the context alone. Else as `load_chunked`; the tokens after the prefix are
    the caller's to evaluate. The skeleton decides the scope: a whole-context save needs seq_id
    None, a sequence save goes into `seq_id` (default 0).
    """
    t0 = time.perf_counter()
    if level is not None:
        level = codec.level_name(level)  # a number too, as load_chunked takes it
    _seq_id_ok(llm, seq_id)
    query = token_ids(llm, tokens)
    fingerprint = model_fingerprint(llm)
    with stores.open_store(str(store_url)) as store:
        # with a level, the prefix ends at the first chunk without it
        match = _match_sized(
            store, fingerprint, query, chunk_tokens, codec.LEVEL_ORDER if level is None else (level,)
        )
        _check_room(llm, match.positions)  # a cut below only shortens the prefix
        while True:  # a chunk that cannot be read (ChunkMissingError): the chunks before it
            if not match.chunks:
                elapsed = (time.perf_counter() - t0) * 1e3
                extra = {"chunks": 0, "match": match}
                return LoadReport(0, 0, 0, 0, 0.0, elapsed, 0.0, 0.0, seq_id, extra=extra)
            prefix = query[: match.positions]
            candidates = [(level,) if level else lv for lv in match.levels]
            reader = _ChunkReader(store, fingerprint, prefix, match.chunk_tokens, match.keys, candidates)
            t1 = time.perf_counter()
            try:
                state, skeleton, figures = _assemble(reader, None, threads)
                break
            except ChunkMissingError as exc:
                match.cut(exc.chunk)
            except UnsupportedFormatError as exc:
                if not has_recurrent_state(llm):
                    raise
                raise UnsupportedFormatError(
                    f"{exc}: the stored context runs past the {match.positions} tokens of this prompt that "
                    "whole chunks match, and this model's recurrent state is of its last token only; "
                    "load it whole (load_chunked of its manifest) or use the prompt cache, which keeps "
                    "whole contexts of such models"
                ) from None
    target = _target("all" if codec.inspect(skeleton)["kind"] == "full_buffer" else "seq", seq_id)
    t2 = time.perf_counter()
    restore_context(llm, state, target, prefix, None, figures["lossy"])
    t3 = time.perf_counter()
    return LoadReport(
        tokens=match.positions if target in (None, 0) else 0,
        cells=match.positions,
        bytes_read=reader.bytes_read,
        state_bytes=len(state),
        ratio=len(state) / reader.bytes_read,
        read_ms=(t1 - t0 + figures["fetch_s"]) * 1e3,
        decode_ms=figures["decode_s"] * 1e3,
        restore_ms=(t3 - t2) * 1e3,
        seq_id=target,
        extra={
            "chunks": match.chunks,
            "levels": figures["levels"],
            "match": match,
            "assemble_ms": (t2 - t1) * 1e3,
        },
    )
