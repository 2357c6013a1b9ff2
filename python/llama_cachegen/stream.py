"""Adaptive streaming of chunked contexts: CacheGen's streamer on real sockets (DESIGN.md section 5).

    manifest ─▶ skeleton ─▶ per chunk: level or "text" ─▶ fetch ‖ decode / compute ─▶ one restore

`load_streaming` fetches the chunks of a context saved by `save_chunked` in order, one fetch in
flight on a background thread while the caller's thread decodes the chunk before it (the native
decode releases the GIL) or computes it. Per chunk it chooses, when the fetch can start:

- the throughput so far: bytes / wall time of each fetch, smoothed harmonically (a drop shows at
  once, a recovery over a few chunks); before any chunk arrived, `prior_mbps`, else the first chunk
  goes at the smallest level stored to measure the link;
- "text" when even the smallest level would arrive later than llama.cpp computes the chunk
  (CacheGen's rule), counting the text chunks this thread already has to compute first: a slow
  link then gets text and fetched chunks in parallel, not every chunk computed in turn. Prefill
  speed is measured once per model and thread count on a scratch context (`calibrate`), kept for
  the process, and refined by every chunk computed;
- else the best level whose predicted time for every chunk left (their sizes from the manifest;
  sizes it lacks estimated from the other chunks of that level) fits what is left of `slo_s`;
- when no level fits, text again if the CPU would be done with that chunk (and the chunks it
  already computes) before the link is done with the rest: computed chunks then overlap fetched
  ones, which CacheGen's rule leaves unused. Else the smallest level.

A fetch that takes twice as long as computing its chunk (and twice its prediction) is abandoned
and the chunk computed: a link that stalls without failing costs a few chunks' compute time, not a
read timeout, and a link that only slows down for a while is waited for. A chunk that fails
(connection reset, timeout, missing object, bad checksum or tag, an object of another model) is
fetched once more; if that fails too, the rest is computed from text. A text chunk is computed by
llama.cpp on top of the chunks before it (restored from the buffer), read back and spliced into
the buffer; later chunks can still be fetched. The context is touched by text chunks only, and is
put back as it was if the load fails; it takes the assembled state in one llama.cpp call at the
end (llama.restore_context), llama-cpp-python's tokens and last logits with it. `slo_s` None: no
adaptation, the best level stored per chunk (or `level`), text only for failures.

Expected quality: the token-weighted mean of a per-level KL figure (`LEVEL_KL`, measured by
bench/streaming.py on SmolLM2-135M over a 256-token teacher-forced continuation; "text" and
"lossless" are exact). A ranking more than a prediction: pass `kl_table=` for another model.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import _internals

from . import chunks, codec, stores
from .errors import CacheGenError, CorruptDataError, InvalidArgumentError, ModelMismatchError
from .llama import (
    LoadReport,
    _forget,
    _seq_id_ok,
    capture_state,
    check_fingerprint,
    fingerprint_key,
    forget_kv,
    load_compressed_state,
    model_fingerprint,
    restore_context,
    restore_state,
    set_tokens,
)

TEXT = "text"
# mean KL(f16 || level) per token, bench/streaming.py on SmolLM2-135M (gpl-3.0.txt, 768 tokens)
LEVEL_KL: dict[str, float] = {
    TEXT: 0.0,
    "lossless": 0.0,
    "high": 0.0036,
    "balanced": 0.0067,
    "compact": 0.031,
}
# state bytes per level, as a fraction of f16: for chunks whose size no manifest recorded
_GUESS_RATIO = {"lossless": 0.85, "high": 0.48, "balanced": 0.3, "compact": 0.22}
_SMOOTHING = 0.3  # weight of the newest throughput sample (and prefill speed)
_SLO_SHARE = 0.9  # plans fit this share of the time left: estimates are noisy
_ABANDON_FACTOR = 2.0  # a fetch may take this many times its prediction, or the chunk's compute time
_RECENT = 3  # throughput samples whose slowest bounds the plans
_LOOKAHEAD = 2  # chunks decided (fetched or planned as text) ahead of the one being assembled
_CALIBRATION_TOKENS = 128
_RESTORE_BPS = 2e9  # llama.cpp's set_data copies about this many state bytes per second

_tps_cache: dict[tuple[str, int], float] = {}
_tps_lock = threading.Lock()


@dataclass
class ChunkRecord:
    """What happened to one chunk."""

    index: int
    begin: int
    end: int
    level: str = ""  # a level name, or "text" (computed by llama.cpp)
    reason: str = ""  # why: best, budget, smallest, first, fixed, slow link, offload, stalled, failed
    bytes: int = 0  # fetched for this chunk (its statistics too, the first time they are named)
    fetch_ms: float = 0.0  # wall time of the fetch that was used (or abandoned)
    decode_ms: float = 0.0
    compute_ms: float = 0.0  # restore of the chunks before it + prefill + read back + splice
    mbps: float | None = None  # the bandwidth estimate (Mbit/s) the choice was made with
    retries: int = 0
    fetch_at_ms: float | None = None  # when the fetch used began, from the load's start
    decode_at_ms: float | None = None  # when its decode (or computation) began


@dataclass
class StreamReport(LoadReport):
    """LoadReport plus what `load_streaming` chose and measured per chunk."""

    url: str = ""
    slo_s: float | None = None
    chunk_tokens: int = 0
    records: list[ChunkRecord] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # every fetch or decode that failed, in order
    fallback: str | None = None  # why the rest of the context was computed from text, if it was
    total_ms: float = 0.0  # from the manifest's read to the restored context
    assemble_ms: float = 0.0  # manifest read to buffer complete (fetch, decode, compute overlapped)
    skeleton_ms: float = 0.0  # of which fetching the skeleton (before any chunk)
    calibrate_ms: float = 0.0  # measuring prefill speed (once per process and model; not in total_ms)
    compute_tps: float | None = None  # prefill tokens/s the choices used
    expected_kl: float = 0.0  # token-weighted mean of kl_table over the chunks
    kl_table: dict[str, float] = field(default_factory=dict)

    @property
    def slo_met(self) -> bool | None:
        return None if self.slo_s is None else self.total_ms <= self.slo_s * 1e3

    @property
    def text_chunks(self) -> list[int]:
        return [r.index for r in self.records if r.level == TEXT]

    def to_dict(self) -> dict[str, Any]:
        levels: dict[str, int] = {}
        for r in self.records:
            levels[r.level] = levels.get(r.level, 0) + 1
        return {
            "url": self.url,
            "tokens": self.tokens,
            "chunk_tokens": self.chunk_tokens,
            "slo_s": self.slo_s,
            "slo_met": self.slo_met,
            "total_ms": self.total_ms,
            "assemble_ms": self.assemble_ms,
            "skeleton_ms": self.skeleton_ms,
            "restore_ms": self.restore_ms,
            "calibrate_ms": self.calibrate_ms,
            "bytes_read": self.bytes_read,
            "state_bytes": self.state_bytes,
            "compute_tps": self.compute_tps,
            "expected_kl": self.expected_kl,
            "levels": levels,
            "text_chunks": self.text_chunks,
            "fallback": self.fallback,
            "failures": list(self.failures),
            "chunks": [asdict(r) for r in self.records],
        }


# ---- prefill speed --------------------------------------------------------------------------------


def _decode_tokens(ctx: Any, tokens: np.ndarray, pos0: int, seq: int, n_batch: int) -> None:
    """llama_decode of `tokens` at positions pos0.. in sequence `seq`, no logits kept but the last."""
    batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
    try:
        for k in range(0, len(tokens), n_batch):
            part = tokens[k : k + n_batch]
            batch.n_tokens = len(part)
            for j, token in enumerate(part):
                batch.token[j] = int(token)
                batch.pos[j] = pos0 + k + j
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = seq
                batch.logits[j] = False
            batch.logits[len(part) - 1] = True
            status = llama_cpp.llama_decode(ctx, batch)
            if status != 0:
                raise CacheGenError(f"llama_decode failed ({status}) computing positions {pos0 + k}..")
    finally:
        llama_cpp.llama_batch_free(batch)


def _tps_key(llm: llama_cpp.Llama) -> tuple[str, int]:
    return fingerprint_key(model_fingerprint(llm)), int(llm.context_params.n_threads_batch)


def calibrate(llm: llama_cpp.Llama, *, tokens: int = _CALIBRATION_TOKENS, force: bool = False) -> float:
    """Prefill tokens/s of this model with this context's batch threads, measured once per process
    on a scratch context (the context of `llm` is not touched) and kept; `force` measures again."""
    key = _tps_key(llm)
    with _tps_lock:
        if key in _tps_cache and not force:
            return _tps_cache[key]
    params = type(llm.context_params).from_buffer_copy(llm.context_params)
    params.n_ctx = tokens + 16
    params.n_batch = params.n_ubatch = min(int(llm.n_batch), tokens)
    params.n_seq_max = 1
    scratch = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
    try:
        n_vocab = llm.n_vocab()
        ids = (np.arange(tokens + 8) * 7919 + 13) % n_vocab  # any ids: speed does not depend on them
        _decode_tokens(scratch.ctx, ids[:8], 0, 0, params.n_batch)  # warm-up: graph and buffers
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(scratch.ctx), True)
        start = time.perf_counter()
        _decode_tokens(scratch.ctx, ids[:tokens], 0, 0, params.n_batch)
        tps = tokens / (time.perf_counter() - start)
    finally:
        scratch.close()
    with _tps_lock:
        _tps_cache[key] = tps
    return tps


def _learn_tps(key: tuple[str, int], tps: float) -> None:
    with _tps_lock:
        old = _tps_cache.get(key)
        _tps_cache[key] = tps if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * tps


# ---- the link: one fetch at a time on a daemon thread ---------------------------------------------


class _Job:
    """One chunk fetch on its own daemon thread (a fetch stuck on a dead link is left to finish or
    fail on its own; the load goes on without it)."""

    def __init__(
        self, reader: chunks._ChunkReader, index: int, level: str, fetch: Callable[[], Any] | None = None
    ) -> None:
        self.index, self.level = index, level
        self._fetch = fetch or (lambda: reader.fetch(index, (level,)))
        self.result: Any = None
        self.error: BaseException | None = None
        self.bytes = 0
        self.abandoned = False
        self.done = threading.Event()
        self.start = time.perf_counter()
        self.end = 0.0
        self._reader = reader
        threading.Thread(target=self._run, name=f"lcg-fetch-{index}", daemon=True).start()

    def _run(self) -> None:
        before = self._reader.bytes_read
        try:
            self.result = self._fetch()
        except BaseException as exc:  # noqa: BLE001 - handed to the loader's thread
            self.error = exc
        self.bytes = self._reader.bytes_read - before
        self.end = time.perf_counter()
        self.done.set()

    @property
    def seconds(self) -> float:
        return (self.end if self.done.is_set() else time.perf_counter()) - self.start


# ---- the loader -----------------------------------------------------------------------------------


class _Failed(Exception):
    """A chunk could not be fetched or decoded twice: the rest is computed."""


class _Loader:
    def __init__(
        self,
        llm: llama_cpp.Llama,
        store: stores.Store,
        m: chunks.Manifest,
        fingerprint: dict[str, Any],
        target: int | None,
        *,
        slo_s: float | None,
        prior_mbps: float | None,
        level: str | None,
        threads: int | None,
        text_ok: bool,
        compute_tps: float | None,
        oracle: Callable[[int], float] | None,
        progress: Callable[[ChunkRecord], None] | None,
        t0: float,
    ) -> None:
        self.llm, self.store, self.m, self.target = llm, store, m, target
        self.tokens = m.meta.tokens
        c = m.chunk_tokens
        assert c is not None
        self.ranges = chunks.chunk_ranges(int(self.tokens.size), c)
        keys = chunks.chain_keys(fingerprint, self.tokens, c)
        if keys != [e.key for e in m.chunks]:
            raise CorruptDataError("the manifest's chunk keys do not recompute from its tokens")
        self.levels = [chunks._candidates(e.sizes, level, i) for i, e in enumerate(m.chunks)]
        self.reader = chunks._ChunkReader(store, fingerprint, self.tokens, c, keys, self.levels)
        self.slo_s, self.level, self.threads = slo_s, level, threads
        self.adapt = slo_s is not None and level is None
        self.text_ok, self.tps, self.oracle, self.progress = text_ok, compute_tps, oracle, progress
        self.inv_bw = None if prior_mbps is None else 8 / (prior_mbps * 1e6)  # seconds per byte
        self.t0 = t0
        n = len(self.ranges)
        self.records = [ChunkRecord(i, b, e) for i, (b, e) in enumerate(self.ranges)]
        self.plan: list[str | None] = [None] * n
        self.jobs: dict[int, _Job] = {}  # started, not yet taken by the assembly
        self.current: _Job | None = None  # the job holding the link (done or not)
        self.failures: list[str] = []
        self.fallback: str | None = None
        self.decode_s_per_byte: dict[str, float] = {}
        self.held = -1  # positions 0..held-1 of the buffer are what the context holds (-1: not ours)
        self.backup: tuple[bytes | None] | None = None
        self.tps_key = _tps_key(llm)
        self.state: bytearray | None = None
        self.skeleton = b""
        self.per_token = 0.0  # f16 state bytes per position
        self.skeleton_s = 0.0
        self.recent_inv_bw: deque[float] = deque(maxlen=_RECENT)

    # -- estimates --

    def _size(self, i: int, level: str) -> float:
        size = self.m.chunks[i].sizes.get(level)
        if size is not None:
            return float(size)
        known = [
            (e.sizes[level], b1 - b0)
            for e, (b0, b1) in zip(self.m.chunks, self.ranges, strict=True)
            if e.sizes.get(level) is not None
        ]
        b, e = self.ranges[i]
        if known:
            return sum(s for s, _ in known) / sum(t for _, t in known) * (e - b)
        return _GUESS_RATIO.get(level, 1.0) * self.per_token * (e - b)

    def _net_s(self, nbytes: float) -> float:
        if self.oracle is not None:
            return self.oracle(int(nbytes))
        assert self.inv_bw is not None
        # plans assume the slowest of the last few chunks: on a link whose rate swings, the mean
        # fills the budget with levels that a slow spell then stretches past the SLO
        return nbytes * max([self.inv_bw, *self.recent_inv_bw])

    def _mbps(self) -> float | None:
        if self.oracle is not None:
            probe = 1 << 20
            return probe * 8 / 1e6 / max(self.oracle(probe), 1e-9)
        return None if self.inv_bw is None else 8 / self.inv_bw / 1e6

    def _text_s(self, i: int) -> float:
        b, e = self.ranges[i]
        assert self.tps is not None
        return (e - b) / self.tps

    def _sample(self, job: _Job) -> None:
        if job.error is None and job.bytes:
            inv = job.seconds / job.bytes
            self.inv_bw = inv if self.inv_bw is None else (1 - _SMOOTHING) * self.inv_bw + _SMOOTHING * inv
            self.recent_inv_bw.append(inv)

    def _pending_text_s(self, i: int) -> float:
        return sum(self._text_s(k) for k in range(i, len(self.plan)) if self.plan[k] == TEXT)

    # -- choice --

    def _choose(self, j: int, i: int) -> tuple[str, str]:
        """(level or text, reason) for chunk j, when chunk i is the next to assemble."""
        levels = self.levels[j]
        if self.fallback is not None:
            return TEXT, "failed"
        if not self.adapt:
            return levels[0], "fixed" if self.level else "best"
        if self.inv_bw is None and self.oracle is None:
            return levels[-1], "first"
        smallest = levels[-1]
        cpu_s = self._pending_text_s(i)  # the text chunks this thread computes before chunk j
        if self.text_ok and cpu_s + self._text_s(j) < self._net_s(self._size(j, smallest)):
            return TEXT, "slow link"
        assert self.slo_s is not None
        undecided = [k for k in range(j, len(self.plan)) if self.plan[k] is None]
        restore_s = len(self.state or b"") / _RESTORE_BPS
        budget = _SLO_SHARE * (self.slo_s - (time.perf_counter() - self.t0)) - restore_s
        for level in levels:
            if not all(level in self.levels[k] for k in undecided):
                continue
            net = self._net_s(sum(self._size(k, level) for k in undecided))
            tail = self.decode_s_per_byte.get(level, 0.0) * self._size(undecided[-1], level)
            if max(net, cpu_s) + tail <= budget:
                return level, "best" if level == levels[0] else "budget"
        if self.text_ok:
            net_all = self._net_s(sum(self._size(k, smallest) for k in undecided))
            if cpu_s + self._text_s(j) < net_all:
                return TEXT, "offload"
        return smallest, "smallest"

    def _feed(self, i: int) -> None:
        """Decides chunks from the first undecided on while the link is free, up to _LOOKAHEAD
        ahead of chunk i; starts the fetch of the first one that is not text."""
        while True:
            j = next((k for k, p in enumerate(self.plan) if p is None), None)
            if j is None or j > i + _LOOKAHEAD or self._link_busy():
                return
            choice, reason = self._choose(j, i)
            self.plan[j] = choice
            rec = self.records[j]
            rec.level, rec.reason, rec.mbps = choice, reason, self._mbps()
            if choice != TEXT:
                self._start(j, choice)

    def _link_busy(self) -> bool:
        job = self.current
        if job is None or not job.done.is_set():
            return job is not None
        if job.abandoned:  # it finished after all: what it measured still counts
            self._sample(job)
            self.current = None
        return False

    def _start(self, j: int, level: str) -> None:
        job = _Job(self.reader, j, level)
        self.jobs[j] = job
        self.current = job

    # -- assembly --

    def _deadline(self, job: _Job) -> float | None:
        if not (self.adapt and self.text_ok):
            return None  # the store's own timeouts apply
        text_s = self._text_s(job.index)
        if self.inv_bw is not None or self.oracle is not None:
            text_s = max(text_s, self._net_s(self._size(job.index, job.level)))
        return job.start + _ABANDON_FACTOR * text_s

    def _wait(self, job: _Job) -> bool:
        """Waits for `job` until its deadline; False when it was abandoned."""
        deadline = self._deadline(job)
        timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
        if job.done.wait(timeout):
            return True
        job.abandoned = True
        self.inv_bw = max(self.inv_bw or 0.0, job.seconds / self._size(job.index, job.level))
        return False

    def _wait_idle(self) -> bool:
        """Lets the job holding the link finish before a retry; False when it stalled (abandoned,
        its chunk planned as text)."""
        job = self.current
        if job is None or job.done.is_set():
            return not self._link_busy()
        if self._wait(job):
            return True
        self._to_text(job.index, "stalled")
        return False

    def _to_text(self, i: int, reason: str) -> None:
        self.plan[i] = TEXT
        self.records[i].level, self.records[i].reason = TEXT, reason
        self.jobs.pop(i, None)

    def _fail(self, i: int, level: str, exc: BaseException, what: str) -> None:
        self.failures.append(f"chunk {i} ({level}) {what}: {type(exc).__name__}: {exc}")

    def _fetch_and_decode(self, i: int) -> None:
        """Chunk i from the store into the buffer, fetched once more if that fails; a fetch that
        stalls makes it a text chunk; two failures raise _Failed."""
        rec = self.records[i]
        level = self.plan[i]
        assert level is not None and level != TEXT and self.state is not None
        while True:
            job = self.jobs[i]
            if not self._wait(job):
                rec.fetch_ms = job.seconds * 1e3
                self._to_text(i, "stalled")
                return
            self.jobs.pop(i)
            self._sample(job)
            rec.bytes += job.bytes
            rec.fetch_ms = job.seconds * 1e3
            rec.fetch_at_ms = (job.start - self.t0) * 1e3
            error: BaseException | None = job.error
            if error is None:
                assert job.result is not None
                self._feed(i)  # the link is free: the next fetch runs while this chunk decodes
                start = time.perf_counter()
                rec.decode_at_ms = (start - self.t0) * 1e3
                try:
                    codec.decode_chunk(job.result.chunk, job.result.stats, self.state, threads=self.threads)
                except CacheGenError as exc:
                    error = exc
                rec.decode_ms = (time.perf_counter() - start) * 1e3
                if error is None:
                    self.decode_s_per_byte[level] = rec.decode_ms / 1e3 / max(1, len(job.result.chunk))
                    return
                self._fail(i, level, error, "did not decode")
            else:
                self._fail(i, level, error, "could not be fetched")
            if not isinstance(error, (CacheGenError, OSError)) or rec.retries:
                raise _Failed(self.failures[-1]) from error
            rec.retries += 1
            if not self._wait_idle():
                self._to_text(i, "stalled")  # the link holds a stalled fetch: no retry behind it
                return
            self._start(i, level)

    def _compute(self, i: int) -> None:
        """Chunk i computed by llama.cpp on top of the buffer's chunks 0..i-1, spliced in."""
        assert self.state is not None
        rec = self.records[i]
        b, e = rec.begin, rec.end
        start = time.perf_counter()
        rec.decode_at_ms = (start - self.t0) * 1e3
        if self.backup is None:
            self.backup = (self._capture(),)
        memory = llama_cpp.llama_get_memory(self.llm.ctx)
        seq = 0 if self.target is None else self.target
        if self.held != b:
            if b == 0:
                forget_kv(self.llm, self.target)
            else:
                before = codec.skeleton_state(self.skeleton, b)
                codec.splice(before, self.state, 0, b)
                if not restore_state(self.llm, before, self.target):
                    raise ModelMismatchError("llama.cpp refused the state of the chunks before a text chunk")
        self.held = -1
        llama_cpp.llama_memory_seq_rm(memory, seq, b, -1)
        _decode_tokens(self.llm.ctx, self.tokens[b:e], b, seq, int(self.llm.n_batch))
        codec.splice(self.state, capture_state(self.llm, self.target), b, e)
        self.held = e
        seconds = time.perf_counter() - start
        rec.compute_ms = seconds * 1e3
        _learn_tps(self.tps_key, (e - b) / seconds)

    def _capture(self) -> bytes | None:
        try:
            return capture_state(self.llm, self.target)
        except CacheGenError:  # nothing to copy (an empty sequence): put back means clear
            return None

    def rollback(self) -> None:
        """Puts the context back as it was before the first text chunk."""
        if self.backup is None:
            return
        (saved,) = self.backup
        if saved is None or not restore_state(self.llm, saved, self.target):
            _forget(self.llm, self.target)

    def assemble(self) -> bool:
        """Fills the buffer (True), or the context itself when there is no skeleton (False)."""
        start = time.perf_counter()
        skeleton = self._skeleton()
        self.skeleton_s = time.perf_counter() - start
        if skeleton is None:
            self._compute_all()
            return False
        self.skeleton = skeleton
        n = int(self.tokens.size)
        bound = chunks._state_bound(self.reader.fingerprint, n, self.skeleton)
        self.state = codec.skeleton_state(self.skeleton, n, max_size=bound)
        self.per_token = len(self.state) / n
        for i in range(len(self.ranges)):
            self._feed(i)
            if self.plan[i] is None:  # the link is held by a stalled fetch
                self.plan[i] = TEXT
                self.records[i].level, self.records[i].reason = TEXT, "stalled"
                self.records[i].mbps = self._mbps()
            if self.plan[i] != TEXT:
                try:
                    self._fetch_and_decode(i)
                except _Failed as exc:
                    if not self.text_ok:
                        raise exc.__cause__ or exc from None
                    self.fallback = f"{exc}; chunks {i}.. computed from text"
                    for k in range(i, len(self.plan)):
                        self._to_text(k, "failed")
            if self.plan[i] == TEXT:
                if not self.text_ok:
                    raise CacheGenError(f"chunk {i} stalled and text fallback is off")
                self._compute(i)
            if self.progress is not None:
                self.progress(self.records[i])
        return True

    def _skeleton(self) -> bytes | None:
        """The skeleton, fetched once more if that fails; None when it failed twice or stalled
        (longer than computing the first chunk) and text may be computed."""
        skeleton_id = self.m.skeleton
        assert skeleton_id is not None
        key = chunks._skeleton_key(skeleton_id)
        for attempt in (0, 1):
            job = _Job(
                self.reader, -1, "skeleton", lambda: self.reader.get_verified(key, skeleton_id, "skeleton")
            )
            self.current = job
            stall = self.adapt and self.text_ok
            if not job.done.wait(max(0.2, self._text_s(0)) if stall else None):
                job.abandoned = True
                self.failures.append(f"skeleton stalled ({job.seconds:.1f} s)")
                self.fallback = "the skeleton did not arrive: every chunk computed from text"
                return None
            self.current = None
            if job.error is None:  # no throughput sample: a small object measures latency
                return job.result
            exc = job.error
            self.failures.append(f"skeleton could not be fetched: {type(exc).__name__}: {exc}")
            if attempt and not self.text_ok:
                raise exc
        self.fallback = "the skeleton could not be fetched: every chunk computed from text"
        return None

    def _compute_all(self) -> None:
        """Every chunk computed into the context itself (no skeleton, so no buffer)."""
        self.backup = (self._capture(),)
        forget_kv(self.llm, self.target)
        seq = 0 if self.target is None else self.target
        for rec in self.records:
            start = time.perf_counter()
            rec.level, rec.reason, rec.mbps = TEXT, "failed", self._mbps()
            rec.decode_at_ms = (start - self.t0) * 1e3
            _decode_tokens(
                self.llm.ctx, self.tokens[rec.begin : rec.end], rec.begin, seq, int(self.llm.n_batch)
            )
            rec.compute_ms = (time.perf_counter() - start) * 1e3
            if self.progress is not None:
                self.progress(rec)


def load_streaming(
    llm: llama_cpp.Llama,
    url: str | Path,
    *,
    slo_s: float | None = None,
    prior_mbps: float | None = None,
    threads: int | None = None,
    level: str | None = None,
    seq_id: int | None = None,
    text_fallback: bool = True,
    compute_tps: float | None = None,
    kl_table: dict[str, float] | None = None,
    oracle: Callable[[int], float] | None = None,
    progress: Callable[[ChunkRecord], None] | None = None,
    manifest: bytes | None = None,
) -> StreamReport:
    """Loads a chunked context chunk by chunk, choosing per chunk a level or text (module docstring).

    `slo_s`: seconds from the manifest's read to a loaded context; None loads the best level
    stored (or `level`, fixed) and computes only what fails. `prior_mbps`: the link's expected
    rate (Mbit/s) for the first choice. `compute_tps`: prefill tokens/s to assume instead of
    measuring. `text_fallback=False`: nothing is computed; a chunk that fails twice raises, the
    context unchanged. `oracle(nbytes)`: seconds the link will take for nbytes from now (a
    bandwidth oracle, for benchmarks). `progress(record)` is called after each chunk.
    A whole-container manifest (a state that could not be chunked) loads as `load_chunked` does.
    """
    if slo_s is not None and not (isinstance(slo_s, (int, float)) and slo_s > 0 and math.isfinite(slo_s)):
        raise InvalidArgumentError(f"slo_s must be a positive number of seconds, got {slo_s!r}")
    if prior_mbps is not None and not prior_mbps > 0:
        raise InvalidArgumentError(f"prior_mbps must be positive, got {prior_mbps!r}")
    if level is not None:
        codec._level(level)
    table = dict(LEVEL_KL if kl_table is None else kl_table)
    store_url, key = chunks.split_manifest_url(url)
    calibrate_s = 0.0
    if compute_tps is None and slo_s is not None and text_fallback:
        start = time.perf_counter()
        compute_tps = calibrate(llm)
        calibrate_s = time.perf_counter() - start
    t0 = time.perf_counter()
    with stores.open_store(store_url) as store:
        data = store.get(key) if manifest is None else bytes(manifest)
        if not chunks.is_manifest(data):  # one whole container: nothing to stream
            whole = load_compressed_state(llm, data, seq_id=seq_id, threads=threads)
            whole.extra["levels"] = {codec.inspect(data)["level"]: 1}
            return _whole_report(whole, str(url), slo_s, t0, table)
        m = chunks.Manifest.unpack(data)
        fingerprint = model_fingerprint(llm)
        check_fingerprint(m.meta.fingerprint, fingerprint)
        target = chunks._target(m.meta.scope, seq_id)
        _seq_id_ok(llm, target)
        tokens = m.meta.tokens
        chunks._check_room(llm, int(tokens.size))
        if m.chunk_tokens is None:
            whole = chunks._load_whole(llm, store, m, level, seq_id, threads, len(data))
            return _whole_report(whole, str(url), slo_s, t0, table)
        loader = _Loader(
            llm,
            store,
            m,
            fingerprint,
            target,
            slo_s=slo_s,
            prior_mbps=prior_mbps,
            level=level,
            threads=threads,
            text_ok=text_fallback,
            compute_tps=compute_tps,
            oracle=oracle,
            progress=progress,
            t0=t0,
        )
        t1 = time.perf_counter()
        try:
            buffered = loader.assemble()
            t2 = time.perf_counter()
            if buffered:
                assert loader.state is not None
                restore_context(llm, loader.state, target, tokens, m.meta.logits)
            else:
                set_tokens(llm, target, tokens)
        except BaseException:
            loader.rollback()
            raise
    t3 = time.perf_counter()
    records = loader.records
    kl = sum(table.get(r.level, math.nan) * (r.end - r.begin) for r in records) / max(1, int(tokens.size))
    bytes_read = len(data) + loader.reader.bytes_read
    return StreamReport(
        tokens=int(tokens.size) if target in (None, 0) else 0,
        cells=int(tokens.size),
        bytes_read=bytes_read,
        state_bytes=len(loader.state or b""),
        ratio=len(loader.state or b"") / bytes_read,
        read_ms=(t1 - t0) * 1e3 + sum(r.fetch_ms for r in records),
        decode_ms=sum(r.decode_ms for r in records),
        restore_ms=(t3 - t2) * 1e3,
        seq_id=target,
        extra={"chunks": len(records), "levels": _count(records)},
        url=str(url),
        slo_s=slo_s,
        chunk_tokens=int(m.chunk_tokens),
        records=records,
        failures=loader.failures,
        fallback=loader.fallback,
        total_ms=(t3 - t0) * 1e3,
        assemble_ms=(t2 - t1) * 1e3,
        skeleton_ms=loader.skeleton_s * 1e3,
        calibrate_ms=calibrate_s * 1e3,
        compute_tps=loader.tps,
        expected_kl=kl,
        kl_table=table,
    )


def _count(records: list[ChunkRecord]) -> dict[str, int]:
    levels: dict[str, int] = {}
    for r in records:
        levels[r.level] = levels.get(r.level, 0) + 1
    return levels


def _whole_report(
    whole: LoadReport, url: str, slo_s: float | None, t0: float, table: dict[str, float]
) -> StreamReport:
    (level,) = whole.extra["levels"]
    n = whole.cells
    record = ChunkRecord(0, 0, n, level, "whole", whole.bytes_read, whole.read_ms, whole.decode_ms)
    return StreamReport(
        **{k: getattr(whole, k) for k in LoadReport.__dataclass_fields__},
        url=url,
        slo_s=slo_s,
        records=[record],
        total_ms=(time.perf_counter() - t0) * 1e3,
        expected_kl=table.get(level, math.nan),
        kl_table=table,
    )


__all__ = ["LEVEL_KL", "TEXT", "ChunkRecord", "StreamReport", "calibrate", "load_streaming"]
