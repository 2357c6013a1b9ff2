"""CompressedStateCache as llama-cpp-python's prompt cache on the chunk store, shared by real
processes: prefix hits, no generation loss, LRU capacity, killed writers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest
from conftest import DEAD_WRITER, chunk_objects, greedy, smollm
from llama_cachegen import chunks, codec
from llama_cachegen.cache import CompressedStateCache
from llama_cachegen.chunks import PREFIX
from llama_cachegen.errors import InvalidArgumentError, StoreError
from llama_cachegen.llama import load_compressed_state
from llama_cachegen.model import sample_text
from llama_cachegen.stores import open_store
from llama_cachegen.stores.file import FileStore

C = 16  # small chunks keep the contexts short

_PROCESS_A = """
import sys
from llama_cachegen import CompressedStateCache, Llama
from llama_cachegen.model import default_model_path
llm = Llama(str(default_model_path()), n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False)
llm.set_cache(CompressedStateCache(sys.argv[1], level="lossless", chunk_tokens=16))
print(llm.create_completion(sys.argv[2], max_tokens=4, temperature=0.0)["choices"][0]["text"])
"""


def test_two_processes_share_one_directory(tmp_path: Path) -> None:
    store = tmp_path.as_uri()
    prompt = sample_text("gpl-3.0.txt")[:500]
    subprocess.run(
        [sys.executable, "-c", _PROCESS_A, store, prompt], check=True, capture_output=True, timeout=300
    )
    llm = smollm()
    cache = CompressedStateCache(store, level="lossless", chunk_tokens=C)
    llm.set_cache(cache)
    assert chunk_objects(cache) and cache.cache_size > 0
    question = prompt + " What is this text about?"
    llama_cpp.llama_perf_context_reset(llm.ctx)
    text = greedy(llm, question, 6)
    assert cache.hits == 1
    n_prompt = len(llm.tokenize(question.encode()))
    n_cached = len(llm.tokenize(prompt.encode()))
    evaluated = llama_cpp.llama_perf_context(llm.ctx).n_p_eval
    # the cached prefix was restored, not recomputed: at most the partial last chunk is evaluated again
    assert evaluated <= n_prompt - n_cached + C + 4
    llm.set_cache(None)
    llm.reset()
    assert greedy(llm, question, 6) == text


def test_hit_extend_save_cycles_never_encode_decoded_kv_again(tmp_path: Path) -> None:
    """Issue 7's generation loss: 20 hit-extend-save cycles at a lossy level. The chunks of the
    first context are never rewritten, so the restored prefix stays its first encoding, bit for bit
    (before, every save re-quantized it: KL 5x after 64 cycles)."""
    llm = smollm()
    cache = CompressedStateCache(tmp_path, level="balanced", chunk_tokens=C)
    llm.set_cache(cache)
    words = sample_text("gfdl-1.3.txt").split()
    prompt = " ".join(words[:40])
    llm.create_completion(prompt, max_tokens=1, temperature=0.0)
    first = chunk_objects(cache)
    tokens = llm.tokenize(prompt.encode())
    prefix = tokens[: len(tokens) // C * C]
    restored = cache[prefix].llama_state
    for i in range(20):
        prompt += " " + " ".join(words[40 + 3 * i : 43 + 3 * i])
        llm.reset()  # the prefix comes from the cache, decoded, every time
        llm.create_completion(prompt, max_tokens=1, temperature=0.0)
    assert cache.hits == 21
    now = chunk_objects(cache)
    assert {k: now[k] for k in first} == first  # the first context's chunks were never written again
    assert len(now) > len(first)  # the extensions were stored
    assert cache[prefix].llama_state == restored


@pytest.fixture(scope="module")
def states() -> list[llama_cpp.llama.LlamaState]:
    """Five contexts of 2 complete chunks each, differing from their first token."""
    llm = smollm()
    words = sample_text("gpl-3.0.txt").split()
    out = []
    for i in range(5):
        llm.reset()
        llm.eval(llm.tokenize(" ".join(words[10 * i : 10 * i + 30]).encode())[: 2 * C + 3])
        out.append(llm.save_state())
    return out


def _tokens(state: llama_cpp.llama.LlamaState) -> list[int]:
    return state.input_ids[: state.n_tokens].tolist()


def _room_for_three_and_a_half(
    tmp_path: Path, state: llama_cpp.llama.LlamaState
) -> tuple[CompressedStateCache, int]:
    """A cache in tmp_path/c with room for 3.5 contexts like `state`, and one context's bytes."""
    llm = smollm()
    probe = CompressedStateCache(tmp_path / "probe", level="lossless", chunk_tokens=C, model=llm)
    probe[_tokens(state)] = state
    entry = probe.cache_size
    cache = CompressedStateCache(
        tmp_path / "c", level="lossless", chunk_tokens=C, capacity_bytes=int(entry * 3.5), model=llm
    )
    return cache, entry


def test_a_lookup_asks_the_store_for_its_own_level_only(
    tmp_path: Path, states: list[llama_cpp.llama.LlamaState]
) -> None:
    """The cache asked whether each chunk was stored at every level, though it serves its own:
    four requests per chunk to an HTTP store, at every completion (105 chunks: 207 ms)."""
    llm = smollm()
    cache = CompressedStateCache(tmp_path, level="balanced", chunk_tokens=C, model=llm)
    tokens = _tokens(states[0])
    cache[tokens] = states[0]
    asked: list[str] = []
    exists = cache.store.exists
    cache.store.exists = lambda key: asked.append(key) or exists(key)  # type: ignore[method-assign]
    assert cache._find_longest_prefix_key(tuple(tokens + [13] * C)) == tuple(tokens[: 2 * C])
    assert len(asked) == 3 and all(key.endswith("/balanced") for key in asked)  # 2 chunks, then a miss


def test_kv_loaded_at_a_worse_level_is_not_cached_at_a_better_one(tmp_path: Path) -> None:
    """A context loaded at balanced, then given a lossless prompt cache: its K/V stored as the
    lossless chunks of its tokens would pass for exact (llama.lossy_level_anywhere). A balanced
    cache stores it as before."""
    llm = smollm()
    prompt = " ".join(sample_text("gfdl-1.3.txt").split()[:60])
    llm.eval(llm.tokenize(prompt.encode()))
    llm.save_compressed_state(tmp_path / "ctx.lcg", level="balanced")
    other = smollm()
    other.load_compressed_state(tmp_path / "ctx.lcg")
    for level, stored in (("lossless", False), ("balanced", True)):
        cache = CompressedStateCache(tmp_path / level, level=level, chunk_tokens=C)
        other.set_cache(cache)
        other.create_completion(prompt + " and", max_tokens=1, temperature=0.0)
        assert bool(chunk_objects(cache)) == stored, level


def test_a_store_that_fails_never_fails_the_completion(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Redis store nobody listens on: every lookup is a miss and every save is skipped, with a
    warning; the completion is returned as without a cache. After a failure the store is skipped
    for a while (a stalled store waited out its timeout at every lookup and every save: ~10 s per
    completion), then tried again. The while is an hour here: on a busy machine a completion
    took longer than the 10 s, and its save tried the store again."""
    from llama_cachegen import cache as cache_module
    from llama_cachegen.server import free_port

    monkeypatch.setattr(cache_module, "STORE_BACKOFF_S", 3600.0)
    prompt = " ".join(sample_text("gfdl-1.3.txt").split()[:40])
    plain = greedy(smollm(), prompt, 4)
    llm = smollm()
    cache = CompressedStateCache(f"redis://127.0.0.1:{free_port()}/0", level="balanced", chunk_tokens=C)
    llm.set_cache(cache)
    with caplog.at_level("WARNING", logger="llama_cachegen.cache"):
        assert greedy(llm, prompt, 4) == plain
        llm.reset()
        assert greedy(llm, prompt, 4) == plain
        assert [r.message for r in caplog.records if "store skipped" in r.message] == [
            caplog.records[0].message
        ]
        cache._down_until = 0.0  # the back-off over
        llm.reset()
        assert greedy(llm, prompt, 4) == plain
        assert sum("store skipped" in r.message for r in caplog.records) == 2
    assert (cache.hits, cache.misses) == (0, 3)


def test_eviction_keeps_the_byte_capacity_and_is_lru(
    tmp_path: Path, states: list[llama_cpp.llama.LlamaState]
) -> None:
    cache, entry = _room_for_three_and_a_half(tmp_path, states[0])
    for s in states[:3]:
        cache[_tokens(s)] = s
        time.sleep(0.01)
    time.sleep(0.01)
    assert cache[_tokens(states[0])].n_tokens == 2 * C  # a hit makes context 0 recent
    for s in states[3:]:
        time.sleep(0.01)
        cache[_tokens(s)] = s
        assert cache.cache_size <= cache.capacity_bytes
    # least recently used first: 1 and 2 go, 0 (hit after them) stays; FIFO would drop 0
    kept = [i for i, s in enumerate(states) if cache._match(_tokens(s)).chunks == 2]
    assert kept == [0, 3, 4]


def test_an_eviction_keeps_what_another_process_used_since_its_listing(
    tmp_path: Path, states: list[llama_cpp.llama.LlamaState], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process hits context 0 between this process's listing and its deletes: the listing
    had context 0 as the oldest, and it went though it was now the newest. It stays; the next
    oldest goes."""
    cache, _entry = _room_for_three_and_a_half(tmp_path, states[0])
    other = CompressedStateCache(tmp_path / "c", level="lossless", chunk_tokens=C, model=smollm())
    for s in states[:3]:
        cache[_tokens(s)] = s
        time.sleep(0.01)
    listed, hits = cache.store.list, []

    def stale(prefix: str = "") -> list[Any]:
        entries = listed(prefix)
        if not hits:
            time.sleep(0.01)
            hits.append(other[_tokens(states[0])].n_tokens)  # marks context 0 used
        return entries

    monkeypatch.setattr(cache.store, "list", stale)
    cache[_tokens(states[3])] = states[3]
    assert hits == [2 * C] and cache.cache_size <= cache.capacity_bytes
    kept = [i for i, s in enumerate(states[:4]) if cache._match(_tokens(s)).chunks == 2]
    assert kept == [0, 2, 3]


def test_a_cache_smaller_than_a_prompt_keeps_its_first_chunks(
    tmp_path: Path, states: list[llama_cpp.llama.LlamaState]
) -> None:
    """Room for less than one context: eviction takes the chain's last chunk first (its first ones
    are marked the most recent), so the context's first chunk still hits; losing that one instead
    would leave a tail no prompt can use."""
    llm = smollm()
    probe = CompressedStateCache(tmp_path / "probe", level="lossless", chunk_tokens=C, model=llm)
    tokens = _tokens(states[0])
    probe[tokens] = states[0]
    for capacity in (probe.cache_size - 1, int(probe.cache_size * 0.8)):
        cache = CompressedStateCache(
            tmp_path / f"c{capacity}", level="lossless", chunk_tokens=C, capacity_bytes=capacity, model=llm
        )
        cache[tokens] = states[0]
        assert 0 < cache.cache_size <= capacity
        assert cache._match(tokens).chunks == 1
        assert cache[tokens].n_tokens == C
        cache[tokens] = states[0]  # saved again: the same chunk evicted, the first kept
        assert cache._match(tokens).chunks == 1


def test_an_eviction_during_a_save_takes_its_tail_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process evicts (a cache of its own on the store) while a save writes, with room for
    less than the context: the save's statistics, skeleton and first chunks, written first, were the
    oldest and went first, and nothing of the context was left to hit (three processes, an
    890-token prompt into an 8 MB cache: 89 such losses in 127 completions). The tail goes first."""
    llm = smollm()
    words = sample_text("gpl-3.0.txt").split()
    tokens = llm.tokenize(" ".join(words[:120]).encode())[: 6 * C + 3]
    llm.eval(tokens)
    state = llm.save_state()
    probe = CompressedStateCache(tmp_path / "probe", level="lossless", chunk_tokens=C, model=llm)
    probe[tokens] = state
    capacity = int(probe.cache_size * 0.6)
    writer, other = (
        CompressedStateCache(
            tmp_path / "c", level="lossless", chunk_tokens=C, capacity_bytes=capacity, model=llm
        )
        for _ in range(2)
    )
    put, written = writer.store.put, []

    def evicted_meanwhile(key: str, data: bytes) -> None:
        put(key, data)
        if "/chunks/" in key:
            written.append(key)
            if len(written) == 5:
                other._evict()  # another process's save has ended

    monkeypatch.setattr(writer.store, "put", evicted_meanwhile)
    writer[tokens] = state
    assert len(written) == 6 and 0 < writer.cache_size <= capacity
    hit = writer[tokens]
    assert hit.n_tokens == writer._match(tokens).chunks * C >= 2 * C


def _save_four_chunks_and_evict_one(cache: CompressedStateCache, llm: Any, tokens: list[int]) -> None:
    """Saves the context of `tokens` (four chunks, two stored before), then evicts one object:
    the chain's last chunk must be the one that goes."""
    time.sleep(0.01)
    cache[tokens] = llm.save_state()
    assert cache._match(tokens).chunks == 4
    cache.capacity_bytes = cache.cache_size - 1
    cache._evict()
    assert cache[tokens].n_tokens == 3 * C


@pytest.mark.parametrize("kind", ["file", "http"])
def test_eviction_keeps_what_the_kept_chunks_of_an_extended_context_name(
    tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    """Hit, extend, save: the chunks stored before name the statistics and skeleton of their own
    save, which the new save does not write. Marked only at the hit, they were older than the
    whole chain, so the next eviction took them first and every hit through those chunks failed
    (and dropped them): now the save marks them after the chain, and the chain's tail goes first.
    On an HTTP store too, where the server marked entries only as it served them (in the order a
    hit reads: the chain's last chunk first)."""
    llm = smollm()
    words = sample_text("gpl-3.0.txt").split()
    tokens = llm.tokenize(" ".join(words[:80]).encode())[: 4 * C + 3]
    url = (
        tmp_path.as_uri()
        if kind == "file"
        else f"{request.getfixturevalue('http_server')[0]}/{tmp_path.name}"
    )
    cache = CompressedStateCache(url, level="lossless", chunk_tokens=C, model=llm)
    llm.eval(tokens[: 2 * C + 3])
    cache[tokens[: 2 * C + 3]] = llm.save_state()
    llm.eval(tokens[2 * C + 3 :])
    assert cache[tokens].n_tokens == 2 * C  # the hit llama-cpp-python looks up before it saves
    _save_four_chunks_and_evict_one(cache, llm, tokens)
    assert cache[tokens[: 2 * C + 1]].n_tokens == 2 * C


def test_a_save_through_chunks_another_process_stored_keeps_what_they_name(tmp_path: Path) -> None:
    """Another process stored the prompt's first chunks after this one looked it up (no hit to
    tell what they name): the save marked them used and not their statistics and skeleton, which
    the next eviction took first, and every hit through those chunks failed (three processes on
    one store: most of the "names ..., which the store lacks" losses left after the fix above).
    The save reads them; the chain's tail goes first."""
    llm = smollm()
    words = sample_text("gpl-3.0.txt").split()
    tokens = llm.tokenize(" ".join(words[:80]).encode())[: 4 * C + 3]
    llm.eval(tokens[: 2 * C + 3])
    CompressedStateCache(tmp_path, level="lossless", chunk_tokens=C, model=llm)[tokens[: 2 * C + 3]] = (
        llm.save_state()
    )
    llm.eval(tokens[2 * C + 3 :])
    cache = CompressedStateCache(tmp_path, level="lossless", chunk_tokens=C, model=llm)
    _save_four_chunks_and_evict_one(cache, llm, tokens)


def test_a_damaged_skeleton_keeps_the_chunks_that_name_it(tmp_path: Path) -> None:
    """A prompt of two chunks, then a longer one through them (its own chunks name its own
    skeleton). The first skeleton damaged where it is stored: it goes, and the short prompt misses,
    but its chunks are intact and stay: the long prompt still hits all four (they were removed)."""
    llm = smollm()
    words = sample_text("gpl-3.0.txt").split()
    tokens = llm.tokenize(" ".join(words[:80]).encode())[: 4 * C + 3]
    cache = CompressedStateCache(tmp_path, level="lossless", chunk_tokens=C, model=llm)
    llm.eval(tokens[: 2 * C + 3])
    cache[tokens[: 2 * C + 3]] = llm.save_state()
    (first,) = (tmp_path / PREFIX / "skeletons").iterdir()
    llm.eval(tokens[2 * C + 3 :])
    cache[tokens] = llm.save_state()
    first.write_bytes(first.read_bytes()[:-1] + b"?")
    with pytest.raises(KeyError):
        cache[tokens[: 2 * C + 1]]
    assert not first.exists() and cache[tokens].n_tokens == 4 * C


_WRITER = """
import sys
from llama_cachegen import CompressedStateCache, Llama
from llama_cachegen.model import default_model_path
llm = Llama(str(default_model_path()), n_ctx=512, n_threads=1, verbose=False)
llm.eval(llm.tokenize(b"The writer's context, repeated. " * 8))
state = llm.save_state()
cache = CompressedStateCache(sys.argv[1], level="lossless", chunk_tokens=16, model=llm)
print("ready", flush=True)
while True:  # both writers empty and refill the same chunks over and over
    cache.clear()
    cache[[]] = state
    print("filled", flush=True)
"""


def test_killed_writers_leave_no_torn_object(tmp_path: Path) -> None:
    """Two writers race on the same chunks and are SIGKILLed mid-stream: every visible object is
    whole, and a lookup is a clean hit or a clean miss."""
    command = [sys.executable, "-c", _WRITER, tmp_path.as_uri()]
    writers = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    for w in writers:
        assert w.stdout is not None and w.stdout.readline().strip() == "ready"
    for w in writers:  # each has filled the cache twice: killed while they race, not before
        assert w.stdout is not None and [w.stdout.readline().strip() for _ in range(2)] == ["filled"] * 2
    for w in writers:
        os.kill(w.pid, signal.SIGKILL)
        w.wait()
    llm = smollm()
    cache = CompressedStateCache(tmp_path.as_uri(), level="lossless", chunk_tokens=C, model=llm)
    for info in cache.store.list(PREFIX):
        codec.inspect(cache.store.get(info.key))  # every object is a whole container: checksums hold
    tokens = llm.tokenize(b"The writer's context, repeated. " * 8)
    hit = None
    if tokens in cache:  # else killed between a clear and the chunks: a clean miss
        # a clean miss too: one writer's chunks whose statistics or skeleton the other's clear
        # removed (KeyError, as llama-cpp-python expects of a cache)
        with contextlib.suppress(KeyError):
            hit = cache[tokens]
    if hit is not None:
        n = hit.n_tokens
        assert 0 < n <= len(tokens) and n % C == 0 and list(hit.input_ids[:n]) == tokens[:n]
    cache.store.sweep(max_age_s=0)
    assert all(p.name.startswith(PREFIX.rstrip("/")) for p in tmp_path.iterdir())


def test_cache_needs_its_model_and_keys_embed_the_fingerprint(
    tmp_path: Path, states: list[llama_cpp.llama.LlamaState]
) -> None:
    unbound = CompressedStateCache(tmp_path, chunk_tokens=C)
    with pytest.raises(InvalidArgumentError, match="model"):
        unbound[_tokens(states[0])] = states[0]
    bound = CompressedStateCache(tmp_path, chunk_tokens=C, model=smollm())
    bound[_tokens(states[0])] = states[0]
    assert [*_tokens(states[0]), 7] in bound
    other = CompressedStateCache(tmp_path, chunk_tokens=C, model=smollm(flash_attn=True))
    assert _tokens(states[0]) not in other and other.namespace != bound.namespace
    with pytest.raises(KeyError):
        other[_tokens(states[0])]


def test_partial_writes_count_against_capacity_and_dead_ones_go_at_once(
    tmp_path: Path, states: list[llama_cpp.llama.LlamaState]
) -> None:
    cache, entry = _room_for_three_and_a_half(tmp_path, states[0])
    subprocess.run(
        [sys.executable, "-c", DEAD_WRITER, str(tmp_path / "c"), f"{PREFIX}chunks/killed", str(entry)],
        check=True,
        timeout=60,
    )
    live = cache.store.begin_write(f"{PREFIX}chunks/in-progress")  # a writer still at work (this process)
    live.write(b"x" * entry)
    try:
        assert cache.cache_size == 2 * entry  # both temporaries take space
        for s in states[:3]:
            cache[_tokens(s)] = s
            assert cache.cache_size <= cache.capacity_bytes
        # the dead writer's temporary was swept on the first insert; the live one still counts
        (remaining,) = cache.store.temporaries()
        assert remaining.key.endswith("-in-progress")
        stored = [i for i, s in enumerate(states[:3]) if cache._match(_tokens(s)).chunks == 2]
        assert stored == [1, 2]  # 3.5 entries of room, one taken by the live write
    finally:
        live.abort()


def test_a_damaged_chunk_goes_and_the_chunks_before_it_serve(
    tmp_path: Path, states: list[llama_cpp.llama.LlamaState]
) -> None:
    """A chunk damaged where it is stored ends the prefix before it and is removed (the next save
    writes it again); the chunks before it, which other prompts share, stay and serve (the whole
    chain was dropped)."""
    cache = CompressedStateCache(tmp_path, level="balanced", chunk_tokens=C, model=smollm())
    tokens = _tokens(states[1])
    cache[tokens] = states[1]
    first, second = (chunks._chunk_key(k, "balanced") for k in cache._match(tokens).keys)

    def damage(key: str) -> None:
        blob = bytearray(cache.store.get(key))
        blob[-5] ^= 0x40
        cache.store.put(key, bytes(blob))

    damage(second)
    assert cache[tokens].n_tokens == C and (cache.hits, cache.misses) == (1, 0)
    assert not cache.store.exists(second) and cache.store.exists(first)
    damage(first)
    with pytest.raises(KeyError, match="unusable"):
        cache[tokens]
    assert not cache.store.exists(first) and (cache.hits, cache.misses) == (1, 1)
    cache[tokens] = states[1]  # written again, whole
    assert np.array_equal(cache[tokens].input_ids[: 2 * C], tokens[: 2 * C])


def test_a_hit_keeps_the_seed_and_is_recorded_at_its_level(tmp_path: Path) -> None:
    """A hit replaces the context's state: llama-cpp-python's load_state takes the seed from it,
    so it carries the Llama's own (a seed of 0 made every sampled answer after a hit the same, and
    another than without the cache); a balanced hit is recorded as a lossy load (else a lossless
    save of the context stored balanced K/V as its tokens' exact chunks)."""
    from llama_cachegen.llama import lossy_level

    prompt = " ".join(sample_text("gfdl-1.3.txt").split()[:60])
    answers, seeds = [], []
    for level in (None, "balanced", "balanced"):
        llm = smollm(seed=1234)
        cache = None if level is None else CompressedStateCache(tmp_path, level=level, chunk_tokens=C)
        llm.set_cache(cache)
        out = llm.create_completion(prompt, max_tokens=8, temperature=0.9, seed=None)
        answers.append(out["choices"][0]["text"])
        seeds.append(llm._seed)  # llama-cpp-python draws each completion's seed from the one before
    assert cache is not None and cache.hits == 1
    assert seeds[0] == seeds[1] == seeds[2]
    tokens = np.array(llm.tokenize(prompt.encode()), dtype=np.intc)
    assert lossy_level(llm, None, tokens) == "balanced"
    assert answers[0] == answers[1]  # the miss samples as without a cache


def test_a_chunk_evicted_during_a_hit_costs_that_chunk_only(
    tmp_path: Path, states: list[llama_cpp.llama.LlamaState]
) -> None:
    """Another process evicts the chain's last chunk between this cache's lookup and its read: the
    cache looks up again and hits the chunk before it (it dropped the whole chain, every chunk of
    which other prompts still needed, and missed)."""
    llm = smollm()
    cache = CompressedStateCache(tmp_path, level="lossless", chunk_tokens=C, model=llm)
    tokens = _tokens(states[0])
    cache[tokens] = states[0]
    lookup, evicted = cache._lookup, []

    def lookup_then_evict(key: Sequence[int]) -> Any:
        match = lookup(key)
        if not evicted:
            evicted.append(cache.store.delete(f"{PREFIX}chunks/{match.keys[-1]}/lossless"))
        return match

    cache._lookup = lookup_then_evict  # type: ignore[method-assign]
    assert cache[tokens].n_tokens == C and evicted == [True]
    assert (cache.hits, cache.misses) == (1, 0) and len(chunk_objects(cache)) == 1


@pytest.mark.parametrize("plain", [False, True])
def test_a_hit_that_is_not_loaded_keeps_the_lossy_record(tmp_path: Path, plain: bool) -> None:
    """A context holding a balanced load of a prompt completes it with a lossless prompt cache that
    holds the prompt's first chunk: llama-cpp-python looks the hit up but does not load it (the
    context holds more). The lookup recorded the context as exact, so the completion's save put
    the balanced K/V into the store as lossless chunks. Now a hit is recorded when loaded (a plain
    llama_cpp.Llama, which does not say: only ever worse)."""
    from llama_cachegen.llama import lossy_level

    prompt = " ".join(sample_text("gfdl-1.3.txt").split()[:40])
    writer = smollm()
    writer.set_cache(CompressedStateCache(tmp_path / "pc", level="lossless", chunk_tokens=C))
    tokens = writer.tokenize(prompt.encode())
    writer.create_completion(tokens[: C + 4], max_tokens=1, temperature=0.0)
    stored = chunk_objects(writer.cache)
    assert len(stored) == 1
    writer.reset()
    writer.eval(tokens)
    blob = writer.save_compressed_state(level="balanced")
    llm = llama_cpp.Llama(writer.model_path, n_ctx=512, n_threads=2, verbose=False) if plain else smollm()
    load_compressed_state(llm, blob)
    cache = CompressedStateCache(tmp_path / "pc", level="lossless", chunk_tokens=C, model=llm)
    llm.set_cache(cache)
    llm.create_completion(tokens + llm.tokenize(b" and then", add_bos=False), max_tokens=2, temperature=0.0)
    assert cache.hits == 1 and lossy_level(llm, None, np.asarray(tokens, np.intc)) == "balanced"
    assert chunk_objects(cache) == stored  # nothing balanced stored as lossless


def test_one_cache_serves_one_llama(tmp_path: Path) -> None:
    """Bound to a second Llama, a cache looked up under its fingerprint and loaded into the first
    (other RoPE: wrong answers; another n_ctx: a broken token list): refused. With logits_all the
    cached positions' rows are NaN (they were a flat -log(n_vocab): prompt logprobs that looked
    real)."""
    first = smollm()
    cache = CompressedStateCache(tmp_path, level="lossless", chunk_tokens=C)
    first.set_cache(cache)
    first.set_cache(cache)  # the same Llama again: fine
    with pytest.raises(InvalidArgumentError, match="another Llama"):
        smollm(n_ctx=256).set_cache(cache)
    prompt = " ".join(sample_text("gpl-3.0.txt").split()[:60])
    expected = greedy(first, prompt, 4)
    every = smollm(logits_all=True)
    every_cache = CompressedStateCache(tmp_path, level="lossless", chunk_tokens=C)
    every.set_cache(every_cache)
    assert greedy(every, prompt, 4) == expected and every_cache.hits == 1
    cached = len(every.tokenize(prompt.encode())) // C * C
    assert np.isnan(every.scores[: cached - 1]).all() and np.isfinite(every.scores[cached]).all()


def test_a_store_that_refuses_writes_still_serves_its_hits(tmp_path: Path) -> None:
    """A store that refuses writes (read-only, full) holding a prefix: a failed save of another
    prompt set the whole store aside for 10 s, and the hit it held was a miss meanwhile."""
    import errno

    class ReadOnly(FileStore):
        def _put(self, key: str, data: bytes) -> None:
            refused = OSError(errno.EROFS, "Read-only file system")
            raise StoreError(f"cannot write {key!r}: {refused.strerror}") from refused

    held = " ".join(sample_text("gpl-3.0.txt").split()[:60])
    other = " ".join(sample_text("gfdl-1.3.txt").split()[:60])
    writer = smollm()
    writer.set_cache(CompressedStateCache(tmp_path, level="lossless", chunk_tokens=C))
    expected = greedy(writer, held, 4)
    cache = CompressedStateCache(ReadOnly(tmp_path), level="lossless", chunk_tokens=C)
    llm = smollm()
    llm.set_cache(cache)
    greedy(llm, other, 4)  # a miss, and its save refused
    llm.reset()
    assert greedy(llm, held, 4) == expected and (cache.hits, cache.misses) == (1, 1)


class _FlakyStore(FileStore):
    """A file store whose chunk reads fail while `failing` (a timeout, a reset on the way)."""

    failing = False

    def get(self, key: str, max_size: int | None = None) -> bytes:
        if self.failing and "/chunks/" in key:
            raise StoreError(f"timed out reading {key!r}")
        return super().get(key, max_size)


def test_a_store_that_fails_during_a_hit_keeps_its_chunks(tmp_path: Path) -> None:
    """A read that fails on its way (a timeout, a reset) says nothing of the chunks: the hit is a
    miss and they stay (they were removed as damaged, from a store others share)."""

    prompt = " ".join(sample_text("gpl-3.0.txt").split()[:60])
    writer = smollm()
    writer.set_cache(CompressedStateCache(tmp_path, level="lossless", chunk_tokens=C))
    expected = greedy(writer, prompt, 4)
    store = _FlakyStore(tmp_path)
    cache = CompressedStateCache(store, level="lossless", chunk_tokens=C)
    before = chunk_objects(cache)
    llm = smollm()
    llm.set_cache(cache)
    store.failing = True
    assert greedy(llm, prompt, 4) == expected and (cache.hits, cache.misses) == (0, 1)
    store.failing = False
    assert {k: v for k, v in chunk_objects(cache).items() if k in before} == before
    cache._down_until = 0.0  # the store skipped after its failure: not any more
    llm.reset()
    assert greedy(llm, prompt, 4) == expected and cache.hits == 1


def test_a_chunk_refused_without_being_damaged_goes_and_the_chunks_before_it_serve(
    tmp_path: Path,
    states: list[llama_cpp.llama.LlamaState],
) -> None:
    """A chunk the reader refuses but does not remove (no tag where the cache's store has a key:
    not damaged where it is stored, so chunks.py leaves it) is dropped by the cache itself; the
    chunks before it stay and serve."""
    store = open_store(str(tmp_path), auth_key="cache key")
    cache = CompressedStateCache(store, level="balanced", chunk_tokens=C, model=smollm())
    tokens = _tokens(states[1])
    cache[tokens] = states[1]
    first, second = (chunks._chunk_key(k, "balanced") for k in cache._match(tokens).keys)
    plain = open_store(str(tmp_path), auth_key="")
    plain.put(second, plain.get(second))  # the same value, its tag dropped
    assert cache[tokens].n_tokens == C and (cache.hits, cache.misses) == (1, 0)
    assert not store.exists(second) and store.exists(first)


def test_a_read_that_fails_on_its_way_removes_no_chunk(
    tmp_path: Path,
    states: list[llama_cpp.llama.LlamaState],
) -> None:
    """A store error during a hit (a timeout, a reset) is a miss that keeps the chunks, seen right
    after the hit (through a completion, the save that follows writes removed chunks again)."""

    store = _FlakyStore(tmp_path)
    cache = CompressedStateCache(store, level="balanced", chunk_tokens=C, model=smollm())
    tokens = _tokens(states[1])
    cache[tokens] = states[1]
    before = chunk_objects(cache)
    assert len(before) == 2
    store.failing = True
    with pytest.raises(KeyError, match="not read"):
        cache[tokens]
    store.failing = False
    assert chunk_objects(cache) == before and (cache.hits, cache.misses) == (0, 1)


def test_a_prompt_cache_of_a_non_causal_context_stores_no_chunk(tmp_path: Path) -> None:
    """A non-causal context's K/V of a prefix saw the tokens after it: the prompt cache stores no
    chunk of it (as save_chunked saves such a state whole), and finds none."""

    non_causal = smollm(attention_type=llama_cpp.LLAMA_ATTENTION_TYPE_NON_CAUSAL)
    tokens = non_causal.tokenize(sample_text("gpl-3.0.txt").encode(), add_bos=True)[: 4 * C + 3]
    non_causal.eval(tokens)
    cache = CompressedStateCache(tmp_path, level="lossless", chunk_tokens=C, model=non_causal)
    cache[tokens] = non_causal.save_state()
    assert chunk_objects(cache) == {} and tokens not in cache


def test_chunks_of_a_sequence_save_are_no_prompt_cache_hit(tmp_path: Path) -> None:
    """A sequence save's chunks have the keys a prompt cache of the same size and level looks up,
    but their skeleton is a sequence state: llama-cpp-python's load_state would take it for the
    whole context's. The cache refuses it: a miss, its chunks dropped."""

    llm = smollm()
    tokens = llm.tokenize(sample_text("gpl-3.0.txt").encode(), add_bos=True)[: 2 * C]
    llm.eval(tokens)
    chunks.save_chunked(llm, f"file://{tmp_path}/ctx", levels=("balanced",), chunk_tokens=C, seq_id=0)
    cache = CompressedStateCache(tmp_path, level="balanced", chunk_tokens=C, model=smollm())
    assert cache._match(np.asarray(tokens, np.intc)).chunks == 2  # found by their keys
    with pytest.raises(KeyError, match="unusable"):
        cache[tokens]
    assert (cache.hits, cache.misses) == (0, 1) and cache._match(np.asarray(tokens, np.intc)).chunks == 0


def test_a_cache_exactly_at_its_capacity_evicts_nothing(
    tmp_path: Path,
    states: list[llama_cpp.llama.LlamaState],
) -> None:
    """capacity_bytes is the most the cache may hold: at exactly that, nothing goes."""
    cache = CompressedStateCache(tmp_path, level="balanced", chunk_tokens=C, model=smollm())
    tokens = _tokens(states[1])
    cache[tokens] = states[1]
    size = cache.cache_size
    cache.capacity_bytes = size
    cache._evict()
    assert cache.cache_size == size and cache._match(tokens).chunks == 2
    cache.capacity_bytes = size - 1
    cache._evict()
    assert cache.cache_size < size
