"""Adaptive streaming on the real model, through a shaped relay to a real `llama-cachegen serve` and
redis-server: choices under clearly separated link conditions, text fallback when the link drops
or the store dies, re-fetch of a chunk damaged on the wire, and an untouched context when the
load cannot complete. No assertion on how fast anything ran.

llama.cpp runs on one thread here: the relay, the store server and the fetch thread share the two
cores, and two llama.cpp threads that lose their core spin instead of computing.
"""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import llama_cpp
import numpy as np
import pytest
from conftest import greedy, smollm
from llama_cachegen import chunks, stores, stream
from llama_cachegen.errors import CorruptDataError, InvalidArgumentError, StoreError
from llama_cachegen.llama import Llama, capture_state, restore_state, set_tokens
from llama_cachegen.shaper import Relay, Trace, mbit

N, C = 600, 128  # five chunks, the last one partial
CHUNKS = -(-N // C)
LEVELS = ("lossless", "compact")
FAST = 1e4  # Mbit/s: a prior for links that are not shaped
TWO_CHUNKS = 4_500_000  # bytes down through the relay: manifest, skeleton, the last 2 lossless chunks
_llama = partial(smollm, n_ctx=700, threads=1)  # one thread: see the module docstring


@pytest.fixture(scope="module")
def original(gpl_tokens: list[int]) -> dict[str, Any]:
    llm = _llama()
    prefix = gpl_tokens[:N]
    llm.eval(prefix)
    state = capture_state(llm, None)
    llm._requires_eval = True  # as after a restore: the last token is decoded again, alone
    answer = greedy(llm, prefix)
    assert restore_state(llm, state, None)  # without the answer's positions
    llm.n_tokens = N
    stream.calibrate(llm)  # once for the module: every loader below shares the measurement
    return {"llm": llm, "prefix": prefix, "state": state, "greedy": answer}


@pytest.fixture(scope="module")
def stores_saved(original: dict[str, Any], request: pytest.FixtureRequest) -> dict[str, str]:
    """The context saved losslessly and compactly at C = 128 on the HTTP store and in redis."""
    llm, urls = original["llm"], {}
    http = request.getfixturevalue("http_server")[0]
    redis = request.getfixturevalue("redis_url")
    for name, url in (("http", f"{http}/ctx"), ("redis", f"{redis}/ctx?prefix=stream{os.getpid()}:")):
        chunks.save_chunked(llm, url, levels=LEVELS, chunk_tokens=C)
        urls[name] = url
    return urls


@pytest.fixture(params=["http"])
def relay(request: pytest.FixtureRequest, stores_saved: dict[str, str]) -> Iterator[tuple[Relay, str]]:
    """A relay to the store, unshaped until a test sets a trace, and the manifest URL through it."""
    url = stores_saved[request.param]
    with Relay(url) as r:
        yield r, r.url


both_stores = pytest.mark.parametrize("relay", ["http", "redis"], indirect=True)


@pytest.fixture(scope="module")
def loader() -> Llama:
    return _llama()


def _at_chunk(index: int, action: Callable[[], None]) -> Callable[[stream.ChunkRecord], None]:
    """A progress callback that runs `action` once chunk `index` is in the buffer."""

    def progress(record: stream.ChunkRecord) -> None:
        if record.index == index:
            action()

    return progress


def _manifest_bytes(url: str) -> bytes:
    store_url, key = chunks.split_manifest_url(url)
    with stores.open_store(store_url) as store:
        return store.get(key)


def _continues(loader: Llama, original: dict[str, Any]) -> None:
    assert loader.n_tokens == N
    assert greedy(loader, original["prefix"]) == original["greedy"]


def test_a_stopped_computation_keeps_the_positions_before_it(loader: Llama, original: dict[str, Any]) -> None:
    """What a race relies on: llama.cpp's abort callback (the loader's, once the chunk's fetch has
    arrived) stops a llama_decode call, which drops the stopped piece's positions and keeps the
    ones before it; the context then computes on and continues as the original."""
    prefix = np.array(original["prefix"], dtype=np.int32)
    memory = llama_cpp.llama_get_memory(loader.ctx)
    n_batch = int(loader.n_batch)
    assert stream._decode_tokens(loader.ctx, prefix[:256], 0, 0, n_batch)
    stop = llama_cpp.ggml_abort_callback(lambda _data: True)
    llama_cpp.llama_set_abort_callback(loader.ctx, stop, None)
    try:
        assert not stream._decode_tokens(loader.ctx, prefix[256:288], 256, 0, n_batch)
    finally:
        llama_cpp.llama_set_abort_callback(loader.ctx, llama_cpp.ggml_abort_callback(), None)
    assert llama_cpp.llama_memory_seq_pos_max(memory, 0) == 255
    assert stream._decode_tokens(loader.ctx, prefix[256:], 256, 0, n_batch)
    set_tokens(loader, None, prefix)
    _continues(loader, original)


@both_stores
def test_fast_link_loads_every_chunk_at_the_best_level(
    relay: tuple[Relay, str], loader: Llama, original: dict[str, Any]
) -> None:
    _, url = relay
    report = stream.load_streaming(loader, url, slo_s=60.0, prior_mbps=FAST)
    assert [r.level for r in report.records] == ["lossless"] * CHUNKS
    assert report.text_chunks == [] and report.failures == [] and report.fallback is None
    assert report.expected_kl == 0.0
    assert capture_state(loader, None) == original["state"]
    _continues(loader, original)
    d = report.to_dict()
    assert d["levels"] == {"lossless": CHUNKS} and len(d["chunks"]) == CHUNKS
    assert all(c["bytes"] > 0 and c["mbps"] > 0 for c in d["chunks"])
    json.dumps(d)  # plain data


def test_slow_link_takes_lower_levels(relay: tuple[Relay, str], loader: Llama) -> None:
    """16 Mbit/s: the lossless chunks (~2.5 MB each) would need ~6 s, the compact ones ~1.6 s;
    the SLO of 4 s sits between. Computing a chunk is assumed slower than fetching any level."""
    r, url = relay
    r.set_trace(Trace.constant(mbit(16)))
    slo = 4.0
    report = stream.load_streaming(loader, url, slo_s=slo, compute_tps=20.0)
    levels = [rec.level for rec in report.records]
    first = report.records[-1]  # fetched first (from the back): nothing measured but the skeleton
    assert first.reason == "first" and (first.upgraded_from or first.level) == "compact"
    assert "compact" in levels and levels.count("lossless") < CHUNKS and stream.TEXT not in levels
    manifest = chunks.read_manifest(url)
    lossless = sum(e.sizes["lossless"] for e in manifest.chunks)
    assert report.records[-1].mbps is not None  # the skeleton's rate (a burst of the relay's bucket)
    assert r.transfer_s(lossless) > slo  # a fixed best level would have missed it


def test_a_budget_between_two_levels_goes_to_the_latest_chunks(
    relay: tuple[Relay, str], loader: Llama
) -> None:
    """16 Mbit/s known in advance (the relay's own trace as the oracle): every chunk lossless
    (~6 s) misses an SLO of 4 s, every chunk compact (~1.6 s) leaves most of it unused. The plan
    spends it on the latest chunks (recent tokens weigh most): the last lossless, the first compact,
    where one level for all the chunks left took compact first and spent what remained on the first."""
    r, url = relay
    r.set_trace(Trace.constant(mbit(16)))
    manifest = chunks.read_manifest(url)
    lossless = sum(e.sizes["lossless"] for e in manifest.chunks)
    assert r.transfer_s(lossless) > 4.0
    report = stream.load_streaming(loader, url, slo_s=4.0, compute_tps=20.0, oracle=r.transfer_s)
    levels = [rec.level for rec in report.records]
    assert levels[0] == "compact" and levels[-1] == "lossless" and stream.TEXT not in levels
    assert 0.0 < report.expected_kl < stream.LEVEL_KL["compact"]


def test_cpu_computes_from_the_front_while_the_link_fetches_from_the_back(
    relay: tuple[Relay, str], loader: Llama, original: dict[str, Any]
) -> None:
    """16 Mbit/s: a lossless chunk takes ~1.2 s to arrive, about as long as computing two. With
    an SLO that lossless fits, every chunk is lossless or computed (both exact); the computed ones
    are a prefix, the fetched ones a suffix, and the context continues as the original. (The
    link's first fetch, with nothing measured, is the last chunk at compact: fetched again
    lossless, or computed again by the CPU once idle, whichever the timing makes sooner.)"""
    r, url = relay
    r.set_trace(Trace.constant(mbit(16)))
    report = stream.load_streaming(loader, url, slo_s=60.0)
    levels = [rec.level for rec in report.records]
    assert set(levels) <= {"lossless", stream.TEXT} and report.expected_kl == 0.0
    records = report.records
    computed = [i for i, rec in enumerate(records) if rec.level == stream.TEXT and not rec.upgraded_from]
    k = len(computed)
    assert computed == list(range(k)) and k < CHUNKS
    assert all(records[i].reason in ("parallel", "raced") for i in computed)
    assert all(rec.level == "lossless" or rec.upgraded_from == "compact" for rec in records[k:])
    assert report.failures == [] and report.fallback is None
    _continues(loader, original)


@both_stores
def test_link_dropping_to_near_zero_halfway_computes_the_rest(
    relay: tuple[Relay, str], loader: Llama, original: dict[str, Any]
) -> None:
    r, url = relay
    r.switch_after(TWO_CHUNKS, Trace.constant(2000.0))  # 2 kB/s once the last 2 chunks are in
    report = stream.load_streaming(loader, url, slo_s=60.0, prior_mbps=FAST)
    levels = [rec.level for rec in report.records]
    assert levels[-2:] == ["lossless", "lossless"]  # fetched first, before the drop
    assert {0, 1} <= set(report.text_chunks) <= {0, 1, 2}  # chunk 2 may have arrived before the drop
    assert all(report.records[i].reason in ("parallel", "raced") for i in report.text_chunks)
    assert report.failures == []  # the stalled fetch was outrun by the CPU, not failed
    assert all(report.records[i].compute_ms > 0 for i in report.text_chunks)
    assert report.to_dict()["text_chunks"] == report.text_chunks
    assert report.fallback is None and report.expected_kl == 0.0
    _continues(loader, original)


def test_a_fetch_stalled_by_a_drop_is_given_up_and_computed(
    relay: tuple[Relay, str], loader: Llama, original: dict[str, Any]
) -> None:
    """The link drops to 2 kB/s while chunk 2 is fetched (the relay's store is HTTP: the loader
    sees the fetch's progress and can end it). Waiting for it would take ~20 minutes; computing
    it takes a second: the fetch is given up at once, not left to hold the link, and the chunk
    is computed."""
    r, url = relay
    r.switch_after(TWO_CHUNKS, Trace.constant(2000.0))
    report = stream.load_streaming(loader, url, slo_s=60.0, prior_mbps=FAST)
    assert report.text_chunks == [0, 1, 2] and report.records[2].given_up == 1
    assert report.records[2].bytes > 0  # what it received before it was given up is counted
    assert [rec.level for rec in report.records[3:]] == ["lossless", "lossless"]
    assert report.failures == [] and report.fallback is None
    _continues(loader, original)


def test_a_fetch_that_arrives_while_it_is_given_up_is_kept(
    relay: tuple[Relay, str], loader: Llama, original: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, but the link recovers while the loader plans without chunk 2's stalled fetch,
    and the fetch arrives whole: it was given up all the same (Store.cancel of a read that has
    ended still succeeds), its verified chunk dropped and computed. It is kept."""
    r, url = relay
    best, forced = stream._Loader._best, []

    def recovering(self: stream._Loader, *args: Any, **kwargs: Any) -> Any:
        # planning without a fetch in flight that holds no plan: _abort_late's "what if given up"
        stalled = [
            job for job in self.jobs.values() if self.plan[job.index] is None and not job.done.is_set()
        ]
        if self.current is None and stalled and not forced:
            forced.append(stalled[0].index)
            r.set_trace(Trace.constant(math.inf))
            assert stalled[0].done.wait(30)
        return best(self, *args, **kwargs)

    monkeypatch.setattr(stream._Loader, "_best", recovering)
    r.switch_after(TWO_CHUNKS, Trace.constant(2000.0))
    report = stream.load_streaming(loader, url, slo_s=60.0, prior_mbps=FAST)
    assert forced == [2] and report.records[2].given_up == 0 and report.records[2].level == "lossless"
    assert report.failures == [] and report.fallback is None
    _continues(loader, original)


def test_a_fetch_given_up_after_its_body_arrived_is_counted_once(
    stores_saved: dict[str, str], loader: Llama, original: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the SLO the CPU computes every chunk, racing the fetch of the last (an oracle promising
    an instant link). That fetch's body has arrived, and its thread counts it only after the CPU
    won and the load gave the fetch up: the body was in the report twice (given up, and counted
    by the reader). The report's bytes are what the store sent."""
    from llama_cachegen.stores.http import HttpStore

    url = stores_saved["http"]
    last = chunks._chunk_key(chunks.read_manifest(url).chunks[-1].key, "lossless")
    get, count, abandon = HttpStore._get, chunks._ChunkReader._count, stream._Loader._abandon
    sent, held, given_up, counted = [0], [0], threading.Event(), threading.Event()

    def measured(self: HttpStore, key: str, limit: int | None) -> bytes:
        reader = getattr(self._local, "reader", None)
        before = 0 if reader is None else reader.received
        try:
            data = get(self, key, limit)
        finally:
            sent[0] += self._local.reader.received - before
        if key == last and not held[0]:
            held[0] = threading.get_ident()
            assert given_up.wait(30)  # the body is in; the CPU wins meanwhile
        return data

    def counting(self: chunks._ChunkReader, n: int) -> None:
        count(self, n)
        if threading.get_ident() == held[0]:
            counted.set()

    def abandoning(self: stream._Loader, job: Any) -> None:
        abandon(self, job)
        if job.thread.ident == held[0] and not given_up.is_set():
            given_up.set()
            assert counted.wait(30)  # its thread counts the body before the load goes on

    monkeypatch.setattr(HttpStore, "_get", measured)
    monkeypatch.setattr(chunks._ChunkReader, "_count", counting)
    monkeypatch.setattr(stream._Loader, "_abandon", abandoning)
    report = stream.load_streaming(loader, url, slo_s=1.0, oracle=lambda _nbytes: 0.0)
    assert given_up.is_set() and report.records[-1].level == stream.TEXT
    assert report.bytes_read == sent[0]
    _continues(loader, original)


def test_a_fetch_that_fails_while_the_cpu_computes_its_chunk_is_reported(
    file_saved: tuple[str, list[str]],
    loader: Llama,
    original: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the SLO the CPU computes the front chunk while the link fetches it (an oracle promising
    an instant link). Chunk 1's fetch fails while the CPU computes chunk 1: the CPU's chunk is
    taken, and the failure was missing from the report (one a moment earlier was there)."""
    from llama_cachegen.stores.file import FileStore

    url, lossless = file_saved
    get, compute = FileStore._get, stream._Loader._compute
    computing = threading.Event()

    def failing(self: FileStore, key: str, limit: int | None) -> bytes:
        if key == lossless[1]:
            assert computing.wait(30)
            raise StoreError(f"connection reset reading {key!r}")
        return get(self, key, limit)

    def computed(self: stream._Loader, i: int, until: float | None = None) -> None:
        if i == 1:
            computing.set()
        compute(self, i, until)
        job = self.jobs.get(i)
        if i == 1 and job is not None:
            assert job.done.wait(30)  # the fetch has failed before the CPU's chunk is taken

    monkeypatch.setattr(FileStore, "_get", failing)
    monkeypatch.setattr(stream._Loader, "_compute", computed)
    report = stream.load_streaming(loader, url, slo_s=1.0, oracle=lambda _nbytes: 0.0)
    assert computing.is_set() and report.records[1].level == stream.TEXT
    assert any(f.startswith("chunk 1 (lossless) could not be fetched: StoreError") for f in report.failures)
    _continues(loader, original)


def _failing_during_a_computation(monkeypatch: pytest.MonkeyPatch, failures: int) -> SimpleNamespace:
    """The first `failures` reads of chunk objects fail, the first once the CPU has begun a chunk
    computed on a buffer (that chunk's first piece waits for the failure). Returns what happened:
    asked (when chunk objects were read), held (the chunk whose first piece waited), computed
    (chunk: when its computation ended)."""
    from llama_cachegen.stores.file import FileStore

    get, compute, decode = FileStore._get, stream._Loader._compute, stream._decode_tokens
    computing, failed = threading.Event(), threading.Event()
    seen = SimpleNamespace(asked=[], held=[], computed={})
    loaders: list[stream._Loader] = []

    def failing(self: FileStore, key: str, limit: int | None) -> bytes:
        if key.startswith(f"{chunks.PREFIX}chunks/"):
            seen.asked.append(time.perf_counter())
            if len(seen.asked) == 1:
                assert computing.wait(30)
                failed.set()
            if len(seen.asked) <= failures:
                raise StoreError(f"connection reset reading {key!r}")
        return get(self, key, limit)

    def timed(self: stream._Loader, i: int, until: float | None = None) -> None:
        loaders.append(self)
        try:
            compute(self, i, until)
        finally:
            seen.computed.setdefault(i, time.perf_counter())

    def decoded(ctx: Any, tokens: np.ndarray, pos0: int, *args: Any) -> bool:
        if not seen.held and pos0 % C == 0 and loaders[-1].state is not None:  # a chunk's first piece
            seen.held.append(pos0 // C)
            computing.set()
            assert failed.wait(30)
        elif seen.held and pos0 == seen.held[0] * C + stream._PIECE:
            # the fetch asked again before this piece ends before it too (on a slow machine its
            # thread could lag past the chunk's last piece): the next check between pieces sees it
            for job in list(loaders[-1].jobs.values()):
                assert job.done.wait(30)
        return decode(ctx, tokens, pos0, *args)

    monkeypatch.setattr(FileStore, "_get", failing)
    monkeypatch.setattr(stream._Loader, "_compute", timed)
    monkeypatch.setattr(stream, "_decode_tokens", decoded)
    return seen


def test_a_fetch_that_fails_while_the_cpu_computes_another_chunk_is_fetched_again_meanwhile(
    loader: Llama, original: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the SLO the CPU computes from the front while the link fetches from the back (an
    oracle promising an instant link). The first chunk fetch fails as the CPU starts a chunk of
    four pieces (the fetch waits for that first piece, which waits for the failure): the assembly
    took the failure only once that chunk was computed, and the link idled meanwhile (1.55 s
    measured); the fetch starts again between two pieces now."""
    url = f"{tmp_path.as_uri()}/ctx"
    chunks.save_chunked(original["llm"], url, levels=("lossless",), chunk_tokens=C)  # to compare
    seen = _failing_during_a_computation(monkeypatch, 1)
    report = stream.load_streaming(loader, url, slo_s=0.5, oracle=lambda _nbytes: 0.0)
    assert seen.held and len(seen.asked) >= 2, seen
    assert seen.asked[1] < seen.computed[seen.held[0]], seen
    assert any("could not be fetched: StoreError" in f for f in report.failures)
    _continues(loader, original)


def test_a_fallback_while_the_cpu_computes_a_chunk_keeps_that_chunks_reason(
    loader: Llama, original: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, and the fetch fails again (the rest of the context is computed from text): the
    chunk the CPU was computing when that came is text for the reason it was computed (the
    fallback called it "failed"); the chunks not begun are "failed"."""
    url = f"{tmp_path.as_uri()}/ctx"
    chunks.save_chunked(original["llm"], url, levels=("lossless",), chunk_tokens=C)
    seen = _failing_during_a_computation(monkeypatch, 2)
    report = stream.load_streaming(loader, url, slo_s=0.5, oracle=lambda _nbytes: 0.0)
    assert report.fallback is not None and len(seen.asked) == 2, (report.fallback, seen)
    held = report.records[seen.held[0]]
    assert held.level == "text" and held.reason in ("late", "parallel"), held
    after = [r for r in report.records if r.index > held.index]
    assert after and all((r.level, r.reason) == ("text", "failed") for r in after), after
    _continues(loader, original)


def test_a_raced_fetch_that_fails_frees_the_link_before_its_chunk_is_computed(
    loader: Llama, original: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the SLO the link fetches the last chunk first and the CPU, computing from the front,
    races that fetch when it gets there. The fetch fails during the chunk's first piece: it is
    taken between two pieces (it held the link, a failure waiting for the assembly, until the
    chunk was computed), reported, and the chunk is text, raced, not fetched again."""
    from llama_cachegen.stores.file import FileStore

    url = f"{tmp_path.as_uri()}/ctx"
    chunks.save_chunked(original["llm"], url, levels=("lossless",), chunk_tokens=C)
    last = CHUNKS - 1
    get, compute, decode = FileStore._get, stream._Loader._compute, stream._decode_tokens
    racing, failed = threading.Event(), threading.Event()
    loaders: list[stream._Loader] = []
    held: list[bool] = []  # at the race's second piece: whether the failed fetch was still held

    def failing(self: FileStore, key: str, limit: int | None) -> bytes:
        if threading.current_thread().name == f"lcg-fetch-{last}" and not failed.is_set():
            assert racing.wait(30)
            failed.set()
            raise StoreError(f"connection reset reading {key!r}")
        return get(self, key, limit)

    def kept(self: stream._Loader, i: int, until: float | None = None) -> None:
        loaders.append(self)
        compute(self, i, until)

    def decoded(ctx: Any, tokens: np.ndarray, pos0: int, *args: Any) -> bool:
        loader_ = loaders[-1]
        if pos0 == last * C and loader_.computing == last and last in loader_.jobs and not racing.is_set():
            job = loader_.jobs[last]
            racing.set()
            assert job.done.wait(30) and job.error is not None
        elif pos0 == last * C + stream._PIECE and racing.is_set() and not held:
            held.append(last in loader_.jobs)
        return decode(ctx, tokens, pos0, *args)

    monkeypatch.setattr(FileStore, "_get", failing)
    monkeypatch.setattr(stream._Loader, "_compute", kept)
    monkeypatch.setattr(stream, "_decode_tokens", decoded)
    report = stream.load_streaming(loader, url, slo_s=0.5, oracle=lambda _nbytes: 0.0)
    assert racing.is_set() and held == [False], held
    rec = report.records[last]
    assert (rec.level, rec.reason) == ("text", "raced"), rec
    ours = [f for f in report.failures if f.startswith(f"chunk {last} ")]
    assert len(ours) == 1 and ours[0].startswith(
        f"chunk {last} (lossless) could not be fetched: StoreError"
    ), ours
    _continues(loader, original)


def test_past_the_slo_nothing_waits_for_the_link(
    relay: tuple[Relay, str], stores_saved: dict[str, str], loader: Llama, original: dict[str, Any]
) -> None:
    """Estimates that fail for good: an oracle promises an instant link while the link stalls
    (2 kB/s) once the skeleton is in, so every plan keeps waiting for fetches. Past the SLO's last
    moment the CPU computes the front chunks anyway and races the one in flight: the load ends
    a prefill after the SLO, not after the store's timeouts (each fetch waits 60 s for its reply)."""
    r, url = relay
    direct = stores_saved["http"]
    with stores.open_store(chunks.split_manifest_url(direct)[0]) as store:
        skeleton = len(store.get(_skeleton_key(direct)))
    r.switch_after(len(_manifest_bytes(direct)) + skeleton + 1024, Trace.constant(2000.0))
    report = stream.load_streaming(loader, url, slo_s=1.0, oracle=lambda _nbytes: 0.0)
    assert report.text_chunks == list(range(CHUNKS))
    reasons = [rec.reason for rec in report.records]
    assert "late" in reasons and set(reasons) <= {"late", "raced"}, reasons
    assert report.failures == [] and report.fallback is None
    _continues(loader, original)


def test_chunks_fetched_low_are_fetched_again_better_while_time_is_left(
    relay: tuple[Relay, str], loader: Llama, original: dict[str, Any]
) -> None:
    """A prior of 0.1 Mbit/s makes the first chunk compact (no level fits 60 s at that rate); the
    link, unshaped, turns out fast: the rest come lossless and the first is fetched again
    lossless in the time left (upgraded), so the context is the original, bit for bit."""
    _, url = relay
    report = stream.load_streaming(loader, url, slo_s=60.0, prior_mbps=0.1, text_fallback=False)
    first = report.records[0]
    assert first.upgraded_from == "compact" and first.level == "lossless"
    assert [rec.level for rec in report.records] == ["lossless"] * CHUNKS and report.expected_kl == 0.0
    assert all(rec.upgraded_from is None for rec in report.records[1:])
    assert report.to_dict()["chunks"][0]["upgraded_from"] == "compact"
    assert capture_state(loader, None) == original["state"]
    _continues(loader, original)


# what the planner's choices rest on, for SmolLM2 in 128-token chunks: bytes per level, and a KL
# table where compact costs far more than balanced (compact at twice q4_0's error)
_SIZES = {"high": 1_366_000, "balanced": 722_000, "compact": 630_000}
_KL3 = {**stream.LEVEL_KL, "high": 0.0034, "balanced": 0.0062, "compact": 0.0217}


def _planner(plan: list[str | None], slo_s: float, mbps: float) -> stream._Loader:
    """A loader's planning state alone (no store, no model, no clock but perf_counter): chunks of
    128 tokens at _SIZES, `plan[i]` the level chunk i is in the buffer at (None: undecided), a
    link whose rate is known (oracle), decode and restore free, no text fallback."""
    loader = object.__new__(stream._Loader)
    n = len(plan)
    loader.m = SimpleNamespace(chunks=[SimpleNamespace(sizes=dict(_SIZES)) for _ in range(n)])
    loader.ranges = [(128 * i, 128 * (i + 1)) for i in range(n)]
    loader.levels = [list(_SIZES)] * n
    loader.plan, loader.done = list(plan), [p is not None for p in plan]
    loader.jobs, loader.kept, loader.computing, loader.current = {}, set(), None, None
    loader.adapt, loader.both, loader.cpu_free = True, False, 0.0  # an SLO: adaptive
    loader.kl, loader.decode_s_per_byte, loader.state, loader.scores_fill = _KL3, {}, None, 0
    loader.oracle = lambda nbytes: nbytes * 8 / (mbps * 1e6)
    loader.slo_s, loader.t0 = slo_s, time.perf_counter()
    return loader


def test_a_new_chunk_is_not_fetched_better_than_an_upgrade_is_worth_when_time_is_short() -> None:
    """Chunk 0 in the buffer at compact (a slow start), four to fetch, 16 Mbit/s. While chunk 0 is
    compact, fetching it again at balanced gains more KL per byte than high gains over balanced on
    a new chunk: where the time left holds the plan (four at high) but not that upgrade after it,
    the new chunk comes at balanced; where it holds both, at high (the upgrade follows)."""
    for slo_s, expected in ((3.4, "balanced"), (60.0, "high")):  # 2.9 s to plan in: 2.7 + 0.4 s
        loader = _planner(["compact", None, None, None, None], slo_s, 16.0)
        plan = loader._best(loader._undecided(), time.perf_counter())
        assert plan is not None and plan.feasible and plan.level == "high"  # 4 x 1.37 MB: 2.7 s
        assert loader._capped(4, plan, time.perf_counter()) == expected, slo_s


def test_time_to_spare_is_not_spent_computing_what_the_best_level_brings(
    relay: tuple[Relay, str], loader: Llama, original: dict[str, Any]
) -> None:
    """The default levels (high, balanced, compact) in 64-token chunks, 60 s, a fast link: every
    chunk comes at high, none is computed. Text is the fallback for a link too slow, not a level
    above the best stored: a load that recomputed chunks whenever the SLO left time for it would
    take the prefill it exists to skip. (At 600 tokens, plans computing 3-6 chunks summed high's KL
    to a cost one rounding step below fetching them: costs that equal must leave it to the finish.)"""
    _, url = relay
    default_url = url + "-default-levels"
    chunks.save_chunked(original["llm"], default_url, chunk_tokens=64)
    report = stream.load_streaming(loader, default_url, slo_s=60.0, prior_mbps=FAST)
    assert [r.level for r in report.records] == ["high"] * -(-N // 64)
    assert all(r.compute_ms == 0 and r.upgraded_from is None for r in report.records)
    assert report.text_chunks == [] and report.failures == [] and report.slo_met


def test_an_idle_cpu_computes_chunks_below_the_best_level_again(
    relay: tuple[Relay, str], loader: Llama, original: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lossless and compact stored, a 4 Mbit/s link: the link's first fetch, the last chunk,
    comes compact (nothing measured yet); the others come lossless or are computed. Once every
    chunk is in the buffer the CPU, idle, computes the compact chunk again (every chunk before it
    exact), sooner than the link would bring it lossless (1.7 MB, ~3.5 s): the context ends exact.
    The CPU ends chunk 2 only once chunk 3's fetch has arrived (after its last piece is timed), as
    on a busy machine: the link, free with chunk 3 not yet decoded, took the compact chunk for an
    upgrade (4 runs of 5 under load)."""
    learn = stream._Loader._learn

    def held(self: stream._Loader, p: int, q: int, seconds: float) -> None:
        learn(self, p, q, seconds)
        job = self.jobs.get(3)  # (a plan may compute chunk 3 instead, on a faster CPU)
        if q == self.ranges[2][1] and job is not None:
            assert job.done.wait(30)

    monkeypatch.setattr(stream._Loader, "_learn", held)
    r, url = relay
    r.set_trace(Trace.constant(mbit(4)))
    report = stream.load_streaming(loader, url, slo_s=60.0)
    last = report.records[-1]
    assert (last.upgraded_from, last.level) == ("compact", stream.TEXT) and last.compute_ms > 0
    assert all(r.level in ("lossless", stream.TEXT) for r in report.records) and report.expected_kl == 0.0
    assert report.failures == []
    _continues(loader, original)


def test_an_upgrade_that_fails_leaves_the_chunk_as_it_was(
    relay: tuple[Relay, str], loader: Llama, original: dict[str, Any]
) -> None:
    """The first chunk's lossless object is damaged in the store: its upgrade fails
    verification, is reported, and the compact chunk already in the buffer stays."""
    _, url = relay
    store_url, _ = chunks.split_manifest_url(url)
    key = chunks._chunk_key(chunks.read_manifest(url).chunks[0].key, "lossless")
    with stores.open_store(store_url) as store:
        good = store.get(key)
        store.put(key, good[:-100] + bytes(100))
        try:
            report = stream.load_streaming(loader, url, slo_s=60.0, prior_mbps=0.1, text_fallback=False)
        finally:
            store.put(key, good)
    assert report.records[0].level == "compact" and report.records[0].upgraded_from is None
    assert [rec.level for rec in report.records[1:]] == ["lossless"] * (CHUNKS - 1)
    assert len(report.failures) == 1 and "upgrade" in report.failures[0] and report.fallback is None
    assert 0.0 < report.expected_kl < stream.LEVEL_KL["compact"]
    assert greedy(loader, original["prefix"])  # a complete context that generates


def test_link_too_slow_for_the_skeleton_computes_every_chunk(
    relay: tuple[Relay, str], loader: Llama, original: dict[str, Any]
) -> None:
    """200 B/s (the manifest given): the skeleton (~13 kB) would take a minute. The CPU starts on
    the first chunk as soon as the skeleton is late and computes them all without it."""
    r, url = relay
    manifest = _manifest_bytes(url)
    r.set_trace(Trace.constant(200.0))
    report = stream.load_streaming(loader, url, slo_s=60.0, manifest=manifest)
    assert report.text_chunks == list(range(CHUNKS))
    assert all(rec.reason == "parallel" and rec.compute_ms > 0 for rec in report.records)
    assert report.fallback is not None and "before the skeleton arrived" in report.fallback
    assert report.state_bytes == 0 and report.expected_kl == 0.0
    _continues(loader, original)


def test_a_load_without_its_skeleton_keeps_the_last_logits(tmp_path: Path, gpl_tokens: list[int]) -> None:
    """The skeleton is missing from the store: every chunk is computed from text, and
    llama-cpp-python's last logits are the saved ones, as after any other load (a sweep found
    them left as zeros, for code that reads `scores` without evaluating again)."""
    n = 200
    saver, target = _llama(logits_all=True), _llama(logits_all=True)
    saver.eval(gpl_tokens[:n])
    url = f"{tmp_path.as_uri()}/ctx"
    chunks.save_chunked(saver, url, levels=("lossless",), chunk_tokens=64)
    with stores.open_store(tmp_path.as_uri()) as store:
        assert store.delete(_skeleton_key(url))
    report = stream.load_streaming(target, url, slo_s=60.0)
    assert report.text_chunks == [0, 1, 2, 3] and "skeleton could not be fetched" in (report.fallback or "")
    assert target.n_tokens == n and np.array_equal(target.input_ids[:n], saver.input_ids[:n])
    np.testing.assert_array_equal(target.scores[n - 1], saver.scores[n - 1])


def test_streaming_into_another_sequence_computes_there(
    relay: tuple[Relay, str], original: dict[str, Any]
) -> None:
    """A sequence-scoped save streamed into sequence 1 of a context whose sequence 0 holds other
    text, on a link too slow for the skeleton: every chunk is computed in sequence 1 only, to the
    K/V llama.cpp computes for the same tokens there. (Not the saved K/V: beside another
    sequence's cells, llama.cpp's deeper layers come out ~2% apart, enough to change a greedy
    continuation; a computed chunk is exact only where the context is laid out as the saver's.)"""
    r, url = relay
    seq_url = url + "-seq"
    chunks.save_chunked(original["llm"], seq_url, levels=LEVELS, chunk_tokens=C, seq_id=0)
    other_text = b"Another conversation, in sequence 0, that the load must leave alone."
    target, twin = _llama(n_ctx=1400, n_seq_max=2), _llama(n_ctx=1400, n_seq_max=2)
    for llm in (target, twin):
        llm.eval(llm.tokenize(other_text))
    other = capture_state(target, 0)
    manifest = _manifest_bytes(seq_url)
    r.set_trace(Trace.constant(2000.0))
    report = stream.load_streaming(target, seq_url, slo_s=60.0, seq_id=1, manifest=manifest)
    assert report.seq_id == 1 and report.text_chunks == list(range(CHUNKS))
    assert capture_state(target, 0) == other
    stream._decode_tokens(twin.ctx, np.array(original["prefix"]), 0, 1, 512)
    assert capture_state(target, 1) == capture_state(twin, 1)


def test_chunks_computed_before_a_late_skeleton_join_the_buffer(
    relay: tuple[Relay, str], loader: Llama, original: dict[str, Any]
) -> None:
    """The link crawls (300 B/s: the skeleton, ~13 kB, would take 40 s; the manifest given) until
    the CPU has computed the first chunk, then is fast: the chunks the CPU computed meanwhile are
    spliced into the buffer built from the skeleton, the rest fetched."""
    r, url = relay
    manifest = _manifest_bytes(url)
    r.set_trace(Trace.constant(300.0))
    fast = _at_chunk(0, lambda: r.set_trace(Trace.constant(math.inf)))
    report = stream.load_streaming(loader, url, slo_s=60.0, prior_mbps=FAST, manifest=manifest, progress=fast)
    k = len(report.text_chunks)
    assert 1 <= k < CHUNKS and report.text_chunks == list(range(k))
    assert all(report.records[i].reason in ("parallel", "raced") for i in range(k))
    assert all(rec.level == "lossless" for rec in report.records[k:])
    assert report.skeleton_ms > report.records[0].compute_ms  # it arrived after chunk 0 was computed
    assert report.fallback is None and report.failures == []
    _continues(loader, original)


def _skeleton_key(url: str) -> str:
    skeleton = chunks.read_manifest(url).skeleton
    assert skeleton is not None
    return chunks._skeleton_key(skeleton)


def _read_in_thread(url: str, key: str) -> tuple[stores.Store, threading.Thread, list[BaseException]]:
    """A store of the manifest's and a thread reading `key` from it (errors collected)."""
    store = stores.open_store(chunks.split_manifest_url(url)[0])
    errors: list[BaseException] = []

    def read() -> None:
        try:
            store.get(key)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    return store, reader, errors


@both_stores
def test_closing_the_store_ends_a_read_in_flight(relay: tuple[Relay, str]) -> None:
    """A fetch a load gave up on must not keep taking the link: closing the store ends it, and
    it is not retried on a new connection."""
    r, url = relay
    key = _skeleton_key(url)  # the manifest read before the link is shaped
    r.set_trace(Trace.constant(4000.0))  # 4 kB/s: the skeleton would take ~3 s
    store, reader, errors = _read_in_thread(url, key)
    time.sleep(1.0)
    connections = r.connections
    store.close()
    reader.join(5.0)
    assert not reader.is_alive() and len(errors) == 1 and isinstance(errors[0], StoreError)
    sent = r.bytes_down
    time.sleep(1.5)  # a read going on would move ~6 kB; the relay may push a piece or two it holds
    assert r.connections == connections and r.bytes_down - sent < 3 * 1460


def test_a_read_in_flight_reports_its_progress_and_can_be_cancelled(relay: tuple[Relay, str]) -> None:
    """What the loader needs from a store to give up a late fetch: the bytes a thread's read has
    received, and an end to that read alone (the store stays open for the next)."""
    r, url = relay
    key = _skeleton_key(url)
    r.set_trace(Trace.constant(4000.0))  # 4 kB/s: the skeleton (~13 kB) would take ~3 s
    store, reader, errors = _read_in_thread(url, key)
    deadline = time.monotonic() + 30.0
    while reader.ident is None or (store.received(reader.ident) or 0) <= 1000:
        assert time.monotonic() < deadline, "the read received nothing"
        time.sleep(0.02)
    assert (store.received(reader.ident) or 0) < 12_000  # counted as it goes, before the end
    assert store.cancel(reader.ident)
    reader.join(5.0)
    assert not reader.is_alive() and len(errors) == 1 and isinstance(errors[0], StoreError)
    assert store.cancel(threading.get_ident()) is False  # this thread reads nothing
    r.set_trace(Trace.constant(math.inf))
    assert store.get(key)  # the store still reads
    store.close()


def test_a_read_closed_before_its_reply_is_not_completed_on_a_retry(relay: tuple[Relay, str]) -> None:
    """Closed while its request waits for the reply's headers (100 B/s: none arrive), then the
    connection is reset: urllib3 retries the request on a new connection, and that reply is
    dropped as soon as it starts instead of being read in full."""
    r, url = relay
    key = _skeleton_key(url)  # the manifest read before the link is shaped
    r.set_trace(Trace.constant(100.0))
    store, reader, errors = _read_in_thread(url, key)
    time.sleep(0.3)
    store.close()
    sent = r.bytes_down
    r.cut()
    r.heal()
    r.set_trace(Trace.constant(math.inf))
    reader.join(10.0)
    assert not reader.is_alive() and len(errors) == 1 and isinstance(errors[0], StoreError)
    assert r.bytes_down - sent < 13_000  # the skeleton (~13 kB) was not read again


def test_store_dying_mid_stream_is_completed_from_text(
    relay: tuple[Relay, str], loader: Llama, original: dict[str, Any]
) -> None:
    r, url = relay
    r.switch_after(TWO_CHUNKS, None)  # the store dies once the last 2 chunks are in
    report = stream.load_streaming(loader, url, slo_s=60.0, prior_mbps=FAST)
    assert {0, 1} <= set(report.text_chunks) <= {0, 1, 2}
    assert report.fallback is not None and "computed from text" in report.fallback
    failed = report.text_chunks[-1]  # the link fetches from the back: the failed chunk is the last text one
    assert report.records[failed].retries == 1 and report.records[failed].reason == "failed"
    # its fetch and the one again; on a busy machine (a rate that looked slow: a chunk fetched
    # compact), that chunk's upgrade fails too
    assert 2 <= len(report.failures) <= 3 and all("could not be fetched" in f for f in report.failures)
    _continues(loader, original)


def test_chunk_corrupted_on_the_wire_is_fetched_again(
    relay: tuple[Relay, str], loader: Llama, original: dict[str, Any]
) -> None:
    r, url = relay
    r.corrupt(TWO_CHUNKS)  # one byte, inside the body of the third chunk fetched
    report = stream.load_streaming(loader, url, slo_s=60.0, prior_mbps=FAST)
    assert [rec.level for rec in report.records] == ["lossless"] * CHUNKS and report.fallback is None
    assert len(report.failures) == 1 and sum(rec.retries for rec in report.records) == 1
    assert capture_state(loader, None) == original["state"]
    _continues(loader, original)


def test_a_plain_load_damaged_on_the_wire_removes_nothing(
    relay: tuple[Relay, str], loader: Llama, original: dict[str, Any]
) -> None:
    """A byte flipped on the way (not where it is stored): the load fails, and the store keeps
    every object (read again, it is whole: only damage that repeats byte for byte is removed)."""
    r, url = relay
    store_url, _ = chunks.split_manifest_url(url)
    manifest = chunks.read_manifest(url)
    keys = [chunks._chunk_key(c.key, level) for c in manifest.chunks for level in LEVELS]
    r.corrupt(TWO_CHUNKS)
    with pytest.raises(CorruptDataError) as refused:
        chunks.load_chunked(loader, url)
    assert "removed" not in str(refused.value)
    with stores.open_store(store_url) as store:
        assert all(store.exists(k) for k in keys)
    chunks.load_chunked(loader, url)  # the link heals: it loads
    assert capture_state(loader, None) == original["state"]


def test_skeleton_corrupted_on_the_wire_is_fetched_again(
    relay: tuple[Relay, str], loader: Llama, original: dict[str, Any]
) -> None:
    r, url = relay
    manifest = _manifest_bytes(url)
    r.corrupt(4096)  # one byte inside the skeleton's body (~13 kB), the first object fetched
    report = stream.load_streaming(loader, url, slo_s=60.0, prior_mbps=FAST, manifest=manifest)
    assert len(report.failures) == 1 and "skeleton could not be fetched" in report.failures[0]
    assert [rec.level for rec in report.records] == ["lossless"] * CHUNKS and report.fallback is None
    assert capture_state(loader, None) == original["state"]


def test_skeleton_corrupted_twice_is_computed_or_refused(
    relay: tuple[Relay, str], loader: Llama, original: dict[str, Any]
) -> None:
    r, url = relay
    manifest = _manifest_bytes(url)
    target = _llama()
    target.eval(target.tokenize(b"An unrelated context that must survive a refused load."))
    before = capture_state(target, None)
    r.corrupt(4096, every=13_000)  # inside both fetches of the skeleton (~13 kB each)
    with pytest.raises(CorruptDataError):
        stream.load_streaming(target, url, slo_s=60.0, text_fallback=False, manifest=manifest)
    assert capture_state(target, None) == before
    r.corrupt(4096, every=13_000)
    report = stream.load_streaming(loader, url, slo_s=60.0, prior_mbps=FAST, manifest=manifest)
    assert report.fallback is not None and "skeleton could not be fetched" in report.fallback
    assert report.text_chunks == list(range(CHUNKS)) and len(report.failures) == 2
    _continues(loader, original)


def test_chunks_corrupted_again_and_again_are_computed(
    relay: tuple[Relay, str], loader: Llama, original: dict[str, Any]
) -> None:
    r, url = relay
    r.corrupt(TWO_CHUNKS, every=200_000)  # every chunk after the last 2 is damaged, fetched again or not
    report = stream.load_streaming(loader, url, slo_s=60.0, prior_mbps=FAST)
    # the chunk fetched while the damaged one decoded may fail too
    assert report.fallback is not None and len(report.failures) >= 2
    assert report.text_chunks == list(range(len(report.text_chunks))) and report.text_chunks
    assert [rec.level for rec in report.records[-2:]] == ["lossless"] * 2
    _continues(loader, original)


@pytest.fixture
def file_saved(original: dict[str, Any], tmp_path: Path) -> tuple[str, list[str]]:
    """The context saved on a file store: its manifest URL and each chunk's lossless object key."""
    url = f"{tmp_path.as_uri()}/ctx"
    chunks.save_chunked(original["llm"], url, levels=LEVELS, chunk_tokens=C)
    return url, [chunks._chunk_key(c.key, "lossless") for c in chunks.read_manifest(url).chunks]


def test_a_level_gone_from_the_store_is_fetched_at_the_next_level_stored(
    file_saved: tuple[str, list[str]], loader: Llama, tmp_path: Path
) -> None:
    """Chunk 2's best level was evicted: the load takes the level still stored, as a plain load
    does, instead of computing the chunk and every chunk after it from text."""
    url, lossless = file_saved
    (tmp_path / lossless[2]).unlink()
    report = stream.load_streaming(loader, url)
    assert [rec.level for rec in report.records] == ["lossless"] * 2 + ["compact"] + ["lossless"] * 2
    assert report.text_chunks == [] and report.fallback is None and loader.n_tokens == N


def test_a_failed_fetch_is_fetched_again_before_any_other(
    file_saved: tuple[str, list[str]],
    loader: Llama,
    original: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The assembly can take a failed fetch before the fetch's thread reports it (_fetched): the
    link looked free and the next chunk's fetch started beside the retry; once the retry failed
    too, that fetch was given up still in flight, and a load without an SLO failed an assertion
    on it (CI at 19f88ea, tiny gpt-oss, one run in hundreds). The order is forced here: a failed
    fetch reports 0.3 s late, chunk 1 fails every time, and the chunks after it read slowly."""
    from llama_cachegen.stores.file import FileStore

    url, lossless = file_saved
    keys = [key.rsplit("/", 1)[0] + "/" for key in lossless]
    asked: list[int] = []
    get, fetched = FileStore._get, stream._Loader._fetched

    def slow_after_one(self: FileStore, key: str, limit: int | None) -> bytes:
        index = next((i for i, k in enumerate(keys) if key.startswith(k)), None)
        if index is not None:
            asked.append(index)
            if index == 1:
                raise StoreError(f"timed out reading {key!r}")
            if index > 1:
                time.sleep(1.0)
        return get(self, key, limit)

    def reported_late(self: stream._Loader, job: Any) -> None:
        if job.error is not None:
            time.sleep(0.3)
        fetched(self, job)

    monkeypatch.setattr(FileStore, "_get", slow_after_one)
    monkeypatch.setattr(stream._Loader, "_fetched", reported_late)
    report = stream.load_streaming(loader, url)
    assert asked == [0, 1, 1]
    assert report.text_chunks == list(range(1, len(keys))) and report.fallback is not None
    _continues(loader, original)


def test_a_chunk_that_does_not_decode_is_fetched_again_once_the_link_is_free(
    file_saved: tuple[str, list[str]],
    loader: Llama,
    original: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunk 1 arrives whole and does not decode (its bytes damaged past the fetch's checks): it
    was fetched again at once, beside chunk 2's fetch begun when chunk 1 arrived (two fetches on
    one link), and each fetch counted the other's bytes as its own (the records summed to 17 MB
    of 14 MB read). One fetch at a time; each record holds its own chunk's bytes."""
    from llama_cachegen import codec
    from llama_cachegen.stores.file import FileStore

    url, lossless = file_saved
    sizes = [(Path(url.removeprefix("file://")).parent / key).stat().st_size for key in lossless]
    in_flight: set[int] = set()
    peak = [0]
    get, decode = FileStore._get, codec.decode_chunk

    def slow(self: FileStore, key: str, limit: int | None) -> bytes:
        index = lossless.index(key) if key in lossless else None
        if index is None:
            return get(self, key, limit)
        in_flight.add(index)
        peak[0] = max(peak[0], len(in_flight))
        try:
            time.sleep(0.2)
            return get(self, key, limit)
        finally:
            in_flight.discard(index)

    decoded: list[int] = []

    def damaged_once(chunk: Any, *args: Any, **kwargs: Any) -> None:
        decoded.append(0)
        if len(decoded) == 2:  # chunk 1, the first time
            raise CorruptDataError("chunk 1's tensor data does not decode")
        decode(chunk, *args, **kwargs)

    monkeypatch.setattr(FileStore, "_get", slow)
    monkeypatch.setattr(codec, "decode_chunk", damaged_once)
    report = stream.load_streaming(loader, url)
    assert peak[0] == 1 and [rec.retries for rec in report.records] == [0, 1, 0, 0, 0]
    assert [rec.bytes for rec in report.records[1:]] == [2 * sizes[1], *sizes[2:]]
    assert report.text_chunks == [] and report.fallback is None
    _continues(loader, original)


def test_a_fetch_taken_before_its_thread_reports_it_still_measures_the_link(
    file_saved: tuple[str, list[str]],
    loader: Llama,
    original: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first chunk's fetch (compact: nothing measured yet) reports late, after the assembly
    has taken it and freed the link: the next fetches were chosen on no rate, each the smallest
    level again ("first"), and fetched again better. The link's rate is what the fetch shows."""
    url, _ = file_saved
    fetched, late = stream._Loader._fetched, []

    def reported_late(self: stream._Loader, job: Any) -> None:
        if job.index >= 0 and not late:
            late.append(job.index)
            time.sleep(0.5)
        fetched(self, job)

    monkeypatch.setattr(stream._Loader, "_fetched", reported_late)
    report = stream.load_streaming(loader, url, slo_s=60.0)
    assert late and [rec.reason for rec in report.records].count("first") == 1
    assert all(rec.level == "lossless" for rec in report.records)
    _continues(loader, original)


def test_a_chunk_damaged_where_it_is_stored_is_removed_by_a_streaming_load(
    file_saved: tuple[str, list[str]], loader: Llama, tmp_path: Path
) -> None:
    """A byte of chunk 2's body flipped on disk: the decode fails, and fails again on the same
    bytes fetched once more; the load removes the object (a save skips objects that exist, and
    every load would fail on it) and takes the next level."""
    url, lossless = file_saved
    damaged = tmp_path / lossless[2]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x40  # inside the tensor data: the fetch's checks pass, the decode fails
    damaged.write_bytes(bytes(data))
    report = stream.load_streaming(loader, url)
    assert not damaged.exists()
    assert any("damaged where it is stored (the same bytes twice): removed" in f for f in report.failures)
    assert report.records[2].level == "compact" and report.text_chunks == [] and loader.n_tokens == N


def test_a_load_leaves_no_buffer_behind(
    file_saved: tuple[str, list[str]], loader: Llama, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader's abort callback holds the loader (a bound method): a cycle that kept each
    load's state buffer until Python's collector ran (six loads of an 8K-token context: +1.6 GB).
    With the collector off, the buffer is gone once the load returns."""
    url, _ = file_saved
    buffers: list[weakref.ref[Any]] = []
    assemble = stream._Loader.assemble

    def noted(self: stream._Loader) -> bool:
        buffered = assemble(self)
        buffers.append(weakref.ref(self.state))
        return buffered

    monkeypatch.setattr(stream._Loader, "assemble", noted)
    gc.disable()
    try:
        for slo_s in (None, 60.0):
            stream.load_streaming(loader, url, slo_s=slo_s)
            assert buffers[-1]() is None, slo_s
    finally:
        gc.enable()


def test_ctrl_c_while_a_chunk_is_computed_stops_the_load_and_puts_the_context_back(
    file_saved: tuple[str, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT arriving inside llama.cpp's abort callback: Python raises the KeyboardInterrupt
    there, in a ctypes callback, which printed it and went on: the load ran to its end. The load
    now stops, puts the context back, and raises it."""
    url, _ = file_saved
    for key in chunks.read_manifest(url).chunks:  # every chunk computed from text
        for level in LEVELS:
            (tmp_path / chunks._chunk_key(key.key, level)).unlink()
    target = _llama()
    target.eval(target.tokenize(b"A context the interrupted load must leave as it was."))
    before = capture_state(target, None)
    calls = []
    arrived = stream._Loader._fetch_arrived

    def interrupted_in_the_callback(self: stream._Loader, data: Any) -> bool:
        if self.computing is not None:
            calls.append(1)
            if len(calls) == 5:  # past the loop's own call: within llama_decode, on the main thread
                os.kill(os.getpid(), signal.SIGINT)
        return arrived(self, data)

    monkeypatch.setattr(stream._Loader, "_fetch_arrived", interrupted_in_the_callback)
    with pytest.raises(KeyboardInterrupt):
        stream.load_streaming(target, url)
    assert len(calls) < 50  # stopped at a call soon after the interrupt, not at the load's end
    assert capture_state(target, None) == before


def test_a_failed_load_without_text_fallback_leaves_the_context(relay: tuple[Relay, str]) -> None:
    r, url = relay
    target = _llama()
    target.eval(target.tokenize(b"An unrelated context that must survive a failed load."))
    before, n_tokens = capture_state(target, None), target.n_tokens
    with pytest.raises(StoreError):
        stream.load_streaming(
            target, url, slo_s=60.0, prior_mbps=FAST, text_fallback=False, progress=_at_chunk(1, r.cut)
        )
    assert capture_state(target, None) == before and target.n_tokens == n_tokens
    # a store that is down before the manifest: nothing to fall back on, the context stays
    with pytest.raises(StoreError):
        stream.load_streaming(target, url, slo_s=60.0)
    assert capture_state(target, None) == before and target.n_tokens == n_tokens


def test_llama_method_streams_with_an_slo(relay: tuple[Relay, str], original: dict[str, Any]) -> None:
    _, url = relay
    llm = _llama()
    report = llm.load_compressed_state(url, slo_s=60.0, prior_mbps=FAST)
    assert isinstance(report, stream.StreamReport) and report.tokens == N
    assert report.to_dict()["levels"] == {"lossless": CHUNKS}
    plain = llm.load_compressed_state(url)  # no slo: the chunked loader, unchanged
    assert not isinstance(plain, stream.StreamReport) and plain.extra["levels"] == {"lossless": CHUNKS}
    with pytest.raises(InvalidArgumentError):
        stream.load_streaming(llm, url, slo_s=-1.0)


def test_a_first_load_measures_the_prefill_within_its_slo(
    relay: tuple[Relay, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SLO counts from the call: a process's first load measures the prefill speed (while it
    reads the manifest) inside its total time, so slo_met says what the caller waited for; the
    speed is kept, and the next load does not measure it again."""
    _, url = relay
    monkeypatch.setattr(stream, "_speeds", {})  # as in a new process
    llm = _llama()
    start = time.perf_counter()
    first = stream.load_streaming(llm, url, slo_s=60.0, prior_mbps=FAST)
    wall_ms = (time.perf_counter() - start) * 1e3
    assert 0 < first.calibrate_ms <= first.total_ms <= wall_ms
    assert first.compute_tps is not None and first.compute_tps > 0
    assert first.slo_met is (first.total_ms <= 60e3)
    again = stream.load_streaming(llm, url, slo_s=60.0, prior_mbps=FAST)
    assert again.calibrate_ms < first.calibrate_ms


def test_no_measurement_outlives_a_load_or_runs_for_a_fixed_level(
    relay: tuple[Relay, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill measurement runs on the caller's model: a load whose store cannot be opened
    raises with none left running (a caller freeing the model then crashed the process); a load
    at a fixed level plans nothing and measures nothing."""
    _, url = relay
    monkeypatch.setattr(stream, "_speeds", {})  # as in a new process
    llm = _llama()
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"")
    with pytest.raises(StoreError):
        stream.load_streaming(llm, (not_a_dir / "ctx").as_uri(), slo_s=60.0)
    assert not any(t.name == "llama-cachegen-calibrate" for t in threading.enumerate())
    fixed = stream.load_streaming(llm, url, slo_s=60.0, level="compact")
    assert fixed.calibrate_ms == 0 and stream._speeds == {}
    assert fixed.to_dict()["levels"] == {"compact": CHUNKS}


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ({"text": 0.0, "compact": 0.0095}, "lacks high, balanced"),
        ({**stream.LEVEL_KL, "medium": 0.004}, "'medium' is not a level"),
        ({**stream.LEVEL_KL, "high": math.nan}, "finite number"),
        ({**stream.LEVEL_KL, "high": -0.1}, "finite number"),
    ],
)
def test_a_kl_table_without_every_lossy_level_is_refused(
    loader: Llama, tmp_path: Path, table: dict[str, float], says: str
) -> None:
    """What plans minimise: a level without a figure would cost inf (and inf x 0 tokens a nan that
    wins every comparison), a default figure beside the caller's would rank two models' levels."""
    with pytest.raises(InvalidArgumentError, match=says):
        stream.load_streaming(loader, (tmp_path / "ctx").as_uri(), slo_s=60.0, kl_table=table)


def test_a_state_stored_whole_reports_its_tokens_as_a_chunked_load_does(
    gpl_tokens: list[int], tmp_path: Path
) -> None:
    """A rewound context (KV of 400 positions, 250 tokens) cannot be chunked: stored whole, directly
    or behind a manifest, its report has one record over its tokens and one cell per token, as a
    chunked load counts them, not the KV cells."""
    llm = _llama()
    llm.eval(gpl_tokens[:400])
    llm.n_tokens = 250
    assert chunks.save_chunked(llm, tmp_path / "ctx", levels=("lossless",), chunk_tokens=C).fallback
    llm.save_compressed_state(tmp_path / "whole.lcg", level="lossless")
    for url in ((tmp_path / "ctx").as_uri(), (tmp_path / "whole.lcg").as_uri()):
        report = stream.load_streaming(_llama(), url, slo_s=60.0, prior_mbps=FAST)
        assert (report.tokens, report.cells) == (250, 250)
        assert [(r.begin, r.end, r.level) for r in report.records] == [(0, 250, "lossless")]


@pytest.mark.parametrize("name", ["ctx", "whole.lcg"])
def test_a_state_stored_whole_waits_for_no_calibration(
    gpl_tokens: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A load with an SLO measures the prefill speed while it reads the manifest; a state stored
    whole (directly, or behind a manifest) streams nothing and needs none. It waited for the
    calibration all the same: 11 s on a busy CPU (Gemma 3 270M) for a load of 0.2 s. The
    calibration stops after the llama_decode call under way, which here waits for the load."""
    llm = _llama()
    llm.eval(gpl_tokens[:300])
    llm.n_tokens = 200  # rewound: not chunkable, stored whole behind the manifest
    assert chunks.save_chunked(llm, tmp_path / "ctx", levels=("lossless",), chunk_tokens=C).fallback
    llm.save_compressed_state(tmp_path / "whole.lcg", level="lossless")
    decode, load = stream._decode_tokens, stream.load_compressed_state
    loaded, calls = threading.Event(), []

    def decoded(*args: Any) -> bool:
        calls.append(args[1].size)
        loaded.wait(30)  # the calibration's first call outlasts the load
        return decode(*args)

    def loading(*args: Any, **kwargs: Any) -> Any:
        try:
            return load(*args, **kwargs)
        finally:
            loaded.set()

    monkeypatch.setattr(stream, "_speeds", {})  # not measured yet in this process
    monkeypatch.setattr(stream, "_decode_tokens", decoded)
    monkeypatch.setattr(stream, "load_compressed_state", loading)
    monkeypatch.setattr(chunks, "load_compressed_state", loading)
    report = stream.load_streaming(_llama(), (tmp_path / name).as_uri(), slo_s=60.0, prior_mbps=FAST)
    assert report.tokens == 200 and loaded.is_set()
    assert calls in ([], [8]) and stream._speeds == {}  # the warm-up at most; no speed kept


def test_cli_load_prints_the_report(stores_saved: dict[str, str]) -> None:
    load = [sys.executable, "-m", "llama_cachegen", "load", stores_saved["http"], "--slo", "60"]
    load += ["--n-ctx", "700", "--threads", "1", "--json"]
    for given in ([], ["--compute-tps", "123.5"]):  # a process measures its prefill unless told it
        proc = subprocess.run(load + given, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads(proc.stdout)
        assert report["tokens"] == N and len(report["chunks"]) == CHUNKS and report["slo_s"] == 60.0
        assert (report["calibrate_ms"] == 0) == bool(given)
    assert report["compute_tps"] == pytest.approx(123.5)
    # the text report says where a first load's time went (its chunks' times add up to little)
    proc = subprocess.run(load[:-1], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "prefill speed measured in" in proc.stdout, proc.stderr[-3000:]


def test_cli_load_counts_the_manifest_read_in_its_slo(
    stores_saved: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`load` reads the manifest first (it sizes the context from it), outside load_streaming's
    clock: a manifest that took 1.2 s of a 3 s SLO was not in the report's time."""
    from llama_cachegen import cli

    read_url = cli.read_url

    def slow_read(url: str) -> bytes:
        time.sleep(3.0)
        return read_url(url)

    monkeypatch.setattr(cli, "read_url", slow_read)
    args = ["load", stores_saved["http"], "--slo", "60", "--compute-tps", "1000", "--n-ctx", "700"]
    assert cli.main([*args, "--threads", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["total_ms"] >= 3000 and report["slo_s"] == 60.0 and report["slo_met"]


def test_cli_load_makes_the_context_the_saved_state_needs(gpl_tokens: list[int], tmp_path: Path) -> None:
    """A context saved with flash attention and q8_0 caches (and one saved whole): `load` made its
    context with llama-cpp-python's defaults, which refuse such a state, and had no option to
    make another."""
    llm = _llama(flash_attn=True, type_k=8, type_v=8)  # GGML_TYPE_Q8_0
    llm.eval(gpl_tokens[:200])
    url = f"{tmp_path.as_uri()}/ctx"
    chunks.save_chunked(llm, url, levels=("lossless",), chunk_tokens=C)
    llm.save_compressed_state(tmp_path / "whole.lcg", level="lossless")
    for source in (url, str(tmp_path / "whole.lcg")):
        proc = subprocess.run(
            [sys.executable, "-m", "llama_cachegen", "load", source, "--threads", "1", "--json"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(proc.stdout)["tokens"] == 200


# ---- the prefill speed model, the trace and the relay alone --------------------------------------


def test_prefill_speed_learns_the_slope_and_a_change_of_pace() -> None:
    """Pieces whose seconds per token grow with the position give that line back; a machine that
    turns slower is followed within a load's pieces; noise never makes the slope negative."""
    speed = stream._PrefillSpeed(1000.0, 128)  # calibrated: 1 ms per token, no slope yet
    assert speed.seconds(0, 64) == pytest.approx(0.064) and speed.seconds(1984, 2048) == pytest.approx(0.064)

    def true_s(p: int, q: int, a: float, c: float) -> float:
        return sum(a + c * x for x in range(p, q))

    a, c = 1.3e-3, 0.4e-3 / 2048  # 30% slower than calibrated, 40% slower again at 2,048
    for p in range(0, 2048, 32):
        speed.learn(p, p + 32, true_s(p, p + 32, a, c))
    assert speed.tps == pytest.approx(1 / a, rel=0.05)
    assert speed.seconds(1984, 2048) == pytest.approx(true_s(1984, 2048, a, c), rel=0.05)
    assert speed.seconds(1984, 2048) > 1.3 * speed.seconds(0, 64)
    for p in range(0, 640, 32):  # the load changes: twice as slow from here on, front pieces only
        speed.learn(p, p + 32, 2 * true_s(p, p + 32, a, c))
    assert speed.seconds(0, 64) == pytest.approx(2 * true_s(0, 64, a, c), rel=0.15)
    rng = np.random.default_rng(0)
    flat = stream._PrefillSpeed(1000.0, 128)
    for p in rng.integers(0, 2000, 200):  # no slope, 20% noise: never a negative one
        flat.learn(int(p), int(p) + 32, 0.032 * (1 + 0.2 * rng.standard_normal()))
        assert flat.c >= 0 and flat.seconds(0, 32) > 0
    assert flat.seconds(1968, 2000) == pytest.approx(0.032, rel=0.15)


def test_plans_that_miss_rank_by_their_end_then_by_the_smaller_fetch() -> None:
    """Among plans that miss the deadline and end within _TICK_S of the earliest (the CPU's part the
    later), the one whose fetch ends first wins, whatever its KL: a link slower than predicted
    still ends before the CPU, and a link done early races the CPU's chunk. Alike is measured from
    the earliest, not from one plan to the next: a run of plans each a little later than the one
    before does not walk the choice away from the earliest. A plan that fits wins outright."""

    def plan(at_risk: float, link_risk: float, cost: float) -> stream._Plan:
        return stream._Plan("x", 3, at_risk, cost, False, at_risk, link_risk)

    tick = stream._TICK_S
    cpu_bound = plan(2.30, 1.20, 5.0)  # CPU's part 2.30 s, its fetches (compact) done at 1.20 s
    balanced = plan(2.30 + tick / 2, 2.29, 3.0)  # lower KL, its fetches end near the CPU
    assert stream._pick([balanced, cpu_bound]) is cpu_bound
    sooner = plan(2.30 - 2 * tick, 2.20, 3.0)
    assert stream._pick([cpu_bound, balanced, sooner]) is sooner
    walk = [plan(1.0 + k * 0.8 * tick, 1.0 - 0.01 * k, 1.0) for k in range(10)]  # each 0.8 tick later
    assert stream._pick(walk) is walk[1]  # within a tick of the earliest, the smaller fetch
    fits = stream._Plan("x", 3, 9.0, 9.0, True, 9.0, 9.0)
    assert stream._pick([sooner, fits, cpu_bound]) is fits


def test_trace_transfer_times() -> None:
    trace = Trace.steps([(1.0, 1000.0), (2.0, 10.0), (math.inf, 500.0)])
    assert trace.rate_at(0.5) == 1000.0 and trace.rate_at(1.5) == 10.0 and trace.rate_at(99) == 500.0
    assert trace.transfer_s(0.0, 500) == pytest.approx(0.5)
    assert trace.transfer_s(0.5, 520) == pytest.approx(0.5 + 2.0)  # 500 B, then 20 B at 10 B/s
    assert trace.transfer_s(2.5, 5 + 1000) == pytest.approx(0.5 + 2.0)  # 5 B at 10 B/s, then 500 B/s
    assert Trace.constant(math.inf).transfer_s(3.0, 1e12) == 0.0
    rates = [r for _, r in Trace.random(10.0, 1000.0, 0.1, seed=1, duration_s=10).segments]
    assert len(rates) == 100 and min(rates) >= 10.0 and max(rates) <= 1000.0 and np.std(np.log(rates)) > 0.5
    with pytest.raises(InvalidArgumentError):
        Trace.steps([(1.0, 0.0)])


def test_a_failed_load_into_an_empty_sequence_leaves_it_empty(
    original: dict[str, Any], tmp_path: Path
) -> None:
    """The backup of an empty sequence has no cells, and llama.cpp clears a target only for a state
    with cells: the text chunks a failed load had computed stayed in sequence 1, uncounted."""
    url = tmp_path / "seq0"
    chunks.save_chunked(original["llm"], url, levels=("lossless",), chunk_tokens=C, seq_id=0)
    target = _llama(n_seq_max=2)
    memory = llama_cpp.llama_get_memory(target.ctx)

    def fail_after_text(record: stream.ChunkRecord) -> None:
        if record.level == stream.TEXT:
            raise RuntimeError("the caller's progress failed")

    with pytest.raises(RuntimeError, match="progress failed"):
        stream.load_streaming(
            target,
            url.as_uri(),
            seq_id=1,
            slo_s=60.0,
            prior_mbps=1e-3,  # a link that looks slow, a CPU that looks instant: text first
            compute_tps=1e6,
            progress=fail_after_text,
        )
    assert llama_cpp.llama_memory_seq_pos_max(memory, 1) == -1
