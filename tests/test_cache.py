"""CompressedStateCache as llama-cpp-python's prompt cache, shared by real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import llama_cpp
import pytest
from llama_cachegen import codec
from llama_cachegen.cache import CompressedStateCache
from llama_cachegen.llama import Llama
from llama_cachegen.model import default_model_path, sample_text

_PROCESS_A = """
import sys
from llama_cachegen import CompressedStateCache, Llama
from llama_cachegen.model import default_model_path
llm = Llama(str(default_model_path()), n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False)
llm.set_cache(CompressedStateCache(sys.argv[1], level="lossless"))
print(llm.create_completion(sys.argv[2], max_tokens=4, temperature=0.0)["choices"][0]["text"])
"""


def _llama() -> Llama:
    return Llama(str(default_model_path()), n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False)


def test_two_processes_share_one_directory(tmp_path: Path) -> None:
    store = tmp_path.as_uri()
    prompt = sample_text("gpl-3.0.txt")[:500]
    subprocess.run(
        [sys.executable, "-c", _PROCESS_A, store, prompt], check=True, capture_output=True, timeout=300
    )
    llm = _llama()
    cache = CompressedStateCache(store, level="lossless")
    llm.set_cache(cache)
    assert len(cache._entries()) == 1 and cache.cache_size > 0
    question = prompt + " What is this text about?"
    llama_cpp.llama_perf_context_reset(llm.ctx)
    text = llm.create_completion(question, max_tokens=6, temperature=0.0)["choices"][0]["text"]
    assert cache.hits == 1
    n_prompt = len(llm.tokenize(question.encode()))
    n_cached = len(llm.tokenize(prompt.encode()))
    evaluated = llama_cpp.llama_perf_context(llm.ctx).n_p_eval
    assert evaluated <= n_prompt - n_cached + 4  # the cached prefix was restored, not recomputed
    llm.set_cache(None)
    llm.reset()
    assert llm.create_completion(question, max_tokens=6, temperature=0.0)["choices"][0]["text"] == text


@pytest.fixture(scope="module")
def state() -> llama_cpp.llama.LlamaState:
    llm = _llama()
    llm.eval(llm.tokenize(b"A short context for cache entries."))
    return llm.save_state()


def test_eviction_keeps_the_byte_capacity_and_is_lru(
    tmp_path: Path, state: llama_cpp.llama.LlamaState
) -> None:
    probe = CompressedStateCache(tmp_path / "probe", level="lossless")
    probe[[1, 2, 3]] = state
    entry = probe.cache_size
    cache = CompressedStateCache(tmp_path / "c", level="lossless", capacity_bytes=int(entry * 3.5))
    for i in range(3):
        cache[[100 + i, 1, 2]] = state
        time.sleep(0.01)
    assert [100, 1, 2, 7] in cache and cache[
        [100, 1, 2, 7]
    ].n_tokens == state.n_tokens  # a hit makes 100 recent
    for i in range(3, 5):
        time.sleep(0.01)
        cache[[100 + i, 1, 2]] = state
        assert cache.cache_size <= cache.capacity_bytes
    # least recently used first: 101 and 102 go, 100 (hit after them) stays; FIFO would drop 100
    kept = {cache._find_longest_prefix_key((100 + i, 1, 2)) for i in range(5)} - {None}
    assert kept == {(100, 1, 2), (103, 1, 2), (104, 1, 2)}
    assert [101, 1, 2] not in cache


_WRITER = """
import sys
from llama_cachegen import CompressedStateCache, Llama
from llama_cachegen.model import default_model_path
llm = Llama(str(default_model_path()), n_ctx=512, n_threads=1, verbose=False)
llm.eval(llm.tokenize(b"The writer's context, repeated. " * 8))
state = llm.save_state()
cache = CompressedStateCache(sys.argv[1], level="lossless")
print("ready", flush=True)
i = 0
while True:
    cache[[int(sys.argv[2]), i % 3]] = state  # a few keys over and over, shared by both writers
    i += 1
"""


def test_killed_writers_leave_no_torn_entry(tmp_path: Path) -> None:
    """Two writers race on the same keys and are SIGKILLed mid-stream: every visible entry loads."""
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, tmp_path.as_uri(), "7"], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    for w in writers:
        assert w.stdout.readline().strip() == "ready"
    time.sleep(1.5)
    for w in writers:
        os.kill(w.pid, signal.SIGKILL)
        w.wait()
    cache = CompressedStateCache(tmp_path.as_uri())
    names = cache._entries()
    assert names
    for name in names:
        blob = cache.store.get(name + ".lcg")
        assert codec.decode(blob)  # every checksum holds
    for i in range(3):
        assert cache[[7, i, 5]].n_tokens > 0
    assert all(p.name.startswith((".tmp-", "default")) for p in tmp_path.iterdir())


def test_cache_is_namespaced_by_model_fingerprint(tmp_path: Path, state: llama_cpp.llama.LlamaState) -> None:
    unbound = CompressedStateCache(tmp_path)
    unbound[[1, 2, 3]] = state
    bound = CompressedStateCache(tmp_path, model=_llama())
    assert [1, 2, 3] not in bound  # written without a model: not visible to a bound cache
    bound[[1, 2, 3]] = state
    assert [1, 2, 3, 4] in bound and bound.namespace != "default"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["default", bound.namespace])


_DEAD_WRITER = """
import os, sys
from llama_cachegen.stores.file import FileStore
FileStore(sys.argv[1]).begin_write("default/killed.lcg").write(b"x" * int(sys.argv[2]))
os._exit(0)  # dies mid-write: the temporary stays
"""


def test_partial_writes_count_against_capacity_and_dead_ones_go_at_once(
    tmp_path: Path, state: llama_cpp.llama.LlamaState
) -> None:
    probe = CompressedStateCache(tmp_path / "probe", level="lossless")
    probe[[1, 2, 3]] = state
    entry = probe.cache_size
    cache = CompressedStateCache(tmp_path / "c", level="lossless", capacity_bytes=int(entry * 3.5))
    subprocess.run(
        [sys.executable, "-c", _DEAD_WRITER, str(tmp_path / "c"), str(entry)], check=True, timeout=60
    )
    live = cache.store.begin_write("default/in-progress.lcg")  # a writer still at work (this process)
    live.write(b"x" * entry)
    try:
        assert cache.cache_size == 2 * entry  # both temporaries take space
        for i in range(3):
            cache[[200 + i, 1]] = state
            assert cache.cache_size <= cache.capacity_bytes
        # the dead writer's temporary was swept on the first insert; the live one still counts
        (remaining,) = cache.store.temporaries()
        assert remaining.key.endswith("-in-progress.lcg")
        assert len(cache._entries()) == 2  # 3.5 entries of room, one taken by the live write
    finally:
        live.abort()
