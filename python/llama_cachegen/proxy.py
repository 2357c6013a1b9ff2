"""A proxy before one llama-server that shares context prefixes with other servers through a store.

    client ─▶ proxy ─▶ llama-server (--slot-save-path DIR)          one proxy per server;
                 │                                                    every proxy uses one store
                 └──▶ store: chunks of K/V under chained token hashes (chunks.py)

Every request goes through unchanged (OpenAI-compatible and native endpoints, SSE streams chunk by
chunk). A completion request (`/completion`, `/completions`, `/v1/completions`, `/chat/completions`,
`/v1/chat/completions`) is first tokenized by the server (chat messages through its
`/apply-template`, then `/tokenize` as the completion handler tokenizes), and a slot is chosen
(the idle one that already holds the longest part of the prompt). When the store holds a longer
prefix of the prompt than that slot, the proxy fetches and decodes its chunks into one sequence
state, writes it into DIR as a llama.cpp sequence file and asks the server to restore it
(`POST /slots/{id}?action=restore`); the request then goes to that slot with `cache_prompt` on, so
the server computes only the rest. After the response, in the background, the proxy saves the slot
(`action=save`), reads the file and uploads the chunks the store lacks.

A prefix whose load would not beat the slot, a store that is down, a chunk that fails verification
or a restore the server refuses: the request goes on as if there were no proxy, with a warning. The
server matches the restored tokens against the prompt itself, so a wrong guess costs time, never
a wrong answer.

Fingerprint (chunks are keyed by it): the model from the GGUF the server loaded (`/props`
model_path: architecture, sizes and llama.py's model hash), the KV stream count read from a slot
save at start-up, the llama.cpp build from `/props` build_info; what /props does not tell (K/V
types, flash attention, --swa-full) comes from the proxy's own options, which must mirror the
server's. A mismatch there is caught by llama.cpp on restore (a refused restore is a miss), never
served.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import signal
import struct
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web

from . import chunks, codec, stores
from .errors import CacheGenError, CorruptDataError, InvalidArgumentError, UnsupportedFormatError
from .llama import FINGERPRINT_FIELDS, StateMeta, _file_identity, _model_files, _model_hash, better_level
from .llama_format import GGML_TYPE_NAMES, GGML_TYPES, GGSQ_MAGIC, GGSQ_VERSION, IO_MAGIC
from .stores.http import TOKEN_ENV, bearer_ok, is_loopback, load_token

log = logging.getLogger("llama_cachegen.proxy")

# docs/llama-state.md: a sequence buffer starts with IO_MAGIC and a seq id, a sequence file
# ('ggsq' v3) with its header and tokens; both go on with the same MEMORY bytes.
_GGSQ_HEAD = struct.Struct("<III")
_SEQ_HEAD = struct.Struct("<Ii")
# llama-server writes its slot's tokens packed (tools/server/server-common.cpp, server_tokens::
# serialize): -1, version 1, u32 n, n tokens, u32 media count, media. It reads a plain list too.
_PACKED_MARKER, _PACKED_VERSION = -1, 1

COMPLETION_PATHS = frozenset({"/completion", "/completions", "/v1/completions"})
CHAT_PATHS = frozenset({"/chat/completions", "/v1/chat/completions"})
# POSTs that touch no slot; any other that passes through may put K/V in a slot that the proxy did
# not see computed (/v1/messages ignores n_cache_reuse: a server's --cache-reuse moves K/V there)
_SLOTLESS_POSTS = frozenset(
    {
        "/tokenize",
        "/detokenize",
        "/apply-template",
        "/chat/completions/input_tokens",
        "/v1/chat/completions/input_tokens",
        "/responses/input_tokens",
        "/v1/responses/input_tokens",
        "/v1/messages/count_tokens",
    }
)
STATS_PATH = "/llama-cachegen/stats"
RESTORED_HEADER = "X-Llama-Cachegen-Restored"  # prompt tokens restored from the store
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_TAIL_BYTES = 1 << 16  # the end of a response, where llama-server puts its timings
# the token the proxy's own clients send; an HTTP store's is LLAMA_CACHEGEN_TOKEN (stores.http), so
# that a proxy can hold both (one variable for both made a loopback proxy on a token store refuse
# its clients, who were to send the store's token)
PROXY_TOKEN_ENV = "LLAMA_CACHEGEN_PROXY_TOKEN"
# a server's reuse of at most this many positions reuses exact K/V, whatever put them there: every
# lossy level stores its first positions (sink tokens) exactly; a shared BOS is reused by every
# prompt, and a slot holding K/V of unknown origin was otherwise never uploaded from again
_EXACT_REUSE = 4
_START_WAIT_S = 120.0  # how long start-up waits for the server to answer /props
_LOAD_WAIT_S = 10.0  # longest a prefix load may take before the server's speed is measured
_MIN_LOAD_S = 1.0  # ... and at least this long after
_MAX_PENDING_UPLOADS = 2  # saved slots waiting for the uploader (each holds a state in memory)
_SLOTS_WAIT_S = 1.0  # longest wait for GET /slots (answered between the server's batches)
_MAX_LOSSY = 4096  # lossy restores remembered one by one (LossyRestores)
_MAX_NAMED = 1 << 16  # chunk objects whose statistics and skeleton a proxy remembers (Sharing._remember)
# bytes per token per level, relative to the f16 state, until the proxy has measured its own
_GUESS_RATIO = {"lossless": 0.8, "high": 0.3, "balanced": 0.22, "compact": 0.15}


class ServerStatusError(CacheGenError):
    """llama-server answered a call of the proxy's own with an error status."""

    def __init__(self, http_status: int, message: str) -> None:
        super().__init__(message)
        self.http_status = http_status


# ---- slot files ---------------------------------------------------------------------------------


def read_slot_file(data: bytes) -> tuple[np.ndarray, int]:
    """(tokens, offset of MEMORY) of a llama.cpp sequence file as llama-server saves a slot: the
    token list plain or packed by llama-server. CorruptDataError on anything else (media tokens
    included: their K/V is not a function of token ids)."""
    if len(data) < _GGSQ_HEAD.size:
        raise CorruptDataError("slot file shorter than its header")
    magic, version, n = _GGSQ_HEAD.unpack_from(data)
    if magic != GGSQ_MAGIC or version != GGSQ_VERSION:
        raise CorruptDataError(
            f"not a 'ggsq' v{GGSQ_VERSION} slot file (magic {magic:#x}, version {version})"
        )
    offset = _GGSQ_HEAD.size + 4 * n
    if offset > len(data):
        raise CorruptDataError(f"slot file declares {n} token words, beyond its size")
    packed = np.frombuffer(data, dtype="<i4", count=n, offset=_GGSQ_HEAD.size)
    if n and packed[0] == _PACKED_MARKER:
        if n < 4 or packed[1] != _PACKED_VERSION or not 0 <= packed[2] <= n - 4:
            raise CorruptDataError("unreadable packed token list in the slot file")
        count = int(packed[2])
        if packed[3 + count] != 0 or n != count + 4:
            raise CorruptDataError("the slot holds media tokens: not shareable")
        return packed[3 : 3 + count].astype(np.intc), offset
    return packed.astype(np.intc), offset


def slot_file_to_seq_buffer(data: bytes) -> tuple[np.ndarray, bytes]:
    """(tokens, the same state as a sequence buffer of seq 0), the layout llama-cpp-python's
    sequence saves use, so that chunks and skeletons are cut from one kind of state."""
    tokens, offset = read_slot_file(data)
    return tokens, _SEQ_HEAD.pack(IO_MAGIC, 0) + data[offset:]


def seq_buffer_to_slot_file(state: bytes | bytearray, tokens: np.ndarray) -> bytes:
    """A sequence file for `action=restore`: plain token list, then the buffer's MEMORY."""
    if len(state) < _SEQ_HEAD.size or _SEQ_HEAD.unpack_from(state)[0] != IO_MAGIC:
        raise CorruptDataError("the assembled state is not a sequence buffer")
    toks = np.ascontiguousarray(tokens, dtype="<i4")
    return (
        _GGSQ_HEAD.pack(GGSQ_MAGIC, GGSQ_VERSION, toks.size)
        + toks.tobytes()
        + memoryview(state)[_SEQ_HEAD.size :]
    )


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(a.size, b.size)
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


# ---- fingerprint --------------------------------------------------------------------------------

_FLASH_ATTN = {"auto": "auto", "on": "enabled", "off": "disabled"}


def server_fingerprint(
    props: dict[str, Any],
    model_path: str | Path,
    n_stream: int,
    *,
    type_k: str = "f16",
    type_v: str = "f16",
    flash_attn: str = "auto",
    swa_full: bool = False,
) -> dict[str, Any]:
    """The fingerprint (llama.FINGERPRINT_FIELDS) of a llama-server's slots.

    The model fields are read from the GGUF with llama.cpp itself (memory-mapped, no weights
    copied), so `model_hash` is the one llama-cpp-python computes for the same file. llama-cpp-
    python's `state_format` names its own release, the server's names its build: the two never
    share chunks, though both may run one llama.cpp (docs: what differs)."""
    import llama_cpp
    from llama_cpp import _internals

    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    params.use_extra_bufts = False  # no repacked copies of the weights: nothing is read but the hash
    path = os.fspath(model_path)
    model = _internals.LlamaModel(path_model=path, params=params, verbose=False)
    try:
        holder = _ModelView(path, model.metadata(), model.model)
        has_swa = llama_cpp.llama_model_n_swa(model.model) > 0
        fingerprint = {
            "arch": str(holder.metadata.get("general.architecture", "")),
            "n_layer": llama_cpp.llama_model_n_layer(model.model),
            "n_head": llama_cpp.llama_model_n_head(model.model),
            "n_head_kv": llama_cpp.llama_model_n_head_kv(model.model),
            "n_embd": llama_cpp.llama_model_n_embd(model.model),
            "n_vocab": model.n_vocab(),
            "type_k": type_k,
            "type_v": type_v,
            "flash_attn": _FLASH_ATTN.get(flash_attn, flash_attn),
            "n_stream": n_stream,
            "swa_full": bool(swa_full) if has_swa else None,
            # /props does not say the server's RoPE, metadata overrides or LoRA: a proxy assumes none
            "rope": None,
            "overrides": None,
            "lora": None,
            "attention": None,  # a server's completions are causal
            "model_hash": _model_hash(holder),  # type: ignore[arg-type]
            "state_format": f"llama-server {props.get('build_info', '?')}, seq file v{GGSQ_VERSION}",
        }
    finally:
        model.close()
    assert set(fingerprint) == set(FINGERPRINT_FIELDS)
    return fingerprint


@dataclass
class _ModelView:
    """What llama._model_hash reads of a Llama: the file, its metadata, the llama.cpp model."""

    model_path: str
    metadata: dict[str, str]
    model: Any


# ---- prefix loader and uploader (blocking; run in worker threads) -------------------------------


@dataclass
class Loaded:
    """A prefix assembled from the store, ready to restore."""

    slot_file: bytes | None  # None: nothing stored beats what the slot holds
    positions: int
    chunks: int  # chunks of the prompt the store holds
    bytes_read: int = 0
    levels: dict[str, int] = field(default_factory=dict)
    ms: float = 0.0
    lossy: tuple[int, str] | None = None  # (first position of lossy K/V, the worst level)


class Sharing:
    """The proxy's store side: finds, fetches and assembles prefixes; uploads saved slots.

    Blocking calls, safe from several threads (one store connection per thread). The chunk
    format, key chain and verification are chunks.py's; this class only adds the llama-server
    side (sequence files, a fingerprint without a llama-cpp-python context) and level choice.
    """

    def __init__(
        self,
        store_url: str,
        fingerprint: dict[str, Any],
        n_ctx: int,
        *,
        levels: tuple[str, ...] = ("high", "balanced"),
        load_level: str | None = None,
        slo: float | None = None,
        chunk_tokens: int = chunks.DEFAULT_CHUNK_TOKENS,
        threads: int | None = None,
        capacity_bytes: int | None = None,
    ) -> None:
        self.store_url, self.fingerprint, self.n_ctx = store_url, fingerprint, n_ctx
        self.capacity_bytes = capacity_bytes  # of the store's objects under lcg4/, evicted LRU after uploads
        self.levels = chunks._check_levels(levels)
        self.load_level = load_level
        self.slo = slo
        self.chunk_tokens = chunks._check_chunk_tokens(chunk_tokens)
        self.threads = threads
        self._local = threading.local()
        self._mutex = threading.Lock()
        # measured: store throughput (bytes/s) and bytes per token per level (EWMAs)
        self.throughput: float | None = None
        self.bytes_per_token: dict[str, float] = {}
        self.f16_bytes_per_token = 4.0 * int(fingerprint["n_layer"]) * int(fingerprint["n_embd"])
        self.compute_tps: float | None = None  # the server's prompt tokens per second
        self._named: OrderedDict[str, tuple[str, ...]] = OrderedDict()  # _remember

    def _remember(self, chunk_key: str, named: Sequence[str]) -> None:
        """What the chunk object `chunk_key` names (its statistics and skeleton), for marking them
        used with it when an upload finds it stored (they are another save's: left unmarked, they
        were the oldest objects and an eviction took them first, and the chunks with them)."""
        with self._mutex:
            self._named[chunk_key] = tuple(named)
            self._named.move_to_end(chunk_key)
            while len(self._named) > _MAX_NAMED:
                self._named.popitem(last=False)

    def _named_by(self, store: stores.Store, chunk_key: str) -> tuple[str, ...]:
        """What the chunk object names: remembered from this proxy's loads and uploads, else read
        from it (best effort: one that cannot be read names nothing here, and fails its next load)."""
        with self._mutex:
            named = self._named.get(chunk_key)
        if named is not None:
            return named
        with contextlib.suppress(CacheGenError, OSError, ValueError):
            chunk = store.get(chunk_key, max_size=chunks.chunk_bound(self.fingerprint, self.chunk_tokens))
            meta = chunks.ChunkMeta.unpack(codec.user_meta(chunk))
            named = (chunks._stats_key(meta.stats_id), chunks._skeleton_key(meta.skeleton_id))
            self._remember(chunk_key, named)
            return named
        return ()

    def _store(self) -> stores.Store:
        store = getattr(self._local, "store", None)
        if store is None:
            store = self._local.store = stores.open_store(self.store_url)
        return store

    def close(self) -> None:
        """Closes this thread's store (worker threads' stores close with their pools)."""
        store = getattr(self._local, "store", None)
        if store is not None:
            store.close()

    def _learn(self, name: str, value: float, weight: float = 0.3) -> None:
        with self._mutex:
            old = getattr(self, name)
            setattr(self, name, value if old is None else (1 - weight) * old + weight * value)

    def learn_compute(self, tokens_per_s: float) -> None:
        if tokens_per_s > 0:
            self._learn("compute_tps", tokens_per_s)

    def _learn_level(self, level: str, per_token: float) -> None:
        with self._mutex:
            old = self.bytes_per_token.get(level)
            self.bytes_per_token[level] = per_token if old is None else 0.7 * old + 0.3 * per_token

    def load_deadline(self, n_tokens: int) -> float:
        """Seconds a prefix load of an n-token prompt may take without an SLO: twice the server's
        measured compute time of the prompt (at least _MIN_LOAD_S), _LOAD_WAIT_S before any."""
        if not self.compute_tps:
            return _LOAD_WAIT_S
        return max(_MIN_LOAD_S, 2.0 * n_tokens / self.compute_tps)

    def _estimate_s(self, level: str, positions: int) -> float:
        """Seconds to fetch `positions` tokens at `level` (0 until a throughput is measured)."""
        if not self.throughput:
            return 0.0
        per_token = self.bytes_per_token.get(level, _GUESS_RATIO[level] * self.f16_bytes_per_token)
        return per_token * positions / self.throughput

    def choose_level(self, stored: list[tuple[str, ...]], positions: int) -> str | None:
        """The level to load (None: don't load): `load_level`, else the best level every matched
        chunk has whose estimated fetch fits the SLO (the smallest when none does); None when
        even that is estimated slower than the server recomputing the prefix."""
        common = [lv for lv in codec.LEVEL_ORDER if all(lv in s for s in stored)]
        if self.load_level is not None:
            return self.load_level if self.load_level in common else None
        if not common:
            return None
        choice = common[-1]
        for level in common:
            if self.slo is None or self._estimate_s(level, positions) <= 0.8 * self.slo:
                choice = level
                break
        if self.compute_tps and self._estimate_s(choice, positions) > positions / self.compute_tps:
            return None  # CacheGen's text fallback, for the whole prefix
        return choice

    def load(self, tokens: np.ndarray, held: int) -> Loaded:
        """The longest stored prefix of `tokens`, as a slot file, if it is longer than `held`."""
        start = time.perf_counter()
        store = self._store()
        limit = min(int(tokens.size), self.n_ctx)
        match = chunks._match(store, self.fingerprint, tokens[:limit], self.chunk_tokens)
        if match.positions <= held:
            return Loaded(None, match.positions, match.chunks)
        level = self.choose_level(match.levels, match.positions)
        if level is None:
            if self.load_level is not None:
                log.info(
                    "prefix of %d chunks stored, not all at --load-level %s: computed",
                    match.chunks,
                    self.load_level,
                )
            return Loaded(None, match.positions, match.chunks)
        while True:
            # this level first; a chunk evicted since the lookup falls back to the others it has
            candidates = [(level, *(lv for lv in lvs if lv != level)) for lvs in match.levels]
            prefix = np.ascontiguousarray(tokens[: match.positions], dtype=np.intc)
            reader = chunks._ChunkReader(
                store, self.fingerprint, prefix, self.chunk_tokens, match.keys, candidates
            )
            try:
                state, skeleton, figures = chunks._assemble(reader, None, self.threads)
                break
            except CacheGenError as exc:
                if exc.chunk is None:  # the store's, not a chunk's: the caller backs off
                    raise
                # a chunk gone since the lookup, or damaged (removed), forged, or naming what the
                # store lacks: the chunks before it serve (failing the load failed every request
                # with that prefix, and set the store aside for everyone)
                log.warning("prefix load: chunk %d unusable, the prefix ends before it: %s", exc.chunk, exc)
                match.cut(exc.chunk)
                if match.positions <= held:
                    return Loaded(None, match.positions, match.chunks)
        if codec.inspect(skeleton)["kind"] != "seq_buffer":
            raise CorruptDataError("the prefix's skeleton is not a sequence state (saved by another tool)")
        read = [reader.read[i] for i in range(len(match.keys))]
        for key, *named in read:
            self._remember(key, named)
        _mark_used(store, read)
        if figures["fetch_s"] > 0:
            self._learn("throughput", reader.bytes_read / figures["fetch_s"])
        for lv, n in figures["levels"].items():
            if n == len(match.keys):
                self._learn_level(lv, reader.bytes_read / match.positions)
        slot_file = seq_buffer_to_slot_file(state, prefix)
        return Loaded(
            slot_file,
            match.positions,
            match.chunks,
            bytes_read=reader.bytes_read,
            levels=figures["levels"],
            ms=(time.perf_counter() - start) * 1e3,
            lossy=figures["lossy"],
        )

    def upload(self, slot_file: bytes, lossy: str | None = None) -> dict[str, Any]:
        """Uploads the full chunks of a saved slot that the store lacks (the partial last chunk
        is left out: only an identical prompt could use it). Returns what was done. `lossy`: the
        worst level the slot's K/V was restored at (then no better level is written: under its
        tokens' keys it would pass for their exact K/V)."""
        levels = tuple(lv for lv in self.levels if lossy is None or not better_level(lv, lossy))
        if not levels:
            raise UnsupportedFormatError(
                f"the slot holds K/V restored at {lossy}: stored at {', '.join(self.levels)} it would pass "
                "for the exact K/V of its tokens"
            )
        tokens, state = slot_file_to_seq_buffer(slot_file)
        full = (int(tokens.size) // self.chunk_tokens) * self.chunk_tokens
        if full == 0:
            return {"chunks": 0, "objects_written": 0, "bytes_written": 0, "evicted_bytes": 0}
        info = codec.inspect_state(state, "seq_buffer")
        if not info["chunkable"] and info["caches"] > 1:
            raise UnsupportedFormatError(
                "a model with sliding-window layers: llama.cpp's slot file keeps only their last window, "
                "so no prefix of it can be shared (README, Share a context across llama-server instances)"
            )
        if info["tail"]:
            raise UnsupportedFormatError(
                "a hybrid model: its slot file holds the recurrent state of the last position, which no "
                "prefix can be cut from, so no prefix of it can be shared"
            )
        for side in ("type_k", "type_v"):
            found, told = info[side], self.fingerprint[side]
            if found >= 0 and found != GGML_TYPES.get(told):
                name = GGML_TYPE_NAMES.get(found, str(found))
                flag = "--cache-type-k" if side == "type_k" else "--cache-type-v"
                raise UnsupportedFormatError(
                    f"the server's cache holds {side[-1].upper()} as {name}, the proxy was told {told}: "
                    f"start it with {flag} {name} (its chunks would be stored under another setting's name)"
                )
        if not info["chunkable"] or info["positions"] != (0, int(tokens.size)):
            raise CorruptDataError(
                f"the slot holds positions {info['positions']} for {tokens.size} tokens: not chunkable"
            )
        store = self._store()
        meta = StateMeta(self.fingerprint, "seq", 0, self.n_ctx, tokens[:full])
        manifest = chunks.Manifest(meta, chunk_tokens=self.chunk_tokens)
        uploads = chunks._Uploads(store)
        start = time.perf_counter()
        try:
            present, level_bytes = chunks._save_chunks(
                store, uploads, manifest, state, "seq_buffer", levels, self.threads
            )
            uploads.finish()
        finally:
            uploads.close()
        for level, n in level_bytes.items():
            written = sum(1 for c in manifest.chunks if c.sizes.get(level) is not None)
            if written:
                self._learn_level(level, n / (written * self.chunk_tokens))
        assert manifest.skeleton is not None
        chain = []
        for c in manifest.chunks:
            for level in levels:
                key = chunks._chunk_key(c.key, level)
                if c.sizes.get(level) is None:  # stored before: what it names is another save's
                    named = self._named_by(store, key)
                else:
                    stats_id = manifest.stats[level]
                    assert stats_id is not None
                    named = (chunks._stats_key(stats_id), chunks._skeleton_key(manifest.skeleton))
                    self._remember(key, named)
                chain.append((key, *named))
        _mark_used(store, chain)
        evicted = 0
        if self.capacity_bytes is not None and uploads.objects:
            try:
                evicted = store.evict(chunks.PREFIX, self.capacity_bytes)
            except (CacheGenError, OSError) as exc:  # the chunks are stored: the upload stands
                log.warning("eviction past --capacity-bytes failed: %s", exc)
        return {
            "chunks": len(manifest.chunks),
            "objects_written": uploads.objects,
            "objects_present": present,
            "bytes_written": uploads.bytes,
            "level_bytes": level_bytes,
            "evicted_bytes": evicted,
            "ms": (time.perf_counter() - start) * 1e3,
        }


def _mark_used(store: stores.Store, chain: list[tuple[str, ...]]) -> None:
    """Marks a prefix's chunk objects used for LRU eviction (a capacity of this proxy's or of anyone
    sharing the store), last chunk first, then the statistics and skeletons they name: an eviction
    takes a prefix's tail before its head, and its chunks before what they need (as the prompt
    cache does). `chain`: per chunk object in prefix order, its key then what it names. Best
    effort: a store that refuses marks still serves."""
    used = [key for key, *_ in reversed(chain)]
    used += dict.fromkeys(named for _, *names in chain for named in names)
    with contextlib.suppress(OSError, CacheGenError):
        store.mark_used(used)


# ---- the HTTP proxy -----------------------------------------------------------------------------


@dataclass
class _Slot:
    id: int
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.intc))  # known held prefix
    used: float = 0.0
    # a request passed through may have left K/V in it that the proxy did not see computed: it is
    # not uploaded from until a restore replaced what it held or the server computed a whole prompt
    unseen: bool = False
    known: bool = True  # `tokens` start what it holds (not after a request passed through)


class LossyRestores:
    """The lossy restores made into a server since the proxy read it, into any of its slots.
    llama-server's RAM prompt cache (--cache-ram, on by default) saves what a slot held and may
    load it into another slot for a prompt that starts the same way: K/V the server reused for a
    prompt may be a restore's lossy K/V (or K/V computed on top of it) when the reused positions
    pass the restore's exact ones and the prompt's tokens start as the restore's did. Uploaded at a
    better level it would pass for its tokens' exact K/V. A caution, as
    llama.lossy_level_anywhere: it costs levels written, never a wrong answer. Kept as (exact
    positions, digest of the tokens up to the first lossy one); past _MAX_LOSSY restores the worst
    level of those not kept counts for every prompt that reused K/V."""

    def __init__(self) -> None:
        self._worst: dict[tuple[int, bytes], str] = {}  # (exact positions, digest) -> worst level
        self._overflow: str | None = None

    @staticmethod
    def _digest(tokens: np.ndarray, exact: int) -> bytes:
        return hashlib.sha256(np.ascontiguousarray(tokens[: exact + 1], dtype=np.intc).tobytes()).digest()

    def add(self, tokens: np.ndarray, exact: int, level: str) -> None:
        """A restore of `tokens` whose K/V from position `exact` on came from `level` (or better)."""
        exact = max(0, exact)
        if tokens.size <= exact:
            return
        key = (exact, self._digest(tokens, exact))
        if key not in self._worst and len(self._worst) >= _MAX_LOSSY:
            self._overflow = _worse(self._overflow, level)
        else:
            self._worst[key] = _worse(self._worst.get(key), level)

    def level(self, tokens: np.ndarray, reused: int) -> str | None:
        """The worst level of the restores whose lossy K/V a slot holding `tokens` may hold, the
        server having reused K/V for its first `reused` positions (and computed the rest)."""
        found = self._overflow if reused > 0 else None
        digests: dict[int, bytes] = {}
        for (exact, digest), level in self._worst.items():
            if min(reused, tokens.size) > exact:
                if exact not in digests:
                    digests[exact] = self._digest(tokens, exact)
                if digests[exact] == digest:
                    found = _worse(found, level)
        return found

    def clear(self) -> None:
        """The server restarted: its RAM cache went with it."""
        self._worst.clear()
        self._overflow = None


def _worse(a: str | None, b: str) -> str:
    return b if a is None or better_level(a, b) else a


@dataclass
class ProxyStats:
    requests: int = 0
    completions: int = 0
    restores: int = 0
    restored_tokens: int = 0
    restore_failures: int = 0
    bytes_read: int = 0
    load_ms: float = 0.0
    loads_skipped: int = 0  # a load that was slower than the SLO, or a store error
    saves: int = 0
    uploads: int = 0
    upload_errors: int = 0
    uploads_dropped: int = 0
    uploads_unseen: int = 0  # not uploaded: the slot may hold K/V a request passed through left
    bytes_written: int = 0
    objects_written: int = 0
    evicted_bytes: int = 0  # deleted past --capacity-bytes
    store_errors: int = 0
    pending_uploads: int = 0


class Proxy:
    def __init__(
        self,
        server: str,
        slot_dir: str | Path,
        store_url: str,
        *,
        levels: tuple[str, ...] = ("high", "balanced"),
        load_level: str | None = None,
        slo: float | None = None,
        chunk_tokens: int = chunks.DEFAULT_CHUNK_TOKENS,
        token: str | None = None,
        server_key: str | None = None,
        model: str | None = None,
        type_k: str = "f16",
        type_v: str = "f16",
        flash_attn: str = "auto",
        swa_full: bool = False,
        threads: int | None = None,
        max_body: int = 64 << 20,
        capacity_bytes: int | None = None,
    ) -> None:
        self.server = server.rstrip("/")
        self.max_body = max_body  # request bytes the proxy reads (413 beyond)
        self.slot_dir = Path(slot_dir)
        self.store_url = store_url
        self.token, self.server_key, self.model = token, server_key, model
        self.options = {
            "levels": tuple(levels),
            "load_level": load_level,
            "slo": slo,
            "chunk_tokens": chunk_tokens,
            "threads": threads,
            "capacity_bytes": capacity_bytes,
        }
        self.kv = {"type_k": type_k, "type_v": type_v, "flash_attn": flash_attn, "swa_full": swa_full}
        self.stats = ProxyStats()
        self.slots: list[_Slot] = []
        self.sharing: Sharing | None = None
        self._nonce = secrets.token_hex(4)
        self._session: aiohttp.ClientSession | None = None
        self._loader = ThreadPoolExecutor(2, thread_name_prefix="lcg-proxy-load")
        self._uploader = ThreadPoolExecutor(1, thread_name_prefix="lcg-proxy-upload")
        self._tasks: set[asyncio.Task[None]] = set()
        self._store_down_until = 0.0
        self.lossy = LossyRestores()
        self._identity: tuple[Any, ...] | None = None  # of the server the fingerprint was read from
        self._model_path: str | None = None  # the server's, when --model was checked against it
        self._fingerprinted: str | None = None  # the model file the fingerprint was read from
        self._file: tuple[tuple[str, int, int], ...] | None = None  # ... their size and time then
        self._reconnect = asyncio.Lock()

    # -- life cycle

    async def start(self, app: web.Application | None = None) -> None:
        """Connects to the server: its props, slots and KV streams, and the fingerprint."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        deadline = time.monotonic() + _START_WAIT_S
        waited = False
        while True:  # the server may still be loading its model
            try:
                props = await self._call("GET", "/props")
                break
            except CacheGenError as exc:
                if isinstance(exc, ServerStatusError) and exc.http_status in (401, 403):
                    raise CacheGenError(
                        f"llama-server at {self.server} refused the proxy ({exc}): a server started with "
                        "--api-key needs the proxy's --server-key-file"
                    ) from None
                if time.monotonic() > deadline:
                    raise CacheGenError(f"llama-server at {self.server} not ready: {exc}") from exc
                if not waited:
                    log.info(
                        "waiting up to %.0f s for llama-server at %s (%s)", _START_WAIT_S, self.server, exc
                    )
                    waited = True
                await asyncio.sleep(0.5)
        await self._connect(props)

    @staticmethod
    def _identity_of(props: dict[str, Any]) -> tuple[Any, ...]:
        """What the server says of itself that a restart may change: its model's path, slot count
        and context size."""
        n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
        return props.get("model_path"), props.get("total_slots"), n_ctx

    def _model_file(self) -> tuple[tuple[str, int, int], ...] | None:
        """The size and time of the model files (every one of a split model) the fingerprint was
        read from; None where one cannot be read."""
        try:
            return (
                tuple(map(_file_identity, _model_files(self._fingerprinted))) if self._fingerprinted else None
            )
        except OSError:
            return None

    async def _connect(self, props: dict[str, Any]) -> None:
        """Reads the server's slots, KV streams and model into the fingerprint its chunks are
        stored under: at start-up, and again when it restarted with another model or slots."""
        self.sharing = None  # until the fingerprint is read
        self.lossy.clear()
        identity = self._identity_of(props)
        server_model, n_slots, n_ctx = identity[0], int(identity[1] or 1), int(identity[2] or 0)
        model = self.model or server_model
        if self.model and server_model and Path(server_model).name != Path(self.model).name:
            # its chunks would go into the store under the other model's fingerprint (a SmolLM2
            # server's proxy told --model Gemma did so), and a same-shape model's would be restored
            self.slots, self._identity = [], identity  # every completion passes through
            raise InvalidArgumentError(
                f"the server runs {server_model!r}, and --model names {self.model!r}: give the file the "
                "server loaded (the same name)"
            )
        if self._model_path is None:
            self._model_path = server_model
        elif self.model and server_model != self._model_path:
            self.slots, self._identity = [], identity  # every completion passes through
            raise InvalidArgumentError(
                f"the server now runs {server_model!r}, not {self._model_path!r} as at start-up: "
                f"--model {self.model!r} may not be it; nothing is shared until it runs that again"
            )
        if not model or not Path(model).is_file():
            raise InvalidArgumentError(
                f"cannot read the server's model {model!r} here: give --model (the proxy runs beside it)"
            )
        self._fingerprinted = model
        file = self._model_file()
        # every slot may hold K/V from before this proxy (a lossy restore's among them): none is
        # uploaded from until a restore or a prompt computed whole replaced it
        self.slots = [_Slot(i, unseen=True, known=False) for i in range(n_slots)]
        # the KV stream count, and the slot dir checked, from an idle slot: the server saves a busy
        # one when its task ends, and the proxy listens only once this is done
        idle = [e.get("id") for e in await self._slot_entries() if e.get("is_processing") is False]
        # one name for every start: a proxy given the wrong --slot-dir, restarted by a supervisor,
        # left a copy of the slot's state in the server's directory at each try
        probed = idle[0] if idle and type(idle[0]) is int and 0 <= idle[0] < n_slots else 0
        # one name per server (URL) for every start, not per process
        probe_file = f"llama-cachegen-probe-{hashlib.sha256(self.server.encode()).hexdigest()[:12]}.bin"
        probe = await self._save_slot(probed, probe_file)
        held, offset = read_slot_file(probe)
        # what that slot holds, from before this proxy (the level of its K/V unknown: not uploaded
        # from): a prompt it starts is not restored over it (after a proxy restart, its exact K/V
        # went for the store's lossy copy)
        self.slots[probed].tokens, self.slots[probed].known = held, True
        (n_stream,) = struct.unpack_from("<I", probe, offset)
        loop = asyncio.get_running_loop()
        fingerprint = await loop.run_in_executor(
            None, lambda: server_fingerprint(props, model, n_stream, **self.kv)
        )
        if fingerprint["swa_full"] is False:
            # measured (Gemma 3, a 311-token prompt, 256 restored): llama-server computed all 311
            # again, so every load read the store for nothing and the header claimed a reuse
            log.warning(
                "a model with sliding-window layers on a server without --swa-full: llama-server computes a "
                "restored prompt again, so nothing is shared (with --swa-full on the servers and their "
                "proxies, prompts within the window are)"
            )
        else:
            self.sharing = Sharing(self.store_url, fingerprint, n_ctx, **self.options)
        self._identity, self._file = identity, file
        log.info(
            "llama-server %s: %d slots of %d tokens, %d KV stream(s), model %s",
            self.server,
            n_slots,
            n_ctx,
            n_stream,
            Path(model).name,
        )

    async def close(self, app: web.Application | None = None) -> None:
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._session is not None:
            await self._session.close()
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._uploader.shutdown(wait=True)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.close)
        return app

    # -- requests

    def _server_headers(self, request: web.Request | None = None) -> dict[str, str]:
        headers: dict[str, str] = {}
        if request is not None:
            for name, value in request.headers.items():
                lower = name.lower()
                if lower in _HOP_BY_HOP or (lower == "authorization" and self.token is not None):
                    continue  # the proxy's token is not the server's key
                headers[name] = value
        if self.server_key is not None:
            headers["Authorization"] = f"Bearer {self.server_key}"
        return headers

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        """A JSON call to the server; CacheGenError on any failure."""
        assert self._session is not None
        try:
            async with self._session.request(
                method, self.server + path, json=body, headers=self._server_headers()
            ) as response:
                text = await response.text()
                if response.status >= 400:
                    raise ServerStatusError(
                        response.status, f"{method} {path}: {response.status} {text[:300].strip()}"
                    )
                return json.loads(text)
        except (aiohttp.ClientError, ValueError) as exc:
            raise CacheGenError(f"{method} {path}: {exc}") from exc

    async def handle(self, request: web.Request) -> web.StreamResponse:
        open_path = request.method == "GET" and request.path == "/health"
        if (
            self.token is not None
            and not open_path
            and not bearer_ok(request.headers.get("Authorization"), self.token)
        ):
            response = _error_response(401, "a bearer token is required", "authentication_error")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        self.stats.requests += 1
        if request.content_length is not None and request.content_length > self.max_body:
            # at once, from the declared length: aiohttp would wait for a body that may never come
            return self._too_large()
        try:
            return await self._dispatch(request)
        except web.HTTPRequestEntityTooLarge:  # a chunked body past max_body, found while reading it
            return self._too_large()

    def _too_large(self) -> web.Response:
        response = _error_response(413, f"a request body over {self.max_body} bytes", "invalid_request_error")
        response.force_close()
        return response

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        if request.path == STATS_PATH:
            return web.json_response(self.stats.__dict__)
        if request.method == "POST" and request.path in COMPLETION_PATHS | CHAT_PATHS:
            return await self._completion(request, chat=request.path in CHAT_PATHS)
        if request.method == "POST" and request.path not in _SLOTLESS_POSTS:
            # /infill, /v1/messages, /v1/responses, ... generate too, in a slot the server picks
            return await self._pass_through(request, _no_cache_reuse(await request.read())[1])
        return await self._forward(request, await request.read())

    async def _forward(self, request: web.Request, body: bytes) -> web.StreamResponse:
        response, _ = await self._forward_tail(request, body)
        return response

    async def _forward_tail(
        self, request: web.Request, body: bytes, extra: dict[str, str] | None = None
    ) -> tuple[web.StreamResponse, bytes]:
        """Streams the server's answer to `body` back chunk by chunk; returns the response and its
        last bytes (where the timings are)."""
        assert self._session is not None
        tail = b""
        try:
            upstream_cm = self._session.request(
                request.method,
                self.server + request.path_qs,
                data=body,
                headers=self._server_headers(request),
            )
            upstream = await upstream_cm.__aenter__()
        except aiohttp.ClientError as exc:  # in llama-server's own error shape
            why = getattr(exc, "os_error", None) or exc  # a refused connection: not aiohttp's "ssl:default"
            return _error_response(
                502, f"llama-server {self.server} unreachable: {why}", "unavailable_error"
            ), tail
        try:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    response.headers.add(name, value)
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            for name, value in (extra or {}).items():
                response.headers[name] = value
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                    tail = (tail + chunk)[-_TAIL_BYTES:]
                await response.write_eof()
            except ConnectionResetError:  # the client left; leaving closes the server's request too
                log.info("%s %s: the client disconnected", request.method, request.path)
            except aiohttp.ClientPayloadError as exc:  # the server died mid-answer
                log.warning("%s %s: the server's answer broke off (%s)", request.method, request.path, exc)
                # ended without its last chunk, as the server's own connection did: finished
                # cleanly, a client reading to the end took the cut answer for a whole one
                if request.transport is not None:
                    request.transport.close()
            return response, tail
        finally:
            await upstream_cm.__aexit__(None, None, None)

    async def _prompt_tokens(self, body: dict[str, Any], chat: bool) -> np.ndarray | None:
        """The prompt's tokens as the server will see them; None for what the proxy leaves alone
        (several prompts, media)."""
        if chat:
            if not isinstance(body.get("messages"), list):
                return None
            prompt: Any = (await self._call("POST", "/apply-template", body))["prompt"]
        else:
            prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            if not all(-(2**31) <= t < 2**31 for t in prompt):
                return None  # no token id: the server answers for it
            return np.asarray(prompt, dtype=np.intc)  # token ids go in as they are
        mixed = (
            isinstance(prompt, list)
            and any(isinstance(t, int) for t in prompt)
            and all(isinstance(t, (int, str)) for t in prompt)
        )
        if not (isinstance(prompt, str) or mixed):
            return None
        reply = await self._call(
            "POST", "/tokenize", {"content": prompt, "add_special": True, "parse_special": True}
        )
        tokens = np.asarray(reply["tokens"], dtype=np.intc)
        return tokens if tokens.size else None

    async def _acquire(self, tokens: np.ndarray, pinned: Any) -> _Slot:
        """The slot for a prompt: the client's `id_slot`, else the idle slot holding the longest
        part of it (the least recently used among equals); waits for it to be free."""
        if isinstance(pinned, int) and not isinstance(pinned, bool) and pinned >= 0:
            slot = self.slots[pinned % len(self.slots)]
        else:
            idle = [s for s in self.slots if not s.lock.locked()] or self.slots
            slot = max(idle, key=lambda s: (common_prefix(s.tokens, tokens), -s.used))
        await slot.lock.acquire()
        slot.used = time.monotonic()
        return slot

    async def _server_unchanged(self) -> bool:
        """Whether the server is the one the fingerprint was read from, so that its K/V may be
        restored and stored under it (False: the request passes through). A server that says it
        runs another model path, slot count or context size restarted: it is read again. A model
        file written again (or touched) since it was read leaves the proxy unable to tell which
        weights the server runs, before or after a restart: nothing is shared from then on."""
        try:
            if self._identity_of(await self._call("GET", "/props")) != self._identity:
                async with self._reconnect:
                    props = await self._call("GET", "/props")
                    if self._identity_of(props) != self._identity:
                        log.warning(
                            "llama-server %s restarted with another model, slots or context", self.server
                        )
                        await self._connect(props)
        except Exception as exc:  # noqa: BLE001 - a model file half written: llama.cpp's ValueError
            log.warning("llama-server not read (%s): the request passes through", exc)
            return False
        if self.sharing is not None and self._model_file() != self._file:
            self.sharing, self.slots = None, []
            log.warning(
                "the model file %s changed since the proxy read it: it cannot tell which weights the "
                "server runs, so nothing is shared until the proxy is started again (after the server)",
                self._fingerprinted,
            )
        return bool(self.slots)

    async def _pass_through(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        """A generating request the proxy does not follow: it may leave K/V in any slot."""
        for slot in self.slots:
            slot.unseen, slot.known = True, False
        try:
            return await self._forward(request, raw)
        finally:  # and whatever slot it took, it took while it ran
            for slot in self.slots:
                slot.unseen, slot.known = True, False

    async def _completion(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body, raw = _no_cache_reuse(await request.read())
        tokens = None
        # cache_prompt false: the client wants the prompt computed from scratch (a cold prefill's
        # exact numbers); nothing is restored for it (nor for a value the server refuses)
        if (
            isinstance(body, dict)
            and body.get("cache_prompt", True) is True
            and await self._server_unchanged()
        ):
            try:
                tokens = await self._prompt_tokens(body, chat)
            except CacheGenError as exc:
                log.warning("prompt not tokenized (%s): passed through", exc)
        sharing = self.sharing  # the server's fingerprint this request restores and uploads under
        if tokens is None or (sharing is not None and 0 < sharing.n_ctx <= tokens.size):
            return await self._pass_through(request, raw)  # e.g. over the slot's context
        self.stats.completions += 1
        slot = await self._acquire(tokens, body.get("id_slot"))
        tail = b""
        restored = covered = 0
        answered = False
        try:
            restored, covered = await self._restore_prefix(sharing, slot, tokens)
            body["id_slot"] = slot.id
            body["cache_prompt"] = True
            data = json.dumps(body).encode()
            response, tail = await self._forward_tail(request, data, {RESTORED_HEADER: str(restored)})
            answered = 200 <= response.status < 300
            return response
        finally:
            self._spawn(self._after(sharing, slot, tokens, covered, tail, restored > 0, answered))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _store_ok(self) -> bool:
        return time.monotonic() >= self._store_down_until

    def _store_failed(self, what: str, exc: BaseException) -> None:
        self.stats.store_errors += 1
        self._skip_store(what, exc)

    def _skip_store(self, what: str, exc: BaseException) -> None:
        self._store_down_until = time.monotonic() + stores.STORE_BACKOFF_S
        log.warning(
            "%s: %s (the server computes as usual; store skipped for %g s)", what, exc, stores.STORE_BACKOFF_S
        )

    async def _restore_prefix(
        self, sharing: Sharing | None, slot: _Slot, tokens: np.ndarray
    ) -> tuple[int, int]:
        """Restores the longest stored prefix into `slot` when it beats what the slot holds.
        Returns (tokens restored, chunks of the prompt the store holds); never raises."""
        if sharing is None or not self._store_ok():
            return 0, 0
        held = common_prefix(slot.tokens, tokens) if slot.known else 0  # unknown: the store's K/V first
        if held and await self._slot_forgotten(slot.id):
            log.info("slot %d: the server holds nothing there any more (restarted): restoring", slot.id)
            slot.tokens = slot.tokens[:0]
            held = 0
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._loader, sharing.load, tokens, held)
        # A store that stops answering must not hold the request (its client's timeouts are a
        # minute and more): past the SLO, or else the time the server would take to compute the
        # prompt twice over (a store slower than that is no use), the request goes on without it.
        deadline = sharing.slo or sharing.load_deadline(int(tokens.size))
        try:
            loaded = await asyncio.wait_for(future, deadline)
        except asyncio.TimeoutError:
            self.stats.loads_skipped += 1
            if sharing.slo:
                log.warning("prefix load over the SLO of %g s: computed instead", sharing.slo)
            else:
                late = TimeoutError(f"no prefix from the store in {deadline:.1f} s")
                self._store_failed("prefix load", late)
            return 0, 0
        except Exception as exc:  # the store down, a chunk refused: never fail the request
            self.stats.loads_skipped += 1
            self._store_failed("prefix load failed", exc)
            return 0, 0
        if loaded.slot_file is None:
            return 0, loaded.chunks
        if not await self._server_unchanged() or self.sharing is not sharing:  # it restarted meanwhile
            return 0, 0
        self.stats.bytes_read += loaded.bytes_read  # read, whether or not the server takes it
        name = f"llama-cachegen-{self._nonce}-restore-{slot.id}.bin"
        path = self.slot_dir / name
        try:
            await loop.run_in_executor(None, _write_atomic, path, loaded.slot_file)
            await self._call("POST", f"/slots/{slot.id}?action=restore", {"filename": name})
        except (CacheGenError, OSError) as exc:
            self.stats.restore_failures += 1
            slot.tokens = slot.tokens[:0]  # a failed restore clears the slot
            # most often a setting /props does not show differs from the proxy's: every restore would
            # be refused, each after reading the prefix from the store (counted in restore_failures)
            self._skip_store(
                f"slot {slot.id}: restore of {loaded.positions} tokens refused (does the server run with the "
                "--flash-attn, --cache-type-k/-v and --swa-full this proxy was given? 'auto' may resolve "
                "differently on other hardware)",
                exc,
            )
            return 0, loaded.chunks
        finally:
            with contextlib.suppress(OSError):
                path.unlink()
        slot.tokens = tokens[: loaded.positions].copy()
        if loaded.lossy is not None:
            self.lossy.add(slot.tokens, *loaded.lossy)
        self.stats.restores += 1
        self.stats.restored_tokens += loaded.positions
        self.stats.load_ms += loaded.ms
        log.info(
            "slot %d: restored %d of %d prompt tokens (%s, %.0f KB in %.0f ms)",
            slot.id,
            loaded.positions,
            tokens.size,
            loaded.levels,
            loaded.bytes_read / 1e3,
            loaded.ms,
        )
        return loaded.positions, loaded.chunks

    async def _slot_entries(self) -> list[dict[str, Any]]:
        """GET /slots: one entry per slot; none where the server does not say (--no-slots, no
        answer in _SLOTS_WAIT_S)."""
        try:
            slots = await asyncio.wait_for(self._call("GET", "/slots"), _SLOTS_WAIT_S)
        except (CacheGenError, asyncio.TimeoutError):
            return []
        return [entry for entry in slots if isinstance(entry, dict)] if isinstance(slots, list) else []

    async def _slot_forgotten(self, slot_id: int) -> bool:
        """Whether llama-server says the slot has run no task since it started (GET /slots lists a
        slot's id_task from its first task on): the server restarted and what the proxy recorded
        the slot holding is gone. False where /slots does not say: the record is trusted, at worst
        the server computes what it lost."""
        for entry in await self._slot_entries():
            if entry.get("id") == slot_id:
                return "id_task" not in entry
        return False

    async def _save_slot(self, slot_id: int, name: str | None = None) -> bytes:
        """The slot's sequence file, saved by the server into the slot dir (as `name`), read and
        removed."""
        name = name or f"llama-cachegen-{self._nonce}-save-{slot_id}.bin"
        path = self.slot_dir / name
        try:  # a call that fails after the server wrote the file (a timeout) leaves no file either
            await self._call("POST", f"/slots/{slot_id}?action=save", {"filename": name})
            return await asyncio.get_running_loop().run_in_executor(None, path.read_bytes)
        except FileNotFoundError:
            raise InvalidArgumentError(
                f"the server saved its slot, but not into {self.slot_dir}: give the server's "
                f"--slot-save-path (and remove {name} from it)"
            ) from None
        finally:
            with contextlib.suppress(OSError):
                path.unlink()

    async def _after(
        self,
        sharing: Sharing | None,
        slot: _Slot,
        tokens: np.ndarray,
        covered: int,
        tail: bytes,
        replaced: bool,
        answered: bool,
    ) -> None:
        """After a response: remember what the slot holds; save and upload it unless the store
        already has every full chunk of it (or it may hold K/V the proxy did not see computed).
        `replaced`: a restore replaced what the slot held; `answered`: the server answered 2xx (a
        request it refused may have left the slot as it was: what it holds is not known). Holds
        the slot until the save is done."""
        data, lossy = None, None
        try:
            if not answered:  # not uploaded from until a restore or a whole prompt replaces it
                slot.unseen, slot.known = True, False
                return
            slot.tokens, slot.known = tokens, True
            timings = _timings(tail)
            if sharing is not None and timings.get("prompt_per_second"):
                sharing.learn_compute(float(timings["prompt_per_second"]))
            # all of it restored or computed, but for exact K/V the server reused
            if replaced or int(timings.get("prompt_n") or 0) >= tokens.size - _EXACT_REUSE:
                slot.unseen = False
            if slot.unseen:
                self.stats.uploads_unseen += 1
                log.info("slot %d: may hold K/V a request passed through left (not uploaded)", slot.id)
                return
            total = int(tokens.size) + int(timings.get("predicted_n") or 0)
            c = self.options["chunk_tokens"]
            # the server read again since the request began: its K/V is not the fingerprint's
            if sharing is not None and sharing is self.sharing and total // c > covered and self._store_ok():
                if self.stats.pending_uploads >= _MAX_PENDING_UPLOADS:
                    self.stats.uploads_dropped += 1
                else:
                    data = await self._save_slot(slot.id)
                    self.stats.saves += 1
                    slot.tokens, _ = read_slot_file(data)
                    # what the server reused of the prompt (the rest it computed: exact)
                    computed = timings.get("prompt_n")
                    reused = int(tokens.size) - int(computed) if computed is not None else int(tokens.size)
                    lossy = self.lossy.level(slot.tokens, reused)
                    if common_prefix(slot.tokens, tokens) < tokens.size:
                        # the server shifted the context (--context-shift): the K/V it kept was
                        # computed beside tokens it dropped, not its own tokens' exact K/V
                        log.warning("slot %d: the server shifted its context: not uploaded", slot.id)
                        data = None
        except (CacheGenError, OSError) as exc:
            log.warning("slot %d: save failed (%s)", slot.id, exc)
        finally:
            slot.lock.release()
        if data is None or sharing is None:
            return
        self.stats.pending_uploads += 1
        try:
            done = await asyncio.get_running_loop().run_in_executor(
                self._uploader, sharing.upload, data, lossy
            )
        except (UnsupportedFormatError, CorruptDataError) as exc:  # a slot that cannot be shared
            self.stats.upload_errors += 1
            log.warning("slot %d: not uploaded: %s", slot.id, exc)
        except Exception as exc:  # a store that is down
            self.stats.upload_errors += 1
            self._store_failed("upload failed", exc)
        else:
            self.stats.uploads += 1
            self.stats.bytes_written += done["bytes_written"]
            self.stats.objects_written += done["objects_written"]
            self.stats.evicted_bytes += done["evicted_bytes"]
            if done["objects_written"]:
                log.info(
                    "slot %d: uploaded %d objects, %.0f KB (%d chunks of %d tokens) in %.0f ms",
                    slot.id,
                    done["objects_written"],
                    done["bytes_written"] / 1e3,
                    done["chunks"],
                    c,
                    done.get("ms", 0.0),
                )
        finally:
            self.stats.pending_uploads -= 1


_TIMING = re.compile(rb'"(prompt_n|predicted_n|prompt_per_second)"\s*:\s*([0-9.eE+-]+)')


def _error_response(status: int, message: str, kind: str) -> web.Response:
    """An error of the proxy's own, in llama-server's shape ({"error": {code, message, type}})."""
    return web.json_response({"error": {"code": status, "message": message, "type": kind}}, status=status)


def _no_cache_reuse(raw: bytes) -> tuple[Any, bytes]:
    """A request body parsed (None when it is no JSON) and its bytes, `n_cache_reuse` 0 in a JSON
    object. llama-server's cache reuse (the request's field, or its --cache-reuse) moves K/V of
    another prompt to new positions: K/V that saw other tokens, which a slot save would hand this
    proxy as its tokens' exact K/V. Every POST the proxy passes sets it (llama-server generates on
    more routes than completions: /infill, /v1/responses). /v1/messages drops the field: after a
    request passed through, slots are `unseen` until a restore or a whole prompt replaced them."""
    try:
        body = json.loads(raw)
        if isinstance(body, dict):
            body["n_cache_reuse"] = 0
            # no NaN or inf (1e400 parses as inf): written back, it is no JSON the server reads
            raw = json.dumps(body, allow_nan=False).encode()
    except ValueError:
        return None, raw  # as it came: the server says what is wrong with it
    return body, raw


def _timings(tail: bytes) -> dict[str, float]:
    """The last timings llama-server reported in a response (JSON or the last SSE events)."""
    found: dict[str, float] = {}
    for name, value in _TIMING.findall(tail):
        with contextlib.suppress(ValueError):
            found[name.decode()] = float(value)
    return found


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):  # a full disk: no partial file left in the slot dir
            tmp.unlink()
        raise


# ---- command line -------------------------------------------------------------------------------


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidArgumentError(f"--listen takes HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def run_proxy(args: argparse.Namespace) -> None:
    """`llama-cachegen proxy`: serves until interrupted."""
    host, port = _listen(args.listen)
    token = load_token(args.token_file, PROXY_TOKEN_ENV)
    if token is None and not is_loopback(host):
        raise InvalidArgumentError(
            f"refusing to listen on {host or 'every interface'} without a token: anyone who reaches it "
            f"could drive the server and fill the store; give --token-file or {PROXY_TOKEN_ENV}, or use "
            "127.0.0.1"
        )
    server_key = load_token(args.server_key_file) if args.server_key_file else None
    stores.open_store(args.store).close()  # a URL no store takes fails here, not at every request
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="llama-cachegen proxy: %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:
        log.setLevel(logging.INFO)  # restores and uploads are the point: always shown
    if token is None and os.environ.get(TOKEN_ENV):
        log.warning(
            "%s is an HTTP store's token; this proxy's clients' is %s (or --token-file): it takes "
            "requests without one",
            TOKEN_ENV,
            PROXY_TOKEN_ENV,
        )
    proxy = Proxy(
        args.server,
        args.slot_dir,
        args.store,
        levels=tuple(args.levels),
        load_level=args.load_level,
        slo=args.slo,
        chunk_tokens=args.chunk_tokens,
        token=token,
        server_key=server_key,
        model=args.model,
        type_k=args.cache_type_k,
        type_v=args.cache_type_v,
        flash_attn=args.flash_attn,
        swa_full=args.swa_full,
        threads=args.threads,
        max_body=args.max_body_mb << 20,
        capacity_bytes=args.capacity_bytes,
    )

    async def main() -> None:
        # handler_cancellation: a client that leaves before a non-streamed answer cancels its
        # handler, which closes the request to the server, and llama-server stops generating (as for
        # a client of its own); else the slot stays busy until the whole answer is generated.
        runner = web.AppRunner(
            proxy.app(), access_log=web.access_logger if args.verbose else None, handler_cancellation=True
        )
        try:
            await runner.setup()  # Proxy.start: on failure aiohttp runs no cleanup, so close here
        except BaseException:
            await proxy.close()
            raise
        try:
            await web.TCPSite(runner, host, port).start()
            bound_host, bound_port = runner.addresses[0][:2]
            print(
                f"llama-cachegen: proxy for {proxy.server} at http://{bound_host}:{bound_port}/ "
                f"(store {stores.redact(args.store)}; {'token required' if token else 'no token'})",
                file=sys.stderr,
                flush=True,
            )
            stop = asyncio.Event()
            for signum in (signal.SIGTERM, signal.SIGINT):
                asyncio.get_running_loop().add_signal_handler(signum, stop.set)
            await stop.wait()
        finally:
            await runner.cleanup()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())


__all__ = [
    "CHAT_PATHS",
    "COMPLETION_PATHS",
    "RESTORED_HEADER",
    "STATS_PATH",
    "Loaded",
    "Proxy",
    "ProxyStats",
    "Sharing",
    "common_prefix",
    "read_slot_file",
    "run_proxy",
    "seq_buffer_to_slot_file",
    "server_fingerprint",
    "slot_file_to_seq_buffer",
]
