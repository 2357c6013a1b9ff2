"""Adaptive streaming of chunked contexts: CacheGen's streamer on real sockets (DESIGN.md section 5).

    manifest ─▶ skeleton ─▶ per chunk: level or "text" ─▶ fetch ‖ decode / compute ─▶ one restore

`load_streaming` fetches the chunks of a context saved by `save_chunked`, one fetch in flight on a
background thread, which starts the next fetch itself when its own ends (the link never waits for
the caller's thread); the caller's thread decodes what arrived (the native decode releases the
GIL) or computes text chunks. With `slo_s` and text fallback, the two work from both ends (as
Cake, arXiv 2410.03065): the link fetches from the last chunk back, llama.cpp computes from the
first chunk on, and they meet where their speeds put them. Text chunks need only the chunks before
them, so computing from the front never waits for the link.

Every fetch decision and every idle moment of the caller's thread re-plans the undecided chunks
jointly: for each split (the first x undecided chunks computed, the others fetched) and each level
or pair of adjacent levels (the better one for as many of the latest chunks as fit: recent tokens
weigh most) it predicts the finish from
- the link: bytes / throughput, the slower of the smoothed and the mean rate of the fetches so far
  (before any chunk: `prior_mbps`, else the skeleton's fetch, latency-bound and so slow, and the
  first fetch takes the smallest level: one sample of a rate that may vary by orders of
  magnitude); a fetch in flight past its prediction is expected to be as late again;
- the CPU: prefill seconds per token as a line in the position (attention grows with the
  context), measured once per model and thread count (`calibrate`) and fitted to every piece
  computed since (`_PrefillSpeed`), plus each fetched chunk's decode time (measured per level);
- the final restore (state bytes, and with logits_all the logits rows it marks unknown, at
  _RESTORE_BPS),
and takes the plan with the lowest token-weighted KL (a chunk computed counts as the best level
stored for it: text is the fallback for a slow link, not a level above the best) that finishes
within a share of the time left (_SLO_SHARE, less on a link whose rate has varied between chunks:
`_share`) and at least _SLO_FLOOR of the SLO before its end, the earliest among equals; when none
fits, the earliest, and among those ending alike (the CPU's part the later), the one whose fetches
end first: smaller chunks on the link keep it ahead of the CPU if its rate falls, and a link done
early races the CPU's chunk (a larger level there bought KL with the SLO).
The link fetches its next chunk at that plan's level; the CPU computes the front chunk when the
plan computes any. Races, both ways: when the front chunk is in flight and the CPU, idle, holds
every chunk before it (nothing to restore), or when the only chunk left is in flight and not due
within a piece's compute time (_PIECE tokens), the CPU computes it too and stops as soon as the
fetch arrives, within the llama_decode call (llama.cpp's abort callback; a model with a recurrent
state, which cannot be cut back, between pieces of _RACE_PIECE tokens); when every chunk is decided and
the link is free, it fetches the chunk the CPU computes if that plan is better (a text chunk
begun on a rate estimate that turned out too slow), or if the CPU will be late and the latest
fetch's rate would bring it first. A stalled link costs at most one chunk's compute time. Past
the SLO's last moment (less _SLO_FLOOR and the restore), whatever the estimates say, nothing waits
for the link: the CPU computes the front chunk (reason "late"), racing its fetch if it has one.

Two corrections for a rate that changes under a plan:
- A fetch past its prediction is measured as it goes (the bytes it has received over the last
  _RECENT_S, where the store reports them: Store.received, the HTTP store) and given up when no
  plan that waits for it meets the deadline but one without it does (the store ends that read:
  Store.cancel); the chunk is planned again with the others (`given_up` in its record).
- Time left is spent on quality: with every chunk decided and the link free, a chunk in the
  buffer is fetched again at a better level (the most KL gained per byte) when that is due
  before the SLO (less its last _SLO_FLOOR and the restore); the load waits for it until then
  and drops it after (`upgraded_from` in its record). The CPU, idle once every chunk is in the
  buffer, computes the first chunks below the best level stored again (exact, in order from the
  first one that is not, as many as end by then and before the link would bring them at their
  best; the link upgrades the others), stopping between pieces at that time. A new chunk is
  fetched below the plan's level while an upgrade gains more KL per byte and does not fit after
  the plan (`_capped`).
  Plans made on a pessimistic estimate (a slow start, a wide spread, the first fetch) so give back
  what they cost.

The skeleton is fetched first (the buffer is built from it); while it is late (longer than a
piece's compute), the CPU computes from the first chunk into the context, which keeps what it
computed until the buffer exists. On a link too slow for even the skeleton, every chunk is
computed and the skeleton is not waited for.

Without `slo_s` (or with a fixed `level`, or no text fallback) chunks are fetched in order, up to
_LOOKAHEAD ahead. A chunk that fails (connection reset, timeout, missing object, bad checksum or
tag, an object of another model) is fetched once more; if that fails too, every chunk not in the
buffer is computed from text (the skeleton likewise). When the load ends, the store is closed,
which ends any fetch it gave up on (a stalled one would take the link from the requests after
it). A text chunk is computed by llama.cpp on top of the chunks before it (restored from the
buffer unless the context holds them; a hybrid model's recurrent state cannot be restored for a
prefix, so those are computed again from the first token), read back and spliced into the
buffer. The context is
touched by text chunks only, and is put back as it was if the load fails; it takes the assembled
state in one llama.cpp call at the end (llama.restore_context).

Expected quality: the token-weighted mean of a per-level KL figure (`LEVEL_KL`, measured by
bench/streaming.py on SmolLM2-135M over a 256-token teacher-forced continuation; "text" and
"lossless" are exact). A ranking more than a prediction: pass `kl_table=` for another model.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import _internals

from . import chunks, codec, envelope, stores
from .errors import CacheGenError, CorruptDataError, InvalidArgumentError, ModelMismatchError
from .llama import (
    LoadReport,
    StateMeta,
    _seq_id_ok,
    _state_array,
    check_fingerprint,
    fingerprint_key,
    forget_kv,
    has_recurrent_state,
    load_compressed_state,
    model_fingerprint,
    put_back,
    require_kv_cache,
    restore_context,
    restore_state,
    scores_fill_bytes,
    set_tokens,
    worse_load,
)

TEXT = "text"
# mean KL(f16 || level) per token, bench/streaming.py on SmolLM2-135M (gpl-3.0.txt, 768 tokens)
LEVEL_KL: dict[str, float] = {
    TEXT: 0.0,
    "lossless": 0.0,
    "high": 0.0034,
    "balanced": 0.0062,
    "compact": 0.0095,
}
# state bytes per level, as a fraction of f16: for chunks whose size no manifest recorded
_GUESS_RATIO = {"lossless": 0.85, "high": 0.47, "balanced": 0.25, "compact": 0.22}
_SMOOTHING = 0.3  # weight of the newest throughput sample
_SLO_SHARE = 0.9  # plans fit this share of the time left: estimates are noisy
# ... and end at least this share of the whole SLO early: near the end, a share of the little time
# left is less than the error of predicting the last fetch, decode and restore.
_SLO_FLOOR = 0.05
# ... divided by 1 + _SPREAD_Z x the spread (coefficient of variation) of the chunk fetches'
# seconds per byte: a link whose rate jumps between chunks leaves room for a slow stretch, a steady
# one does not (with one sample or none, _PRIOR_SPREAD stands in).
_SPREAD_Z = 1.0
_PRIOR_SPREAD = 0.25
_PIECE = 32  # tokens per llama_decode call of a text chunk: a computation can stop between pieces
_RACE_PIECE = 8  # ... a recurrent model's while a fetch of it is in flight (smaller: slower)
_RECENT_S = 0.3  # a late fetch's rate is measured over its last this many seconds
_GIVE_UP_GAIN = 0.1  # ... by this share of the time to the finish that waiting for it would give
_TICK_S = 0.05  # the assembly plans again at least this often while it waits for the link
_LOOKAHEAD = 2  # chunks decided (fetched or planned as text) ahead of the one being assembled
_CALIBRATION_TOKENS = 2 * _PIECE  # in pieces, as a load computes: a first load pays for it
_RESTORE_BPS = 2e9  # llama.cpp's set_data copies about this many state bytes per second

# the prefill speed model forgets a piece's sample at this rate per piece computed since (about the
# last 20 pieces count: a machine's load changes between loads)
_FORGET = 0.95
# ... and takes no slope from positions that spread less than this (a ridge on the slope, in tokens
# x positions^2: 32 tokens spread over +-256 positions weigh as much as the prior slope of 0)
_SLOPE_PRIOR = 32 * 256**2

_speeds: dict[tuple[str, int], _PrefillSpeed] = {}
_speeds_lock = threading.Lock()


@dataclass
class ChunkRecord:
    """What happened to one chunk."""

    index: int
    begin: int
    end: int
    level: str = ""  # a level name, or "text" (computed by llama.cpp)
    reason: str = ""  # why: best, budget, fastest, first, fixed, parallel, late, raced, stalled, failed
    bytes: int = 0  # fetched for this chunk (its statistics too, the first time they are named)
    fetch_ms: float = 0.0  # wall time of the fetches that were used (or abandoned)
    decode_ms: float = 0.0
    upgraded_from: str | None = None  # the level it was first fetched at, when fetched again at `level`
    compute_ms: float = 0.0  # restore of the chunks before it + prefill + read back + splice
    mbps: float | None = None  # the bandwidth estimate (Mbit/s) the choice was made with
    retries: int = 0
    given_up: int = 0  # fetches of it given up as too late (the store ended the read)
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
    total_ms: float = 0.0  # from the call to the restored context (a first load's calibration in it)
    assemble_ms: float = 0.0  # manifest read to buffer complete (fetch, decode, compute overlapped)
    skeleton_ms: float = 0.0  # of which fetching the skeleton (before any chunk)
    calibrate_ms: float = 0.0  # measuring prefill speed (once per process and model; in total_ms)
    compute_tps: float | None = None  # prefill tokens/s the choices used, at the first position
    compute_tps_end: float | None = None  # ... at the last (attention grows with the context)
    expected_kl: float = 0.0  # token-weighted mean of kl_table over the chunks (ranks plans; runs low)
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
            "compute_tps_end": self.compute_tps_end,
            "expected_kl": self.expected_kl,
            "levels": levels,
            "text_chunks": self.text_chunks,
            "fallback": self.fallback,
            "failures": list(self.failures),
            "chunks": [asdict(r) for r in self.records],
        }


# ---- prefill speed --------------------------------------------------------------------------------


def _decode_tokens(ctx: Any, tokens: np.ndarray, pos0: int, seq: int, n_batch: int) -> bool:
    """llama_decode of `tokens` at positions pos0.. in sequence `seq`, no logits kept but the last.
    False: the context's abort callback stopped it (llama.cpp keeps the micro-batches it finished
    and drops the positions of the one it stopped)."""
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
            if status == 2:
                return False
            if status != 0:
                raise CacheGenError(f"llama_decode failed ({status}) computing positions {pos0 + k}..")
    finally:
        llama_cpp.llama_batch_free(batch)
    return True


def _never() -> bool:
    return False


@contextlib.contextmanager
def _warnings_unprinted() -> Iterator[None]:
    """Keeps llama.cpp's warnings off stderr, unless llama-cpp-python is verbose: it prints them as
    errors (its table predates ggml's log levels), and a llama_decode that the abort callback
    stops warns that it removed the stopped positions, which is what the loader wants."""
    logger = logging.getLogger("llama-cpp-python")
    level = logger.level
    if level >= logging.ERROR:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class _PrefillSpeed:
    """Seconds llama.cpp takes per token at position p: a + c*p (attention's work grows with the
    context: SmolLM2's tokens at 2,048 positions take 25-40% longer than at the first), fitted by
    weighted least squares on the pieces of text chunks computed, older pieces forgotten (_FORGET:
    a load shares the CPU with its fetches, ~30% slower than an idle calibration), the slope held
    near 0 until the pieces spread over positions (_SLOPE_PRIOR). Starts from a calibration: `tps`
    over `tokens` from position 0."""

    def __init__(self, tps: float, tokens: int) -> None:
        self.w = float(tokens)  # sum of weights (tokens), and the weighted sums of x, y, x^2, x*y
        x, y = tokens / 2, 1.0 / tps  # x: a piece's mean position; y: its seconds per token
        self.sx, self.sy, self.sxx, self.sxy = self.w * x, self.w * y, self.w * x * x, self.w * x * y
        self.a, self.c = y, 0.0

    def seconds(self, b: int, e: int) -> float:
        """Predicted seconds to compute positions b..e-1."""
        return self.a * (e - b) + self.c * (e * e - b * b) / 2

    @property
    def tps(self) -> float:
        """Tokens per second at the first position."""
        return 1.0 / self.a

    def learn(self, b: int, e: int, seconds: float) -> None:
        w, x, y = float(e - b), (b + e - 1) / 2, seconds / (e - b)
        f = _FORGET ** ((e - b) / _PIECE)
        self.w, self.sx, self.sy = f * self.w + w, f * self.sx + w * x, f * self.sy + w * y
        self.sxx, self.sxy = f * self.sxx + w * x * x, f * self.sxy + w * x * y
        mx, my = self.sx / self.w, self.sy / self.w
        var, cov = self.sxx - self.w * mx * mx, self.sxy - self.w * mx * my
        self.c = max(0.0, cov / (var + _SLOPE_PRIOR))
        self.a = max(my - self.c * mx, 0.05 * my)  # a noisy slope cannot make the first tokens free


def _speed_key(llm: llama_cpp.Llama) -> tuple[str, int]:
    return fingerprint_key(model_fingerprint(llm)), int(llm.context_params.n_threads_batch)


def calibrate(llm: llama_cpp.Llama, *, tokens: int = _CALIBRATION_TOKENS, force: bool = False) -> float:
    """Prefill tokens/s of this model with this context's batch threads, measured once per process
    on a scratch context (the context of `llm` is not touched) and kept, then learnt from every
    text chunk that streamed loads compute (per position: see _PrefillSpeed); `force` measures
    again and forgets what was learnt. Returns the speed at the first position."""
    tps = _calibrate(llm, tokens, force, threading.Event())
    assert tps is not None  # (never stopped)
    return tps


def _calibrate(llm: llama_cpp.Llama, tokens: int, force: bool, stop: threading.Event) -> float | None:
    """calibrate(), given up between two llama_decode calls once `stop` is set: None, nothing kept."""
    key = _speed_key(llm)
    with _speeds_lock:
        if key in _speeds and not force:
            return _speeds[key].tps
    if stop.is_set():
        return None
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
        for p in range(0, tokens, _PIECE):  # one llama_decode per piece, as _compute calls it
            if stop.is_set():
                return None
            _decode_tokens(scratch.ctx, ids[p : min(tokens, p + _PIECE)], p, 0, params.n_batch)
        tps = tokens / (time.perf_counter() - start)
    finally:
        scratch.close()
    with _speeds_lock:
        _speeds[key] = _PrefillSpeed(tps, tokens)
    return tps


class _Calibration(threading.Thread):
    """_prefill_speed on its own thread (llama_decode releases the GIL), while the caller reads
    the manifest: on a slow link the first load's calibration costs it little or nothing. A
    manifest of a state stored whole needs no speed: stop() ends it after the llama_decode call
    under way (a busy CPU took 11 s over a whole load of 0.2 s)."""

    def __init__(self, llm: llama_cpp.Llama) -> None:
        super().__init__(name="llama-cachegen-calibrate", daemon=True)
        self.llm = llm
        self.speed: _PrefillSpeed | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.stopped = threading.Event()
        self.start()

    def run(self) -> None:
        start = time.perf_counter()
        try:
            self.speed = _prefill_speed(self.llm, self.stopped)
        except BaseException as exc:  # raised on the caller's thread by result()
            self.error = exc
        self.seconds = time.perf_counter() - start

    def stop(self) -> None:
        """Ends the calibration without waiting for it (the call's way out joins it)."""
        self.stopped.set()

    def result(self) -> _PrefillSpeed:
        self.join()
        if self.error is not None:
            raise self.error
        assert self.speed is not None
        return self.speed


def _prefill_speed(llm: llama_cpp.Llama, stop: threading.Event) -> _PrefillSpeed | None:
    """A copy of what this process knows of the prefill speed (calibrated if need be; None when
    stopped first)."""
    if _calibrate(llm, _CALIBRATION_TOKENS, False, stop) is None:
        return None
    with _speeds_lock:
        return copy.copy(_speeds[_speed_key(llm)])


def _learn_speed(key: tuple[str, int], b: int, e: int, seconds: float) -> None:
    with _speeds_lock:
        if key in _speeds:
            _speeds[key].learn(b, e, seconds)


# ---- the link: one fetch at a time on a daemon thread ---------------------------------------------


class _Job:
    """One chunk fetch on its own daemon thread (a fetch stuck on a dead link is left to finish or
    fail on its own; the load goes on without it). `on_done(job)` runs on that thread at the end."""

    def __init__(
        self,
        reader: chunks._ChunkReader,
        index: int,
        level: str,
        fetch: Callable[[], Any] | None = None,
        *,
        predicted_s: float = 0.0,
        on_done: Callable[[_Job], None] | None = None,
    ) -> None:
        self.index, self.level, self.predicted_s = index, level, predicted_s
        self._fetch = fetch or (lambda: reader.fetch(index, (level,)))
        self._on_done = on_done
        self.result: Any = None
        self.error: BaseException | None = None
        self.bytes = 0  # what the reader counted (a whole object read)
        self.unread = 0  # what a read that failed or was ended received: it took the link too
        self.uncounted = 0  # of those, in the loader's figures so far (_count_unread)
        self.abandoned = False
        self.sampled = False  # its rate taken by the loader (_sample), once
        self.done = threading.Event()
        self.start = time.perf_counter()
        self.end = 0.0
        self._reader = reader
        self.marks = [(self.start, 0)]  # (time, bytes received): the loader's view of its progress
        self.thread = threading.Thread(target=self._run, name=f"lcg-fetch-{index}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self._reader.count_this_thread()
        try:
            self.result = self._fetch()
        except BaseException as exc:  # noqa: BLE001 - handed to the loader's thread
            self.error = exc
        ident = threading.get_ident()  # its own: another fetch's may run beside it
        self.bytes = self._reader.bytes_of(ident)
        self.unread = max(0, (self._reader.store.received(ident) or 0) - self.bytes)
        self.end = time.perf_counter()
        self.done.set()
        if self._on_done is not None:
            self._on_done(self)

    @property
    def seconds(self) -> float:
        return (self.end if self.done.is_set() else time.perf_counter()) - self.start


# ---- the loader -----------------------------------------------------------------------------------


class _Failed(Exception):
    """A chunk could not be fetched or decoded twice: the rest is computed."""


class _Stopped(Exception):
    """A text chunk's computation was given up: its fetch arrived first."""


@dataclass
class _Plan:
    level: str  # of the chunk the link fetches next
    text: int  # how many of the undecided chunks, from the front, the CPU computes
    finish: float  # predicted perf_counter time of a loaded context
    cost: float  # token-weighted KL of the undecided chunks (text: 0)
    feasible: bool
    # when it ends with the link's part stretched by the spread's margin (_share): what ranks
    # plans that do not fit (by `finish`, a fetch that ends with the CPU's last chunk would be as
    # early as a smaller one, and win on KL while more at risk)
    at_risk: float
    # when the link's part ends, so stretched (no fetch: -inf): among plans that do not fit and
    # end alike (the CPU's part the later), the smaller fetch wins: the link done early races the
    # CPU's chunk, and a link slower than predicted still ends before the CPU
    link_risk: float


class _Loader:
    """Fills the state buffer chunk by chunk (module docstring). All decisions hold `cv`; fetch
    threads start the next fetch themselves when theirs ends, so the link never waits for the
    assembly thread (busy computing a text chunk)."""

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
        speed: _PrefillSpeed | None,
        speed_given: bool,
        kl_table: dict[str, float],
        oracle: Callable[[int], float] | None,
        progress: Callable[[ChunkRecord], None] | None,
        t0: float,
    ) -> None:
        self.llm, self.store, self.m, self.target = llm, store, m, target
        self.tokens = m.meta.tokens
        # the logits rows the final restore marks unknown (logits_all: 600 MB for Qwen2.5's
        # vocabulary at 1,000 tokens, an SLO's second where it was not counted)
        self.scores_fill = scores_fill_bytes(llm, target, int(self.tokens.size))
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
        self.both = self.adapt and text_ok  # the CPU computes from the front while the link fetches
        self.text_ok, self.speed, self.oracle, self.progress = text_ok, speed, oracle, progress
        self.kl = kl_table
        self.speed_given = speed_given  # not learnt from what this load computes
        self.prior_inv = None if prior_mbps is None else 8 / (prior_mbps * 1e6)  # seconds per byte
        self.t0 = t0
        n = len(self.ranges)
        self.records = [ChunkRecord(i, b, e) for i, (b, e) in enumerate(self.ranges)]
        self.plan: list[str | None] = [None] * n  # a level (fetched or being fetched), text, or undecided
        self.done = [False] * n  # in the buffer
        self.jobs: dict[int, _Job] = {}  # started, not yet taken by the assembly
        self.current: _Job | None = None  # the job holding the link (done or not)
        self.cv = threading.Condition()
        self.failures: list[str] = []
        self.fallback: str | None = None
        self.decode_s_per_byte: dict[str, float] = {}
        self.held = -1  # positions 0..held-1 of the buffer are what the context holds (-1: not ours)
        # a recurrent state is of the last position only: a prefix cannot be restored or cut back to
        self.recurrent = has_recurrent_state(llm)
        # set on the context while a fetch of the chunk computed (`computing`) that arrives may stop
        # the computation within llama_decode (between two nodes of its graph)
        self.abort_callback: Any = llama_cpp.ggml_abort_callback(self._fetch_arrived)
        self.interrupted: Callable[[], bool] = _never  # a Ctrl-C noted while llama.cpp computes
        self.backup: tuple[np.ndarray | None] | None = None
        self.speed_key = _speed_key(llm)
        self.state: np.ndarray | None = None
        self.skeleton = b""
        self.per_token = 0.0  # f16 state bytes per position
        self.size_rates: dict[str, float | None] = {}  # _bytes_per_token's, per level (None: no size given)
        self.skeleton_s = 0.0
        self.ewma_inv: float | None = None  # smoothed seconds per byte of the chunk fetches
        self.sum_bytes, self.sum_s = 0, 0.0  # every chunk fetch so far
        self.invs: list[float] = []  # each chunk fetch's seconds per byte
        self.first_inv: float | None = None  # the skeleton's seconds per byte, before any chunk
        self.cpu_free = 0.0  # when the assembly thread will be done with the text chunk it computes
        self.computing: int | None = None  # that chunk
        self.skeleton_job: _Job | None = None  # the skeleton's fetch, until the assembly takes it
        self.skeleton_tries = 0
        self.kept: set[int] = set()  # chunks whose upgrade or race failed: not fetched again
        self.damaged: dict[str, bytes] = {}  # chunk key -> SHA-256 of bytes that failed to decode
        self.recompute_failed = False  # a chunk could not be computed again: none is
        self.dropped_bytes = 0  # received by reads that failed or were ended (not in reader.bytes_read)
        self.ended: list[_Job] = []  # fetches given up in flight
        self.finished = False  # the buffer is complete: nothing more is fetched

    # -- estimates --

    def _size(self, i: int, level: str) -> float:
        size = self.m.chunks[i].sizes.get(level)
        if size is not None:
            return float(size)
        b, e = self.ranges[i]
        return self._bytes_per_token(level) * (e - b)

    def _bytes_per_token(self, level: str) -> float:
        """A chunk's size per token at `level` where the manifest does not say (stored by an
        earlier save): that of the chunks it gives sizes for, else a guess from the f16 state's.
        Kept per level once known (summed at every ask, a prefix-sharing load of 128 chunks spent
        4 ms per plan search here, 0.6 ms in all with sizes)."""
        if level not in self.size_rates:
            known = [
                (e.sizes[level], b1 - b0)
                for e, (b0, b1) in zip(self.m.chunks, self.ranges, strict=True)
                if e.sizes.get(level) is not None
            ]
            self.size_rates[level] = sum(s for s, _ in known) / sum(t for _, t in known) if known else None
        rate = self.size_rates[level]
        # none given (every chunk stored before): the f16 state's size is known once the skeleton is in
        return _GUESS_RATIO.get(level, 1.0) * self.per_token if rate is None else rate

    def _inv(self) -> float | None:
        """Seconds per byte the plans assume: the slower of the smoothed and the mean rate of the
        chunk fetches so far (a drop shows at once, a recovery only once it lasts), slower still
        when the fetch in flight is late and slower (_late_inv). Before any chunk: the prior, else
        the skeleton's fetch (a small object: latency makes it an underestimate of the rate)."""
        if self.sum_bytes:
            inv = max(self.ewma_inv or 0.0, self.sum_s / self.sum_bytes)
        elif self.prior_inv is not None:
            inv = self.prior_inv
        elif self.first_inv is not None:
            inv = self.first_inv
        else:
            return None
        late = self._late_inv(time.perf_counter())
        return inv if late is None else max(inv, late)

    def _late_inv(self, now: float) -> float | None:
        """Seconds per byte the chunk fetch in flight shows, once it is past its prediction
        (before, latency and the connection's ramp make a part of a fetch a poor sample): its
        recent rate (_shown_inv), else its time over its whole size (at least)."""
        job = self.current
        if job is None or job.index < 0 or job.done.is_set() or now - job.start <= job.predicted_s:
            return None
        shown = self._shown_inv(job, now)
        return shown if shown is not None else (now - job.start) / self._size(job.index, job.level)

    def _shown_inv(self, job: _Job, now: float) -> float | None:
        """Seconds per byte of a fetch over its last _RECENT_S, from the bytes the store says it
        has received (Store.received); None before it has run that long (its first bytes wait
        for the reply) or where the store cannot tell."""
        received = self.store.received(job.thread.ident or 0)
        if received is None:
            return None
        marks = job.marks
        marks.append((now, received))
        while len(marks) > 2 and marks[1][0] <= now - _RECENT_S:
            del marks[0]
        since, before = marks[0]
        if now - since < _RECENT_S:
            return None
        return (now - since) / max(1, received - before)

    def _estimated(self) -> bool:
        """Whether the link's time can be predicted: an oracle, or a rate (_inv)."""
        return self.oracle is not None or self._inv() is not None

    def _net_s(self, nbytes: float, inv: float | None = None) -> float:
        """Seconds the link takes for `nbytes`: the oracle's, else at `inv` seconds per byte (a
        caller's estimate, taken once for many plans), else at _inv's."""
        if self.oracle is not None:
            return self.oracle(int(nbytes))
        inv = self._inv() if inv is None else inv
        assert inv is not None
        return nbytes * inv

    def _mbps(self) -> float | None:
        if self.oracle is not None:
            probe = 1 << 20
            return probe * 8 / 1e6 / max(self.oracle(probe), 1e-9)
        inv = self._inv()
        return None if inv is None else 8 / inv / 1e6

    def _text_s(self, i: int) -> float:
        assert self.speed is not None
        return self.speed.seconds(*self.ranges[i])

    def _sample(self, job: _Job) -> None:
        """The link's rate learns a fetch that ended (once: by its thread's report or by the
        assembly freeing the link, whichever comes first)."""
        if job.sampled:
            return
        job.sampled = True
        if job.error is None and job.bytes:
            inv = job.seconds / job.bytes
            old = inv if self.ewma_inv is None else self.ewma_inv
            self.ewma_inv = (1 - _SMOOTHING) * old + _SMOOTHING * inv
            self.sum_bytes += job.bytes
            self.sum_s += job.seconds
            self.invs.append(inv)

    def _link_end(self, now: float) -> float:
        """When the fetch in flight is expected to end (now when the link is free); a late one
        ends its bytes left at the rate it shows (_shown_inv), or where that is not known (yet),
        is as late again."""
        job = self.current
        if job is None or job.done.is_set():
            return now
        end = job.start + job.predicted_s
        if end > now:
            return end
        inv = self._shown_inv(job, now) if job.index >= 0 else None
        if inv is None:
            return now + (now - end)
        received = job.marks[-1][1]
        left = max(0.0, self._size(job.index, job.level) - received)  # its statistics may follow
        return now + left * inv

    def _share(self) -> float:
        """The share of the time left a plan may take (oracle: _SLO_SHARE)."""
        if self.oracle is not None:
            return _SLO_SHARE
        spread = _PRIOR_SPREAD
        if len(self.invs) >= 2:
            spread = float(np.std(self.invs) / np.mean(self.invs))
        return _SLO_SHARE / (1.0 + _SPREAD_Z * spread)

    def _decode_s(self, level: str, nbytes: float) -> float:
        return self.decode_s_per_byte.get(level, 0.0) * nbytes

    # -- the plan --

    def _undecided(self) -> list[int]:
        return [k for k, p in enumerate(self.plan) if p is None]

    def _latest(self) -> float:
        """When the buffer must be complete at the latest: the SLO less its last _SLO_FLOOR and
        the final restore."""
        assert self.slo_s is not None
        restore_s = ((0 if self.state is None else len(self.state)) + self.scores_fill) / _RESTORE_BPS
        return self.t0 + (1 - _SLO_FLOOR) * self.slo_s - restore_s

    def _deadline(self, now: float) -> float:
        """When a plan's chunks must all be in the buffer: a share of the time left, never past
        _latest."""
        latest = self._latest()
        return min(now + self._share() * (latest - now), latest)

    def _best(self, undecided: list[int], now: float, fetch: bool = False) -> _Plan | None:
        """The plan for the undecided chunks (the link fetching from the back, the CPU computing
        from the front) with the lowest KL that finishes within the share of the time left; among
        those, the one finishing first. None fits: the one finishing first. The fetched chunks
        take one level, or two adjacent ones: the better for as many of the latest chunks as fit
        (recent tokens weigh most in the model's next steps), so that a budget between two
        levels is spent rather than dropping every chunk to the lower one. `fetch`: a plan that
        fetches at least one chunk."""
        if not undecided or not self._estimated():
            return None
        deadline = self._deadline(now)
        stretch = 1.0 / self._share()  # the link's margin, for at_risk
        m = len(undecided)
        cpu_free = max(now, self.cpu_free) + sum(
            self._decode_s(j.level, self._size(j.index, j.level)) for j in self.jobs.values()
        )
        link_free = self._link_end(now)
        cpu, computed = [0.0], [0.0]  # prefix sums over the first x chunks: seconds, cost as text
        for k in undecided if self.both else ():
            cpu.append(cpu[-1] + self._text_s(k))
            computed.append(computed[-1] + self._text_kl(k) * (self.ranges[k][1] - self.ranges[k][0]))
        levels = self.levels[undecided[-1]]
        size = {lv: [self._size(k, lv) for k in undecided] for lv in levels}
        tail = {lv: _suffix_sums(size[lv]) for lv in levels}  # tail[lv][x]: chunks x.. at lv
        tail_tokens = _suffix_sums([self.ranges[k][1] - self.ranges[k][0] for k in undecided])
        # one estimate of the link for every plan below: asked per plan (256 chunks: 93,000 asks
        # in a load), it read the fetch in flight's progress from the store each time
        inv = self._inv() if self.oracle is None else None

        def plan(x: int, better: str, worse: str, n: int) -> _Plan:
            """The first x chunks computed, the last n at `better`, the others fetched at `worse`."""
            f = m - x
            if f == 0:
                finish = cpu_free + cpu[x]
                return _Plan(worse, x, finish, computed[x], finish <= deadline, finish, -math.inf)
            nbytes = tail[worse][x] + tail[better][m - n] - tail[worse][m - n]
            decode = self._decode_s(worse, tail[worse][x] - tail[worse][m - n]) + self._decode_s(
                better, tail[better][m - n]
            )
            last = better if n == f else worse  # the front chunk of those fetched
            link = link_free + self._net_s(nbytes, inv) + self._decode_s(last, size[last][x])
            finish = max(cpu_free + cpu[x] + decode, link)
            link_risk = now + (link - now) * stretch
            at_risk = max(cpu_free + cpu[x] + decode, link_risk)
            cost = computed[x] + self.kl.get(worse, math.inf) * (tail_tokens[x] - tail_tokens[m - n])
            cost += self.kl.get(better, math.inf) * tail_tokens[m - n]
            following = better if (n > 0 if self.both else n == f) else worse  # the next fetch's
            return _Plan(following, x, finish, cost, finish <= deadline, at_risk, link_risk)

        pairs = list(zip(levels, levels[1:], strict=False)) or [(levels[0], levels[0])]
        candidates: list[_Plan] = []
        for x in range(m + (not fetch)) if self.both else range(1):
            for better, worse in pairs:
                candidates.append(plan(x, better, worse, 0))
                lo, hi = 0, m - x  # the most chunks at `better` that still fit: finish grows with n
                if candidates[-1].feasible:
                    while lo < hi:
                        mid = (lo + hi + 1) // 2
                        lo, hi = (mid, hi) if plan(x, better, worse, mid).feasible else (lo, mid - 1)
                    candidates.append(plan(x, better, worse, lo))
        return _pick(candidates) if candidates else None

    def _choose(self, j: int, now: float) -> tuple[str, str] | None:
        """(level, reason) for the fetch of chunk j; None: the CPU computes every undecided chunk."""
        levels = self.levels[j]
        if not self.adapt:
            return levels[0], "fixed" if self.level else "best"
        if not self.sum_bytes and self.prior_inv is None and self.oracle is None:
            # Nothing measured but the skeleton's fetch, one sample of a rate that may vary by
            # orders of magnitude: the smallest level, fetched again better when time is left.
            return levels[-1], "first"
        plan = self._best(self._undecided(), now)
        assert plan is not None  # j is undecided, and the link has an estimate
        if plan.text == len(self._undecided()):
            # the CPU alone would do: fetch the last chunk anyway, at the level that serves best
            # if it arrives first (a free link also measures itself)
            plan = self._best(self._undecided(), now, fetch=True)
            assert plan is not None
        if not plan.feasible:
            reason = "fastest"
        else:
            level = self._capped(j, plan, now)
            return level, "best" if level == levels[0] else "budget"
        return plan.level, reason

    # -- the link --

    def _feed(self) -> None:
        """Starts the next fetch if the link is free (holds cv): the front's chunk in order (up to
        _LOOKAHEAD ahead of the assembly), or with the CPU computing from the front, the last;
        with nothing left to decide, the chunk the CPU computes when a fetch of it serves better."""
        if self.state is None or self.finished or self.fallback is not None or self._failed_untaken():
            return
        if self._link_busy() and not (self.adapt and self._abort_late(time.perf_counter())):
            return
        undecided = self._undecided()
        if not undecided:
            now = time.perf_counter()
            if self.both:
                self._race_computing(now)
            if self.adapt and self.current is None:
                self._upgrade(now)
            return
        if self.both:
            j = undecided[-1]
        else:
            j = undecided[0]
            front = self._front()
            front = len(self.done) if front is None else front
            if j > front + _LOOKAHEAD:
                return
        now = time.perf_counter()
        choice = self._choose(j, now)
        if choice is None:
            return
        level, reason = choice
        self.plan[j] = level
        rec = self.records[j]
        rec.level, rec.reason, rec.mbps = level, reason, self._mbps()
        self._start(j, level, now)

    def _failed_untaken(self) -> list[_Job]:
        """Fetches of chunks not in the buffer that failed and that the assembly has not taken:
        it decides first whether each chunk is fetched again (_take), and the link waits for that.
        Told by the job itself, not by its thread's report (_fetched): the assembly may see a job
        end before that report."""
        jobs = self.jobs.values()
        return [j for j in jobs if j.done.is_set() and j.error is not None and not self.done[j.index]]

    def _race_computing(self, now: float) -> None:
        """The link, free with every chunk decided, fetches the chunk the CPU is computing when
        that plan is better (_better: within the deadline, the lower KL, the earlier) than the
        CPU's: a text chunk begun on a rate that turned out too slow; where the CPU will miss the
        deadline, also when the latest fetch's rate would bring the smallest level first. The CPU
        stops at its next piece if the fetch arrives first."""
        i = self.computing
        if i is None or i in self.jobs or self.done[i] or i in self.kept or not self._estimated():
            return
        deadline = self._deadline(now)
        stretch = 1.0 / self._share()
        tokens = self.ranges[i][1] - self.ranges[i][0]
        plans = [
            _Plan(
                TEXT,
                1,
                self.cpu_free,
                self._text_kl(i) * tokens,
                self.cpu_free <= deadline,
                self.cpu_free,
                self.cpu_free,  # (no fetch, but racing one is free: ranked by its own end)
            )
        ]
        for level in self.levels[i]:
            size = self._size(i, level)
            finish = now + self._net_s(size) + self._decode_s(level, size)
            at_risk = now + (finish - now) * stretch
            cost = self.kl.get(level, math.inf) * tokens
            plans.append(_Plan(level, 0, finish, cost, finish <= deadline, at_risk, at_risk))
        best = _pick(plans)
        if best.level == TEXT and not best.feasible and self.oracle is None and self.invs:
            # The CPU will be late and the link is idle: a bet on the latest fetch's rate (a link
            # that has recovered shows there first) costs nothing if it loses.
            level = self.levels[i][-1]
            size = self._size(i, level)
            if now + size * self.invs[-1] + self._decode_s(level, size) < self.cpu_free:
                self._start(i, level, now)
                return
        if best.level != TEXT:
            self._start(i, best.level, now)

    def _abort_late(self, now: float) -> bool:
        """Gives up the chunk fetch in flight (True: the link is free) when it is so late that no
        plan waiting for it meets the deadline and one without it does, or when none does, one
        without it ends clearly earlier (_GIVE_UP_GAIN): the chunk is planned again with the
        others. Only where the store can end the read (Store.cancel)."""
        shown = self._late_inv(now)
        job = self.current
        if shown is None or job is None:  # nothing in flight, or not late
            return False
        j = job.index
        # a race against the CPU (begun by the link, or by the CPU), or an upgrade
        if self.plan[j] != job.level or j == self.computing or self.done[j]:
            return False
        size = self._size(j, job.level)
        arrival = self._link_end(now) + self._decode_s(job.level, size)
        wait = self._best(self._undecided(), now)
        if arrival <= self._deadline(now) and (wait is None or wait.feasible):
            return False
        # without it, the link is planned at no more than the rate this fetch has shown
        saved = self.plan[j], self.current, self.ewma_inv
        self.plan[j], self.current = None, None
        self.ewma_inv = max(self.ewma_inv or 0.0, shown)
        free = self._best(self._undecided(), now)
        finish = max(arrival, wait.finish if wait is not None else arrival)
        better = free is not None and (free.feasible or free.finish < finish - _GIVE_UP_GAIN * (finish - now))
        # (not one that arrived whole while this planned: a verified chunk is not thrown away)
        if not better or not self.store.cancel(job.thread.ident or 0) or self._arrived(j):
            self.plan[j], self.current, self.ewma_inv = saved
            return False
        del self.jobs[j]
        rec = self.records[j]
        rec.fetch_ms += job.seconds * 1e3
        rec.given_up += 1
        self._abandon(job)
        return True

    def _abandon(self, job: _Job) -> None:
        """A fetch the load no longer wants, ended if in flight (the link is free, and a body that
        would complete is not read for nothing). Only in flight: its thread lives while cv is
        held, and an ended thread's id may already be a new fetch's (Python reuses them at once)."""
        job.abandoned = True
        if job.done.is_set():
            return  # counted by its thread (_fetched)
        self.store.cancel(job.thread.ident or 0)
        self.ended.append(job)
        self._recount(job)

    def _recount(self, job: _Job) -> None:
        """(holds cv) What a fetch given up in flight has received that the reader did not count:
        counted at once (its thread may end after the report), and again later (bytes_received),
        for a body received whole may be counted by the reader meanwhile; final once its thread
        has ended the read (_Job.unread)."""
        if job.done.is_set():
            self._count_unread(job, job.unread)
            return
        ident = job.thread.ident or 0  # lives: not done
        received = self.store.received(ident) or 0  # first: a count in between shows in both
        self._count_unread(job, max(0, received - self.reader.bytes_of(ident)))

    def bytes_received(self) -> int:
        """Bytes the load's fetches received: what the reader counted and what reads that failed
        or were ended received."""
        with self.cv:
            for job in self.ended:
                self._recount(job)
            return self.reader.bytes_read + self.dropped_bytes

    def _count_unread(self, job: _Job, unread: int) -> None:
        """(holds cv) `unread`, the latest figure of what a fetch received that the reader did not
        count, in its chunk's record and the report, replacing the one counted before: those
        bytes took the link."""
        delta, job.uncounted = unread - job.uncounted, unread
        self.dropped_bytes += delta
        if job.index >= 0:
            self.records[job.index].bytes += delta

    def _upgrade(self, now: float) -> None:
        """The link, free with every chunk decided and no race to run, fetches a chunk that is in
        the buffer again at a better level (_best_upgrade). Time the SLO leaves is spent on quality
        but never past it, nor at a risk: the load waits for an upgrade until _latest, then drops
        it."""
        best = self._best_upgrade(now)
        if best is not None:
            self._start(best[1], best[2], now)

    def _best_upgrade(self, now: float, *, coming: bool = False) -> tuple[float, int, str] | None:
        """(KL gained per byte, chunk, level): the chunk in the buffer (`coming`: or on its way
        there) whose fetch at a better level gains the most KL per byte and is due by _latest
        (the latest chunk among equals); none being fetched again, nor one that the CPU computes
        or will compute again."""
        if not self.adapt or not self._estimated():  # (a load without an SLO upgrades nothing)
            return None
        latest, link_free = self._latest(), self._link_end(now)  # (a fetch given up may hold the link)
        best: tuple[float, int, str] | None = None
        cpu = {*self._recomputable(now), self.computing}
        for i, current in enumerate(self.plan):
            there = self.done[i] and i not in self.jobs
            if (
                current in (None, TEXT)
                or not (there or coming and not self.done[i])
                or i in self.kept
                or i in cpu
            ):
                continue
            tokens = self.ranges[i][1] - self.ranges[i][0]
            for level in self.levels[i][: self.levels[i].index(current)]:
                size = self._size(i, level)
                gain = (self.kl.get(current, math.inf) - self.kl.get(level, math.inf)) * tokens / size
                if not gain > 0 or (best is not None and (gain, i) <= best[:2]):
                    continue
                if link_free + self._net_s(size) + self._decode_s(level, size) <= latest:
                    best = (gain, i, level)
        return best

    def _upgrade_waits(self, now: float) -> bool:
        """Whether a fetch the load gave up (a race the CPU won) holds the link while an upgrade
        is due by _latest after it: the load waits for the link rather than end with the time
        the SLO leaves unspent (Gemma 3 270M, SLO 20 s: a load ended at 1.9 s with its last chunk
        at the `compact` of its first fetch)."""
        job = self.current
        if job is None or not job.abandoned or job.done.is_set():
            return False
        return self._best_upgrade(now) is not None

    def _capped(self, j: int, plan: _Plan, now: float) -> str:
        """The plan's level for a fetch of chunk j, lowered while the step from the next lower
        level gains less KL per extra byte than the best upgrade of a chunk in the buffer
        (_best_upgrade), unless that upgrade fits after the plan: a compact chunk fetched on a slow
        start is worth fetching again at balanced before a new chunk is worth high, and the
        estimates that made the plan feasible may not last; on a link with time to spare, the new
        chunks come at the plan's level and the upgrade after them."""
        level = plan.level
        up = self._best_upgrade(now, coming=True)
        if up is None:
            return level
        size = self._size(up[1], up[2])
        if plan.finish + self._net_s(size) + self._decode_s(up[2], size) <= self._deadline(now):
            return level
        levels, tokens = self.levels[j], self.ranges[j][1] - self.ranges[j][0]
        k = levels.index(level)
        while k + 1 < len(levels):
            extra = self._size(j, levels[k]) - self._size(j, levels[k + 1])
            gain = (self.kl.get(levels[k + 1], math.inf) - self.kl.get(levels[k], math.inf)) * tokens
            if extra <= 0 or not gain < up[0] * extra:  # (an unknown level's KL: no step)
                break
            k += 1
        return levels[k]

    def _recomputable(self, now: float) -> list[int]:
        """The lossy chunks the CPU, free or once done with the chunk it computes, can compute
        again by _latest (exact K/V, as text; with the read-back that splices each into the
        buffer): from the first chunk that is not exact on, each with every chunk before it
        exact, none whose fetch (an upgrade) is in flight, and only once every chunk is in the
        buffer (but the one the CPU computes, and one arrived, taken next: else a link freed while
        the CPU computes, with an arrived chunk not yet decoded, took the CPU's next chunk for an
        upgrade), and none the link would bring at its best level sooner (the link upgrading from
        the last chunk back, the CPU from the first on: they meet where their speeds put them, not
        wherever the CPU could still end by _latest). A model with a recurrent state, whose
        context cannot be restored for a prefix, only where the context holds the chunks before
        them."""
        busy = self.computing
        if not (
            self.adapt and self.both and self.speed and self.state is not None and not self.recompute_failed
        ):
            return []
        if not all(d or i == busy or self._arrived(i) for i, d in enumerate(self.done)):
            return []
        k = next((i for i, lv in enumerate(self.plan) if lv not in (TEXT, "lossless") and i != busy), None)
        held = self.held if busy is None else self.ranges[busy][1]
        if k is None or (self.recurrent and held != self.ranges[k][0]):
            return []
        n = len(self.plan)
        link = [math.inf] * (n + 1)  # link[i]: when the link would have chunks i.. at their best
        if self._estimated():
            link[n] = self._link_end(now)
            for i in range(n - 1, k - 1, -1):
                size = 0.0 if self._at_best(i) or i in self.jobs else self._size(i, self.levels[i][0])
                link[i] = link[i + 1] + (
                    self._net_s(size) + self._decode_s(self.levels[i][0], size) if size else 0.0
                )
        t, latest, out = max(now, self.cpu_free), self._latest(), []
        for i in range(k, n):
            t += self._text_s(i) + self._readback_s(i)
            if i in self.jobs or self._at_best(i) or t > latest or t > link[i]:
                break
            out.append(i)
        return out

    def _text_kl(self, i: int) -> float:
        """What plans count for chunk i computed as text: the KL of the best level stored for it.
        Text is exact, but it is the fallback for a link too slow (issue 10), not a level above
        the best stored: counted as exact, every plan with time to spare recomputed chunks that
        one fetch brings (a 30 s SLO on a fast link computed all 700 tokens of Gemma 3 270M, 2.6 s,
        where fetching them at high took 0.12 s). A plan computes a chunk where that is faster."""
        return self.kl.get(self.levels[i][0], math.inf)

    def _at_best(self, i: int) -> bool:
        """Whether chunk i is fetched at a level as good as the best stored for it (lossless
        always): computing it again gains nothing a plan counts."""
        return self.plan[i] not in (None, TEXT) and self.kl.get(self.plan[i], math.inf) <= self._text_kl(i)

    def _readback_s(self, i: int) -> float:
        """Reading the context's state back to splice chunk i computed into the buffer."""
        return self.ranges[i][1] * self.per_token / _RESTORE_BPS

    def _link_busy(self) -> bool:
        job = self.current
        if job is None or not job.done.is_set():
            return job is not None
        # a chunk's fetch counts before the next choice: given up, it finished after all; or the
        # assembly took it before its thread's report (_fetched), which would plan on no rate
        if job.index >= 0:  # (the skeleton's is not taken for the link's rate: _choose)
            self._sample(job)
        self.current = None
        return False

    def _start(self, j: int, level: str, now: float) -> None:
        predicted = self._net_s(self._size(j, level)) if self._estimated() else 0.0
        job = _Job(self.reader, j, level, predicted_s=predicted, on_done=self._fetched)
        self.jobs[j] = job
        self.current = job

    def _fetched(self, job: _Job) -> None:
        """On the fetch thread: measure, start the next fetch, wake the assembly."""
        with self.cv:
            self._count_unread(job, job.unread)  # (final: its read has ended)
            if not job.abandoned:
                self._sample(job)
                if job.error is not None and self.done[job.index]:  # an upgrade: the chunk stays
                    self._upgrade_failed(job)
                    self._feed()
                elif job.error is None:
                    self._feed()  # (a failure waits for the assembly: _failed_untaken)
            self.cv.notify_all()

    # -- the assembly --

    def _next_action(self, now: float) -> tuple[str, Any] | None:
        """What the assembly thread does next (holds cv): build the buffer from the skeleton that
        arrived, take a fetched chunk, compute a chunk, compute one whose fetch is in flight (a
        race), or None: wait."""
        skeleton = self.skeleton_job
        if skeleton is not None and skeleton.done.is_set():
            return "skeleton", skeleton
        arrived = [j for j in self.jobs.values() if j.done.is_set()]
        if arrived:
            return "take", min(arrived, key=lambda j: j.index)
        front = self._front()
        if front is None:
            again = self._recomputable(now)
            if not again:
                return None
            self.computing = again[0]  # from now on, not chosen for an upgrade by the link
            return "recompute", again[0]
        if self.plan[front] == TEXT:
            return "compute", None
        if not self.both:
            return None
        if self.state is None:
            # The skeleton is late (longer than a piece's compute): the link is too slow for a
            # chunk to arrive before the CPU has computed it.
            assert skeleton is not None
            if skeleton.seconds > self._piece_s(*self.ranges[front]) and self.plan[front] is None:
                self._claim(front, "parallel")
                return "compute", None
            return None
        # Past _latest nothing waits for the link (whose estimates have failed): the CPU computes
        # the front chunk, racing its fetch if one is in flight.
        overdue = now >= self._latest()
        if self.plan[front] is None:
            plan = None if overdue else self._best(self._undecided(), now)
            if overdue or plan is not None and plan.text >= 1:
                self._claim(front, "late" if overdue else "parallel")
                return "compute", None
            return None
        job = self.jobs.get(front)
        if job is None:
            return None
        if overdue:
            return "race", job
        # The CPU idle behind the front chunk's fetch, holding every chunk before it (nothing to
        # restore first): it computes the chunk meanwhile and stops when the fetch arrives (abort
        # callback), so a fetch that turns out slower than predicted costs no idle time.
        if self.held == self.ranges[front][0] and not self.recurrent:
            return "race", job
        if self._undecided():
            return None
        # the last chunk left is in flight: compute it unless it is due within one piece's time
        if self._link_end(now) - now > self._piece_s(*self.ranges[front]):
            return "race", job
        return None

    def _front(self) -> int | None:
        """The first chunk not in the buffer (None: every one is)."""
        return next((k for k, d in enumerate(self.done) if not d), None)

    def _piece_s(self, p: int, e: int) -> float:
        """Seconds to compute the piece of a text chunk ending at e that starts at position p."""
        return 1.0 if self.speed is None else self.speed.seconds(p, min(e, p + _PIECE))

    def _claim(self, i: int, reason: str) -> None:
        self.plan[i] = TEXT
        rec = self.records[i]
        rec.level, rec.reason, rec.mbps = TEXT, reason, self._mbps()

    def _wait_s(self, now: float) -> float:
        """How long to wait for the link before planning again: until the fetch in flight is due,
        at least _TICK_S, at most a piece's compute time; before the skeleton arrives, at most
        until it turns late (when the CPU starts: _next_action)."""
        due = self._link_end(now) - now
        wait = min(max(due, _TICK_S), self._piece_s(0, _PIECE) if self.both else 1.0)
        skeleton = self.skeleton_job
        if self.both and self.state is None and skeleton is not None and not skeleton.done.is_set():
            front = self._front()
            late_at = None if front is None else skeleton.start + self._piece_s(*self.ranges[front])
            if late_at is not None and late_at > now:
                wait = min(wait, late_at - now + 1e-3)
        return wait

    def _fill(self) -> None:
        """Chunks into the buffer until every one is there."""
        while True:
            with self.cv:
                self._feed()
                complete = all(self.done)
                now = time.perf_counter()
                idle = not self.jobs and not self._recomputable(now) and not self._upgrade_waits(now)
                if complete and (not self.adapt or now >= self._latest() or idle):
                    return  # an upgrade still out when time is up is dropped
                action = self._next_action(now)
                if action is None and complete:
                    self.cv.wait(max(0.0, min(self._wait_s(now), self._latest() - now)))
                    continue
                if action is None:
                    if self.current is None and not self.jobs:
                        # Nothing in flight: no fetch will wake this thread, and waiting changes
                        # nothing but the clock. The front chunk is computed instead.
                        if not self.text_ok:
                            raise CacheGenError("the stream has nothing to fetch and may not compute text")
                        front = self._front()
                        assert front is not None  # not complete
                        self._claim(front, "stalled")
                        continue
                    self.cv.wait(self._wait_s(now))
                    continue
                kind, job = action
            if kind == "skeleton":
                self._take_skeleton(job)
                continue
            if kind == "take":
                self._take(job)
                continue
            if kind == "recompute":
                self._recompute(job)
                continue
            i = job.index if kind == "race" else self._front()
            assert i is not None  # a chunk to compute (_next_action)
            try:
                self._compute(i)
            except _Stopped:
                continue  # its fetch arrived: taken next round
            with self.cv:
                job = self.jobs.get(i)
                if job is not None:
                    self._race_won(job)
                self.done[i] = True
            self._report(i)

    def _race_won(self, job: _Job) -> None:
        """(holds cv) The CPU computes the chunk of a fetch in flight, or one that failed: the
        fetch goes and frees the link, the chunk is text. A failed one is reported, and the chunk
        is not raced again (_race_computing)."""
        i, rec = job.index, self.records[job.index]
        self.jobs.pop(i, None)
        if job.done.is_set() and job.error is not None:
            self._fail(i, job.level, job.error, "could not be fetched")
            self.kept.add(i)
        self._abandon(job)
        rec.bytes += job.bytes  # (0 unless it arrived whole: it took the link all the same)
        rec.fetch_ms += job.seconds * 1e3
        self._claim(i, "raced")

    def _report(self, i: int) -> None:
        if self.progress is not None:
            self.progress(self.records[i])

    def _take(self, job: _Job) -> None:
        """A finished fetch into the buffer; a failure is fetched once more, a second one makes
        the rest text (_Failed)."""
        i, rec = job.index, self.records[job.index]
        assert self.state is not None
        if self.done[i]:
            self._take_upgrade(job)
            return
        with self.cv:
            self.jobs.pop(i, None)
        rec.bytes += job.bytes
        rec.fetch_ms += job.seconds * 1e3
        rec.fetch_at_ms = (job.start - self.t0) * 1e3
        error = job.error
        if error is None:
            rec.decode_at_ms = (time.perf_counter() - self.t0) * 1e3
            error, seconds = self._decode(job)
            rec.decode_ms = seconds * 1e3
            if error is None:
                with self.cv:
                    self.done[i] = True
                self._report(i)
                return
            if isinstance(error, CorruptDataError) and self._damaged_twice(job):
                note = "damaged where it is stored (the same bytes twice): removed"
                error = chunks.ChunkMissingError(f"{error} ({note})", i)
            self._fail(i, job.level, error, "did not decode")
        else:
            self._fail(i, job.level, error, "could not be fetched")
        with self.cv:
            others = tuple(lv for lv in self.levels[i] if lv != job.level)
            if isinstance(error, chunks.ChunkMissingError) and others:
                # that level is gone (evicted, or removed as damaged): the chunk is planned again
                # among the levels left, as a load without streaming takes the next one stored
                self.levels[i] = others
                self.plan[i] = None
                self._feed()
                return
            if isinstance(error, (CacheGenError, OSError)) and not rec.retries:
                # planned again, fetched once the link is free: a chunk that did not decode
                # arrived whole, and the next chunk's fetch may have started since
                rec.retries += 1
                self.plan[i] = None
                self._feed()
                return
            if not self.text_ok:
                raise error
            self.fallback = f"{self.failures[-1]}; chunks from {i} on not in the buffer computed from text"
            for k in [k for k, d in enumerate(self.done) if not d]:
                stale = self.jobs.get(k)
                if k == self.computing:
                    # computed for its own reason; a race it runs is won, unless its fetch has
                    # arrived whole (the next piece stops for it)
                    if stale is not None and not self._arrived(k):
                        self._race_won(stale)
                    continue
                self._claim(k, "failed")
                if stale is not None:
                    del self.jobs[k]
                    self._abandon(stale)

    def _take_upgrade(self, job: _Job) -> None:
        """A chunk fetched again at a better level (_upgrade) over the one in the buffer. A decode
        that fails may have written part of the chunk's rows: the chunk is computed instead."""
        i, rec = job.index, self.records[job.index]
        with self.cv:
            if job.error is not None:  # taken before its thread could report it (_fetched)
                self._upgrade_failed(job)
                return
            if self.jobs.get(i) is not job:
                return
            del self.jobs[i]
            rec.bytes += job.bytes  # they took the link, used or not
            rec.fetch_ms += job.seconds * 1e3
            if self.plan[i] == TEXT:  # computed again meanwhile (a race with _recompute): exact
                return
            self.plan[i] = job.level  # not chosen again for an upgrade while it decodes
        error, seconds = self._decode(job)
        rec.decode_ms += seconds * 1e3
        if error is not None:
            self._fail(i, job.level, error, "did not decode (upgrade)")
            if not self.text_ok:
                raise error
            with self.cv:
                self.done[i] = False
                self._claim(i, "failed")
            return
        with self.cv:
            rec.upgraded_from, rec.level = rec.upgraded_from or rec.level, job.level

    def _decode(self, job: _Job) -> tuple[CacheGenError | None, float]:
        """A fetched chunk decoded into its place in the buffer: (the error, if it failed; the
        seconds it took). A success measures the level's decode speed."""
        assert self.state is not None
        start = time.perf_counter()
        try:
            codec.decode_chunk(job.result.chunk, job.result.stats, self.state, threads=self.threads)
        except CacheGenError as exc:
            return exc, time.perf_counter() - start
        seconds = time.perf_counter() - start
        with self.cv:
            self.decode_s_per_byte[job.level] = seconds / max(1, len(job.result.chunk))
        return None, seconds

    def _damaged_twice(self, job: _Job) -> bool:
        """Whether the chunk that failed to decode came as the same bytes as a failed fetch of it
        before (then deleted from the store). Damage on the way does not repeat byte for byte;
        damage where it is stored fails every load, and a save skips an object that exists. The
        retry is the second read: reading the object again at once, as a plain load does, would
        hold the link and the assembly in the middle of a stream."""
        key = chunks._chunk_key(job.result.meta.key, job.level)
        digest = hashlib.sha256(job.result.chunk).digest()
        if self.damaged.get(key) != digest:
            self.damaged[key] = digest
            return False
        with contextlib.suppress(CacheGenError):  # gone meanwhile, or this reader may not delete
            self.store.delete(key)
        return True

    def _upgrade_failed(self, job: _Job) -> None:
        """An upgrade that could not be fetched (holds cv): the chunk stays as it is, for good."""
        if self.jobs.get(job.index) is job:
            del self.jobs[job.index]
            self.kept.add(job.index)
            assert job.error is not None
            self._fail(job.index, job.level, job.error, "could not be fetched again (upgrade)")

    def _fail(self, i: int, level: str, exc: BaseException, what: str) -> None:
        self.failures.append(f"chunk {i} ({level}) {what}: {type(exc).__name__}: {exc}")

    def _recompute(self, i: int) -> None:
        """A lossy chunk in the buffer computed again (exact; _recomputable): the CPU would be idle
        until the SLO's end. Stopped at _latest, the chunk stays as it was."""
        rec = self.records[i]
        try:
            self._compute(i, until=self._latest())
        except _Stopped:
            return
        except CacheGenError as exc:  # optional work: the chunk stays, no more of it
            with self.cv:
                self._fail(i, rec.level, exc, "could not be computed again")
                self.recompute_failed = True
                self.held, self.computing = -1, None
            return
        with self.cv:
            rec.upgraded_from, rec.level = rec.upgraded_from or rec.level, TEXT
            self.plan[i] = TEXT
            job = self.jobs.pop(i, None)  # an upgrade begun before the recompute: not needed
            if job is not None:
                self._abandon(job)

    def _compute(self, i: int, until: float | None = None) -> None:
        """Chunk i computed by llama.cpp on top of chunks 0..i-1 (what the context holds, else
        restored from the buffer; for a model with a recurrent state, computed again from the
        first token), in pieces of _PIECE tokens, and spliced into the buffer (once there is one:
        before the skeleton arrives, the context keeps the chunks computed so far).
        Given up (_Stopped) as soon as a fetch of the chunk has arrived (not with `until`: a chunk
        computed again ignores its fetches), within a piece through llama.cpp's abort callback
        (a recurrent state cannot be cut back: between shorter pieces), or when the next piece and
        the read-back would end after `until`; between pieces, a skeleton that arrived becomes the
        buffer and the link is fed."""
        rec = self.records[i]
        b, e = rec.begin, rec.end
        start = time.perf_counter()
        if rec.decode_at_ms is None:
            rec.decode_at_ms = (start - self.t0) * 1e3
        if self.backup is None:
            self.backup = (self._capture(),)
        memory = llama_cpp.llama_get_memory(self.llm.ctx)
        seq = 0 if self.target is None else self.target
        first = b  # the first position computed
        if self.held != b:
            if b == 0 or self.recurrent:
                forget_kv(self.llm, self.target)
                first = 0
            else:
                assert self.state is not None  # without a buffer, the context holds chunks 0..i-1
                before = codec.skeleton_state(self.skeleton, b, alloc=codec.empty_buffer)
                codec.splice(before, self.state, 0, b)
                if not restore_state(self.llm, before, self.target):
                    raise ModelMismatchError("llama.cpp refused the state of the chunks before a text chunk")
            self.held = first
        llama_cpp.llama_memory_seq_rm(memory, seq, first, -1)
        with self.cv:
            self.computing = i
        abortable = until is None and not self.recurrent
        if abortable:
            llama_cpp.llama_set_abort_callback(self.llm.ctx, self.abort_callback, None)
        try:
            p = first
            while p < e:
                with self.cv:
                    if self.speed:
                        self.cpu_free = time.perf_counter() + self.speed.seconds(p, e)
                    job = self.jobs.get(i)
                    arrived = until is None and self._fetch_arrived(None)  # a fetch of `computing` (i)
                    end = time.perf_counter() + self._piece_s(p, e) + self._readback_s(i)
                    late = until is not None and end > until
                    if arrived or late:
                        if arrived:
                            self.plan[i] = job.level
                            rec.level, rec.reason = job.level, "raced"
                        if self.recurrent:  # not cut back (llama.cpp cannot): it holds 0..p-1
                            self.held = p
                        else:
                            llama_cpp.llama_memory_seq_rm(memory, seq, b, -1)
                            self.held = b
                        raise _Stopped
                    skeleton = self.skeleton_job
                    for failed in self._failed_untaken():
                        # (no decode: the link need not wait for this chunk, nor for this one's
                        # own fetch, which the CPU is beating anyway)
                        if failed.index != i:
                            self._take(failed)
                        else:
                            self._race_won(failed)
                    self._feed()
                    racing = self.jobs.get(i)
                    # a recurrent model, with a fetch of this chunk in flight: shorter pieces, to
                    # stop soon after it arrives (its recomputation before the chunk keeps _PIECE)
                    idle = racing is None or racing.done.is_set() or p < b
                    piece = _PIECE if idle or abortable else _RACE_PIECE
                if skeleton is not None and skeleton.done.is_set():
                    self._take_skeleton(skeleton)
                q = min(e, p + piece)
                self.held = -1
                piece_start = time.perf_counter()
                with self._stoppable() if abortable else contextlib.nullcontext():
                    computed = _decode_tokens(self.llm.ctx, self.tokens[p:q], p, seq, int(self.llm.n_batch))
                if computed:
                    self._learn(p, q, time.perf_counter() - piece_start)
                    p = q
                else:  # stopped for the fetch: what it computed of the piece goes (the loop ends)
                    llama_cpp.llama_memory_seq_rm(memory, seq, p, -1)
                self.held = p
        finally:
            if abortable:
                llama_cpp.llama_set_abort_callback(self.llm.ctx, llama_cpp.ggml_abort_callback(), None)
            rec.compute_ms += (time.perf_counter() - start) * 1e3
            with self.cv:
                self.computing = None
        if self.state is not None:
            codec.splice(self.state, _state_array(self.llm, self.target), b, e)

    def _learn(self, p: int, q: int, seconds: float) -> None:
        """A piece computed (positions p..q-1): the prefill speed learns it, here and for later loads."""
        if self.speed_given or self.speed is None:
            return
        with self.cv:
            self.speed.learn(p, q, seconds)
        _learn_speed(self.speed_key, p, q, seconds)

    @contextlib.contextmanager
    def _stoppable(self) -> Iterator[None]:
        """Around a llama_decode that the abort callback may stop: llama.cpp's warning that it
        removed the stopped positions kept off stderr (_warnings_unprinted), and Ctrl-C deferred.
        Python would raise the KeyboardInterrupt inside that ctypes callback, which prints it and
        carries on (the load went on to the end, and the CLI exited 0): on the main thread,
        Python's own handler is swapped for one that notes the interrupt, the callback stops the
        call, and the interrupt is raised once it returns (the load then puts the context back)."""
        if threading.current_thread() is not threading.main_thread() or (
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        ):
            with _warnings_unprinted():
                yield
            return
        noted: list[int] = []
        self.interrupted = lambda: bool(noted)
        previous = signal.signal(signal.SIGINT, lambda signum, _frame: noted.append(signum))
        try:
            with _warnings_unprinted():
                yield
        finally:
            signal.signal(signal.SIGINT, previous)
            self.interrupted = _never
        if noted:
            raise KeyboardInterrupt

    def _arrived(self, i: int) -> bool:
        """Whether a fetch of chunk i has arrived whole, for the assembly to take."""
        job = self.jobs.get(i)
        return job is not None and job.done.is_set() and job.error is None

    def _fetch_arrived(self, _data: Any) -> bool:
        """On llama.cpp's thread, with the GIL: what _compute's loop takes as an arrival (whatever
        stops the call, the loop sees it next, or computes the piece again), or an interrupt
        (_stoppable)."""
        if self.interrupted():
            return True
        i = self.computing
        return i is not None and self._arrived(i)

    def _capture(self) -> np.ndarray | None:
        try:
            return _state_array(self.llm, self.target)
        except CacheGenError:  # nothing to copy (an empty sequence): put back means clear
            return None

    def release(self) -> None:
        """Drops what the load held once it is over. The abort callback holds this loader through
        its bound method, a cycle that only Python's collector breaks, when its object counts say
        so: each load's buffer and backup stayed (six streamed loads of an 8K-token context in one
        process: 1.6 GB more)."""
        self.state = None
        self.backup = None
        self.abort_callback = None

    def rollback(self) -> None:
        """Puts the context back as it was before the first text chunk."""
        with self.cv:
            self.fallback = self.fallback or "the load failed"  # no more fetches
        if self.backup is None:
            return
        (saved,) = self.backup
        put_back(self.llm, saved, self.target)  # emptied first: the text chunks computed go too

    def assemble(self) -> bool:
        """Fills the buffer (True), or the context itself when every chunk was computed before
        a skeleton arrived (False)."""
        self._start_skeleton()
        self._fill()
        with self.cv:
            self.finished = True  # no fetch starts after this (a fetch thread's _feed)
            for job in self.jobs.values():  # upgrades not in when the rest was
                self._abandon(job)
            job = self.skeleton_job
            if job is not None:  # every chunk computed first: the skeleton is not needed
                job.abandoned = True
                self.skeleton_job = None
                self.skeleton_s = job.seconds
                self.failures.append(f"skeleton not in after {job.seconds:.1f} s, when the CPU was done")
                self.fallback = "every chunk computed from text before the skeleton arrived"
        return self.state is not None

    def _start_skeleton(self) -> None:
        skeleton_id = self.m.skeleton
        assert skeleton_id is not None
        with self.cv:
            self.skeleton_tries += 1
            self.skeleton_job = self.current = _Job(
                self.reader,
                -1,
                "skeleton",
                lambda: self.reader.skeleton(skeleton_id),
                on_done=self._wake,
            )

    def _wake(self, job: _Job) -> None:
        with self.cv:
            self.cv.notify_all()

    def _take_skeleton(self, job: _Job) -> None:
        """The skeleton that arrived becomes the buffer, with the chunks computed so far (the
        context holds them) spliced in; one that failed is fetched once more, then every chunk
        is computed from text (raised without text fallback)."""
        with self.cv:
            if self.skeleton_job is not job:
                return
            self.skeleton_job = None
            self.skeleton_s = job.seconds
            self._link_busy()
        state = None
        if job.error is None:
            try:
                state = self.reader.skeleton_state(str(self.m.skeleton), job.result)
            except CorruptDataError as exc:  # forged: removed, so the second fetch finds nothing
                job.error = exc
        if state is not None:
            self.skeleton = job.result
            if job.bytes:
                self.first_inv = job.seconds / job.bytes
            n = int(self.tokens.size)
            computed = max((e for (_, e), d in zip(self.ranges, self.done, strict=True) if d), default=0)
            if computed:  # chunks 0..k, all computed: the context holds them
                codec.splice(state, _state_array(self.llm, self.target), 0, computed)
            with self.cv:
                self.state, self.per_token = state, len(state) / n
            return
        exc = job.error
        self.failures.append(f"skeleton could not be fetched: {type(exc).__name__}: {exc}")
        if self.skeleton_tries < 2:
            self._start_skeleton()
            return
        if not self.text_ok:
            raise exc
        with self.cv:
            self.fallback = "the skeleton could not be fetched: every chunk computed from text"
            for k, d in enumerate(self.done):
                if not d:
                    self._claim(k, "failed")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _kl_table(kl_table: dict[str, float] | None) -> dict[str, float]:
    """LEVEL_KL, or the caller's figures: one for every lossy level (a level without one would
    cost inf in a plan, and inf x 0 tokens a nan that wins every comparison; a default beside the
    caller's figures would rank levels by two models), text and lossless exact unless given."""
    if kl_table is None:
        return dict(LEVEL_KL)
    if not isinstance(kl_table, dict):
        what = type(kl_table).__name__
        raise InvalidArgumentError(f"kl_table must map level names to KL figures, got {what}")
    for name, value in kl_table.items():
        if name not in LEVEL_KL:
            raise InvalidArgumentError(f"kl_table: {name!r} is not a level (levels: {', '.join(LEVEL_KL)})")
        if not (_is_number(value) and value >= 0 and math.isfinite(value)):
            raise InvalidArgumentError(f"kl_table[{name!r}] must be a finite number >= 0, got {value!r}")
    missing = [lv for lv, kl in LEVEL_KL.items() if kl > 0 and lv not in kl_table]
    if missing:
        raise InvalidArgumentError(f"kl_table lacks {', '.join(missing)}: give every lossy level a figure")
    return {TEXT: 0.0, "lossless": 0.0, **{name: float(value) for name, value in kl_table.items()}}


def _suffix_sums(values: list[float] | list[int]) -> list[float]:
    """[sum(values[x:]) for x in 0..len(values)]."""
    out = [0.0] * (len(values) + 1)
    for x in range(len(values) - 1, -1, -1):
        out[x] = out[x + 1] + values[x]
    return out


def _pick(plans: list[_Plan]) -> _Plan:
    """Among the plans that fit, the lowest KL, then the earliest, the least computed. When none
    fits: among those ending within _TICK_S of the earliest with the link's margin (at_risk;
    closer than the estimates can tell), the smaller fetch (link_risk), then the lowest KL."""
    fitting = [p for p in plans if p.feasible]
    if fitting:
        best = fitting[0]
        for p in fitting[1:]:
            # costs summed in another order differ in their last bits: those are equal, the earliest wins
            if not math.isclose(p.cost, best.cost, rel_tol=1e-9, abs_tol=1e-12):
                best = p if p.cost < best.cost else best
            elif (p.finish, p.text) < (best.finish, best.text):
                best = p
        return best
    earliest = min(p.at_risk for p in plans)
    return min((p for p in plans if p.at_risk <= earliest + _TICK_S), key=lambda p: (p.link_risk, p.cost))


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

    `slo_s`: seconds from this call to a loaded context (the first load of a model in a process
    measures its prefill speed within them, while it reads the manifest); None loads the best level
    stored (or `level`, fixed) and computes only what fails. `prior_mbps`: the link's expected
    rate (Mbit/s) for the first choice. `compute_tps`: prefill tokens/s to assume at every position
    instead of measuring and learning. `text_fallback=False`: nothing is computed; a chunk that
    fails twice raises, the context unchanged. `kl_table`: the KL of each level on your model (a
    figure for every lossy level; default LEVEL_KL, SmolLM2's), what plans minimise and the report's
    expected_kl. `oracle(nbytes)`: seconds the link will take for nbytes from now (a bandwidth
    oracle, for benchmarks). `progress(record)` is called after each chunk.
    A whole-container manifest (a state that could not be chunked) loads as `load_chunked` does.
    """
    for name, value in (("slo_s", slo_s), ("prior_mbps", prior_mbps), ("compute_tps", compute_tps)):
        if value is not None and not (_is_number(value) and value > 0 and math.isfinite(value)):
            raise InvalidArgumentError(f"{name} must be a positive finite number, got {value!r}")
    if level is not None:
        level = codec.level_name(level)
    require_kv_cache(llm)  # before calibrating: no prefill of a model nothing could be loaded into
    table = _kl_table(kl_table)
    store_url, key = chunks.split_manifest_url(url)
    t0 = time.perf_counter()  # the SLO's clock: what the caller waits for counts
    speed = None if compute_tps is None else _PrefillSpeed(compute_tps, _CALIBRATION_TOKENS)
    adapts = slo_s is not None and level is None and text_fallback
    with stores.open_store(store_url) as store, contextlib.ExitStack() as waits:
        # started once the store is open, joined on every way out: no prefill outlives the call
        calibration = _Calibration(llm) if speed is None and adapts else None
        if calibration is not None:
            waits.callback(calibration.join)
            waits.callback(calibration.stop)  # first: a load that fails waits for one piece only
        fingerprint = model_fingerprint(llm)
        # a manifest, or a whole container, of at most the context's size
        bound = chunks.whole_bound(fingerprint, llm.n_ctx())
        data = store.get(key, bound) if manifest is None else bytes(manifest)
        if not envelope.is_manifest(data):  # one whole container: nothing to stream
            if calibration is not None:
                calibration.stop()
            whole = load_compressed_state(llm, data, seq_id=seq_id, threads=threads)
            whole.extra["levels"] = {codec.inspect(data)["level"]: 1}
            n_tokens = int(StateMeta.unpack(codec.user_meta(data)).tokens.size)
            return _whole_report(whole, n_tokens, stores.redact(url), slo_s, t0, table)
        m = chunks.Manifest.unpack(data)
        check_fingerprint(m.meta.fingerprint, fingerprint)
        target = chunks._target(m.meta.scope, seq_id)
        _seq_id_ok(llm, target)
        tokens = m.meta.tokens
        chunks._check_room(llm, int(tokens.size))
        if m.chunk_tokens is None:
            if calibration is not None:
                calibration.stop()
            whole = chunks._load_whole(llm, store, m, level, seq_id, threads, len(data))
            return _whole_report(whole, int(tokens.size), stores.redact(url), slo_s, t0, table)
        if calibration is not None:
            speed = calibration.result()
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
            speed=speed,
            speed_given=compute_tps is not None,
            kl_table=table,
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
                lossy = None
                for rec in loader.records:
                    if rec.level not in (TEXT, "lossless"):
                        lossy = worse_load(lossy, rec.begin, rec.level)
                restore_context(llm, loader.state, target, tokens, m.meta.logits, lossy, m.meta.seed)
            else:
                set_tokens(llm, target, tokens, m.meta.logits, m.meta.seed)
        except BaseException:
            loader.rollback()
            loader.release()
            raise
    t3 = time.perf_counter()
    records = loader.records
    kl = sum(table.get(r.level, math.nan) * (r.end - r.begin) for r in records) / max(1, int(tokens.size))
    bytes_read = len(data) + loader.bytes_received()
    state_bytes = 0 if loader.state is None else len(loader.state)
    loader.release()
    return StreamReport(
        tokens=int(tokens.size) if target in (None, 0) else 0,
        cells=int(tokens.size),
        bytes_read=bytes_read,
        state_bytes=state_bytes,
        ratio=state_bytes / bytes_read,
        read_ms=(t1 - t0) * 1e3 + sum(r.fetch_ms for r in records),
        decode_ms=sum(r.decode_ms for r in records),
        restore_ms=(t3 - t2) * 1e3,
        seq_id=target,
        extra={"chunks": len(records), "levels": _count(records)},
        url=stores.redact(url),
        slo_s=slo_s,
        chunk_tokens=int(m.chunk_tokens),
        records=records,
        failures=loader.failures,
        fallback=loader.fallback,
        total_ms=(t3 - t0) * 1e3,
        assemble_ms=(t2 - t1) * 1e3,
        skeleton_ms=loader.skeleton_s * 1e3,
        calibrate_ms=0.0 if calibration is None else calibration.seconds * 1e3,
        compute_tps=None if speed is None else speed.tps,
        compute_tps_end=None if speed is None else 1.0 / speed.seconds(tokens.size - 1, tokens.size),
        expected_kl=kl,
        kl_table=table,
    )


def _count(records: list[ChunkRecord]) -> dict[str, int]:
    levels: dict[str, int] = {}
    for r in records:
        levels[r.level] = levels.get(r.level, 0) + 1
    return levels


def _whole_report(
    whole: LoadReport, n_tokens: int, url: str, slo_s: float | None, t0: float, table: dict[str, float]
) -> StreamReport:
    """The report of a state stored whole, counted as a chunked load's: one record of its
    `n_tokens` token ids, and one cell per token (`whole.cells` counts the KV cells of every cache,
    two per position with a sliding-window cache, and those of positions past the tokens)."""
    (level,) = whole.extra["levels"]
    record = ChunkRecord(0, 0, n_tokens, level, "whole", whole.bytes_read, whole.read_ms, whole.decode_ms)
    fields = {k: getattr(whole, k) for k in LoadReport.__dataclass_fields__}
    return StreamReport(
        **{**fields, "cells": n_tokens},
        url=url,
        slo_s=slo_s,
        records=[record],
        total_ms=(time.perf_counter() - t0) * 1e3,
        expected_kl=table.get(level, math.nan),
        kl_table=table,
    )


__all__ = ["LEVEL_KL", "TEXT", "ChunkRecord", "StreamReport", "calibrate", "load_streaming"]
