"""The sharing proxy against real processes on 127.0.0.1: two llama-servers (built from
llama-cpp-python's llama.cpp), a proxy before each, one redis-server as the shared store."""

from __future__ import annotations

import functools
import http.client
import json
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tiny_models
from conftest import kv_cache_bytes, seq_buffer
from llama_cachegen import chunks
from llama_cachegen.chunks import PREFIX
from llama_cachegen.errors import CacheGenError, CorruptDataError, StoreError, UnsupportedFormatError
from llama_cachegen.model import sample_text
from llama_cachegen.proxy import (
    RESTORED_HEADER,
    STATS_PATH,
    LossyRestores,
    Sharing,
    _no_cache_reuse,
    _timings,
    common_prefix,
    read_slot_file,
    seq_buffer_to_slot_file,
    slot_file_to_seq_buffer,
)
from llama_cachegen.server import Processes, free_port, http_status, post_json
from llama_cachegen.stores import STORE_BACKOFF_S, Store, open_store
from llama_cachegen.stores.file import FileStore

CHUNK = 128
N_CTX = 2048


# ---- slot files and helpers (no server) ---------------------------------------------------------


def _memory() -> bytes:
    return struct.pack("<II", 1, 0)  # one stream, no cells


def test_slot_file_plain_and_packed_tokens() -> None:
    tokens = [1, 50, 60, 70]
    plain = struct.pack("<III", 0x67677371, 3, 4) + struct.pack("<4i", *tokens) + _memory()
    got, offset = read_slot_file(plain)
    assert got.tolist() == tokens and plain[offset:] == _memory()
    # llama-server's own packing: -1, version 1, count, tokens, no media
    words = [-1, 1, 4, *tokens, 0]
    packed = (
        struct.pack("<III", 0x67677371, 3, len(words)) + struct.pack(f"<{len(words)}i", *words) + _memory()
    )
    got, offset = read_slot_file(packed)
    assert got.tolist() == tokens and packed[offset:] == _memory()
    seq_tokens, seq = slot_file_to_seq_buffer(packed)
    assert seq[:8] == struct.pack("<Ii", 0xAF143CD8, 0) and seq[8:] == _memory()
    assert seq_buffer_to_slot_file(seq, seq_tokens) == plain


def test_sliding_window_slots_are_not_shared_and_say_why(tmp_path: Path) -> None:
    """Two KV caches whose cells cover different positions (a sliding-window model's slot keeps
    the window only): the upload refuses with the reason, nothing is stored."""
    rng = np.random.default_rng(0)
    memory = kv_cache_bytes(rng, cells_per_stream=(40,)) + kv_cache_bytes(rng, cells_per_stream=(16,))
    slot = seq_buffer_to_slot_file(seq_buffer(memory), np.arange(40, dtype=np.int32))
    fingerprint = {"arch": "test", "n_layer": 2, "n_embd": 64}
    sharing = Sharing((tmp_path / "store").as_uri(), fingerprint, 64, chunk_tokens=16)
    with pytest.raises(UnsupportedFormatError, match="sliding-window"):
        sharing.upload(slot)
    assert not (tmp_path / "store").exists()  # refused before the store was opened


def test_a_prefix_whose_last_chunk_names_a_lost_skeleton_loads_the_chunks_before(tmp_path: Path) -> None:
    """A 48-token slot, then an 80-token one that starts with it (its first three chunks exist:
    skipped, they name the first upload's skeleton). The second skeleton lost (evicted, deleted):
    the load ends the prefix before the chunk that names it, and loads the 48 tokens. It raised,
    so the proxy set the store aside for every request, again at every request with that prefix."""
    rng = np.random.default_rng(0)
    fingerprint = {"arch": "test", "n_layer": 2, "n_embd": 64, "type_k": "f16", "type_v": "f16"}
    sharing = Sharing((tmp_path / "store").as_uri(), fingerprint, 256, chunk_tokens=16)
    tokens = np.arange(100, 180, dtype=np.int32)
    for n in (48, 80):
        sharing.upload(
            seq_buffer_to_slot_file(seq_buffer(kv_cache_bytes(rng, cells_per_stream=(n,))), tokens[:n])
        )
    skeletons = sorted((tmp_path / "store" / PREFIX / "skeletons").iterdir(), key=lambda p: p.stat().st_mtime)
    assert len(skeletons) == 2
    skeletons[1].unlink()
    loaded = sharing.load(tokens, 0)
    assert loaded.slot_file is not None and loaded.positions == 48 and loaded.chunks == 3
    assert np.array_equal(read_slot_file(loaded.slot_file)[0], tokens[:48])
    skeletons[0].unlink()  # nothing left that loads: a miss, not an error
    assert sharing.load(tokens, 0).slot_file is None


_TEST_FINGERPRINT = {"arch": "test", "n_layer": 2, "n_embd": 64, "type_k": "f16", "type_v": "f16"}


def _stored_bytes(store: Path) -> int:
    return sum(f.stat().st_size for f in (store / PREFIX).rglob("*") if f.is_file())


def _contexts(*firsts: int) -> list[tuple[np.ndarray, bytes]]:
    """48-token slot files of random K/V, tokens first..first+47: (tokens, slot file) each."""
    rng = np.random.default_rng(0)
    out = []
    for first in firsts:
        tokens = np.arange(first, first + 48, dtype=np.int32)
        memory = kv_cache_bytes(rng, cells_per_stream=(48,))
        out.append((tokens, seq_buffer_to_slot_file(seq_buffer(memory), tokens)))
    return out


def test_a_capacity_evicts_the_least_recently_used_prefixes_after_uploads(tmp_path: Path) -> None:
    """The proxy's store grew for good (a leak review: 4.4 MB per distinct 300-token prompt). With
    `capacity_bytes` each upload ends with the chunk objects under it, the least recently used
    (uploaded or loaded) prefix evicted first."""
    store = tmp_path / "store"
    a, b, c = _contexts(100, 200, 300)
    probe = Sharing(store.as_uri(), _TEST_FINGERPRINT, 256, chunk_tokens=16)
    assert probe.upload(a[1])["evicted_bytes"] == 0  # no capacity: nothing deleted
    one = _stored_bytes(store)
    shutil.rmtree(store)
    sharing = Sharing(store.as_uri(), _TEST_FINGERPRINT, 256, chunk_tokens=16, capacity_bytes=int(2.5 * one))
    for _, slot in (a, b):
        assert sharing.upload(slot)["evicted_bytes"] == 0
        time.sleep(0.01)
    loaded = sharing.load(a[0], 0)  # a's chunks at the level loaded: now used more recently than b's
    assert loaded.positions == 48 and list(loaded.levels) == ["high"]
    done = sharing.upload(c[1])
    assert done["evicted_bytes"] > 0 and _stored_bytes(store) <= 2.5 * one
    with open_store(store.as_uri()) as s:

        def whole(tokens: np.ndarray, *levels: str) -> bool:  # every chunk object of the prefix
            keys = chunks.chain_keys(_TEST_FINGERPRINT, tokens, 16)
            return all(s.exists(chunks._chunk_key(k, lv)) for k in keys for lv in levels)

        # b (uploaded before a was loaded) went first
        assert whole(a[0], "high") and whole(c[0], "high", "balanced") and not whole(b[0], "high", "balanced")
    for tokens, _ in (a, c):
        loaded = sharing.load(tokens, 0)
        assert loaded.positions == 48 and np.array_equal(read_slot_file(loaded.slot_file)[0], tokens)


@pytest.mark.parametrize("remembers", [True, False])
def test_an_upload_of_stored_chunks_marks_what_they_name(tmp_path: Path, remembers: bool) -> None:
    """An upload that found every chunk stored marked the chunks used, not the statistics and
    skeleton they name (an earlier save's): those stayed the oldest objects, an eviction took
    them first, and the most recently used prefix lost every chunk at its next load (a review).
    A proxy that uploaded or loaded the chunks remembers what they name; another reads it."""
    store = tmp_path / "store"
    (a_tokens, a), (b_tokens, b) = _contexts(100, 200)
    first = Sharing(store.as_uri(), _TEST_FINGERPRINT, 256, chunk_tokens=16)
    for slot in (a, b):
        first.upload(slot)
        time.sleep(0.01)
    again = first if remembers else Sharing(store.as_uri(), _TEST_FINGERPRINT, 256, chunk_tokens=16)
    assert again.upload(a)["objects_written"] == 0
    assert open_store(store.as_uri()).evict(PREFIX, _stored_bytes(store) // 2) > 0
    assert again.load(a_tokens, 0).positions == 48  # the most recently used: whole
    assert again.load(b_tokens, 0).positions < 48


def test_an_eviction_that_fails_leaves_the_upload_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose listing or delete fails during the eviction after an upload: the chunks are
    stored, so the upload stands (it counted as failed and set the store aside for 10 s)."""

    def evict(self: Store, prefix: str, capacity_bytes: int) -> int:
        raise StoreError("listing refused")

    monkeypatch.setattr(FileStore, "evict", evict)
    ((tokens, slot),) = _contexts(100)
    sharing = Sharing(
        (tmp_path / "store").as_uri(), _TEST_FINGERPRINT, 256, chunk_tokens=16, capacity_bytes=1
    )
    done = sharing.upload(slot)
    assert done["objects_written"] > 0 and done["evicted_bytes"] == 0
    assert sharing.load(tokens, 0).positions == 48


def test_slot_file_refusals() -> None:
    with pytest.raises(CorruptDataError):
        read_slot_file(b"ggsq")
    with pytest.raises(CorruptDataError):
        read_slot_file(struct.pack("<III", 0x67677371, 2, 0))
    with pytest.raises(CorruptDataError):  # more token words declared than bytes
        read_slot_file(struct.pack("<III", 0x67677371, 3, 1000))
    media = [-1, 1, 1, 5, 1, 0]  # one media chunk
    with pytest.raises(CorruptDataError, match="media"):
        read_slot_file(struct.pack("<III", 0x67677371, 3, len(media)) + struct.pack("<6i", *media))


def test_helpers() -> None:
    a = np.array([1, 2, 3, 4], dtype=np.intc)
    assert common_prefix(a, np.array([1, 2, 9], dtype=np.intc)) == 2
    assert common_prefix(a, a[:0]) == 0 and common_prefix(a, a) == 4
    sse = b'data: {"x":1}\n\ndata: {"timings":{"prompt_n":12,"predicted_n":5,"prompt_per_second":1e3}}\n\n'
    assert _timings(sse) == {"prompt_n": 12.0, "predicted_n": 5.0, "prompt_per_second": 1000.0}
    body, raw = _no_cache_reuse(b'{"prompt": "x", "n_cache_reuse": 16}')
    assert body["n_cache_reuse"] == json.loads(raw)["n_cache_reuse"] == 0
    for other in (b"[1, 2]", b"not json", b'"x"'):
        assert _no_cache_reuse(other)[1] == other
    # 1e400 parses as inf, which would be written back as Infinity: passed as it came
    assert _no_cache_reuse(b'{"top_p": 1e400}') == (None, b'{"top_p": 1e400}')


def test_lossy_restores_count_where_a_prompt_reused_their_lossy_positions() -> None:
    restores = LossyRestores()
    tokens = np.arange(100, 400, dtype=np.intc)
    n = int(tokens.size)
    restores.add(tokens[:256], 128, "high")  # K/V exact up to 128, then high
    assert restores.level(tokens, n) == "high" and restores.level(tokens[:129], 129) == "high"
    assert restores.level(tokens[:128], 128) is None  # only its exact positions: none of its lossy K/V
    assert restores.level(tokens, 128) is None  # the server computed everything past them itself
    other = tokens.copy()
    other[100] = 7
    assert restores.level(other, n) is None
    restores.add(tokens[:200], 128, "balanced")
    restores.add(tokens[:50], 4, "compact")  # the first 4 positions (attention sinks) came back exact
    assert restores.level(tokens, n) == "compact" and restores.level(other, n) == "compact"
    assert restores.level(other, 4) is None and restores.level(tokens[1:], n) is None
    restores.clear()
    assert restores.level(tokens, n) is None


def test_every_file_of_a_split_model_is_watched(tmp_path: Path) -> None:
    """A model file written again in place stops sharing (the proxy cannot tell which weights the
    server runs): a split model's second file too (only the first was watched)."""
    from llama_cachegen.proxy import Proxy

    files = [tmp_path / f"m-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    for f in files:
        f.write_bytes(b"x")
    proxy = Proxy("http://127.0.0.1:9", tmp_path, str(tmp_path / "store"))
    proxy._fingerprinted = str(files[0])
    before = proxy._model_file()
    assert before is not None and len(before) == 3
    files[1].write_bytes(b"yy")
    assert proxy._model_file() not in (before, None)
    files[2].unlink()
    assert proxy._model_file() is None


def test_refuses_public_listen_without_token(tmp_path: Path) -> None:
    """Its clients' token is LLAMA_CACHEGEN_PROXY_TOKEN's (or --token-file's): LLAMA_CACHEGEN_TOKEN is
    an HTTP store's, which the proxy took for its clients' too (a loopback proxy on a token store
    then refused every client that did not send the store's token)."""
    argv = [sys.executable, "-m", "llama_cachegen", "proxy", "--server", "http://127.0.0.1:9", "--slot-dir",
            str(tmp_path), "--store", str(tmp_path), "--listen", "0.0.0.0:0"]  # fmt: skip
    for env in ({}, {"LLAMA_CACHEGEN_TOKEN": "the-store-token-0123456789"}):
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=60, env=_env_without_token() | env
        )
        assert proc.returncode == 1 and "without a token" in proc.stderr and "PROXY_TOKEN" in proc.stderr


def _env_without_token() -> dict[str, str]:
    import os

    tokens = ("LLAMA_CACHEGEN_TOKEN", "LLAMA_CACHEGEN_PROXY_TOKEN")
    return {k: v for k, v in os.environ.items() if k not in tokens}


# ---- processes ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_server() -> Path:
    from llama_cachegen.errors import CacheGenError
    from llama_cachegen.server import llama_server_path

    try:
        return llama_server_path(build=False)
    except CacheGenError:
        pass
    try:  # built once (minutes); skipped only when it cannot be
        return llama_server_path(build=True)
    except CacheGenError as exc:
        pytest.skip(f"llama-server is missing and could not be built: {exc}")


@dataclass
class Node:
    server: str  # llama-server URL
    proxy: str  # proxy URL
    slot_dir: Path


class Cluster(Processes):
    """The module's llama-servers and proxies (llama_cachegen.server.Processes), its settings."""

    def __init__(self, binary: Path, root: Path) -> None:
        super().__init__(root)
        self.binary = binary

    def server(
        self, name: str, model: Path | None = None, *extra: str, port: int | None = None
    ) -> tuple[str, Path]:
        return self.llama_server(name, self.binary, N_CTX, model, *extra, port=port)

    def proxy_of(self, server: str, slot_dir: Path, store: str, *extra: str) -> str:
        settings = ("--levels", "lossless", "--chunk-tokens", str(CHUNK), "--threads", "2", *extra)
        return self.proxy(str(len(self.procs)), server, slot_dir, store, *settings, env=_env_without_token())


@pytest.fixture(scope="module")
def cluster(llama_server: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(llama_server, tmp_path_factory.mktemp("proxy"))
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def nodes(cluster: Cluster, redis_url: str) -> tuple[Node, Node]:
    store = f"{redis_url}?prefix=proxy-test:"
    out = []
    for name in ("a", "b"):
        server, slot_dir = cluster.server(name)
        out.append(Node(server, cluster.proxy_of(server, slot_dir, store), slot_dir))
    return out[0], out[1]


_post = functools.partial(post_json, timeout=120.0)


def _stats(proxy: str) -> dict[str, Any]:
    return json.loads(http_status(proxy + STATS_PATH)[1])


def _wait_uploads(proxy: str, uploads: int, timeout: float = 90.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = _stats(proxy)
        if stats["uploads"] + stats["upload_errors"] >= uploads and not stats["pending_uploads"]:
            return stats
        time.sleep(0.2)
    raise TimeoutError(f"{proxy}: uploads not done: {_stats(proxy)}")


def _tokenize(server: str, text: str, add_special: bool) -> list[int]:
    return _post(server + "/tokenize", {"content": text, "add_special": add_special})[0]["tokens"]


def _tiny_body(n_tokens: int) -> dict[str, Any]:
    """A greedy completion of tiny_models' first tokens, letters only (see tiny_models)."""
    return {
        "prompt": tiny_models.TOKENS[:n_tokens],
        "n_predict": 4,
        "temperature": 0.0,
        "cache_prompt": True,
        "logit_bias": [[t, False] for t in tiny_models.LETTERS_ONLY],
    }


def _complete(url: str, prompt: Any, **extra: Any) -> tuple[dict[str, Any], dict[str, str]]:
    body = {"prompt": prompt, "n_predict": 12, "temperature": 0.0, "cache_prompt": True, **extra}
    return _post(url + "/completion", body)


# ---- sharing through two proxies ----------------------------------------------------------------


def test_shared_prefix_lossless(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    text = _tokenize(a.server, sample_text("gpl-3.0.txt"), add_special=True)
    prefix = text[: 4 * CHUNK]  # chunk-aligned: B then computes exactly what a raw slot copy leaves
    q_a = _tokenize(a.server, " Who publishes this license?\nAnswer:", add_special=False)
    q_b = _tokenize(a.server, "\n\nQuestion: What is the name of this license?\nAnswer:", add_special=False)
    assert q_a[0] != q_b[0]

    out_a, headers_a = _complete(a.proxy, prefix + q_a)
    assert headers_a[RESTORED_HEADER] == "0" and out_a["timings"]["prompt_n"] == len(prefix + q_a)
    up = _wait_uploads(a.proxy, 1)
    assert up["uploads"] == 1 and up["objects_written"] >= 4 + 2  # 4 chunks, statistics, skeleton
    assert up["bytes_written"] > 0

    out_b, headers_b = _complete(b.proxy, prefix + q_b)
    assert headers_b[RESTORED_HEADER] == str(len(prefix))
    assert out_b["timings"]["prompt_n"] == len(q_b)  # only the suffix evaluated
    stats_b = _stats(b.proxy)
    assert stats_b["restores"] == 1 and stats_b["bytes_read"] > 0

    # cache_prompt false asks for a cold prefill: passed through, nothing restored
    before = _stats(b.proxy)
    cold, headers_cold = _complete(b.proxy, prefix + q_b, cache_prompt=False)
    assert RESTORED_HEADER not in headers_cold and cold["timings"]["prompt_n"] == len(prefix + q_b)
    assert _stats(b.proxy)["restores"] == before["restores"]

    # the reference: A's raw slot file restored into B, the same request straight to B
    _post(a.server + "/slots/0?action=save", {"filename": "raw-a.bin"})
    shutil.copyfile(a.slot_dir / "raw-a.bin", b.slot_dir / "raw-a.bin")
    _post(b.server + "/slots/0?action=restore", {"filename": "raw-a.bin"})
    ref, _ = _complete(b.server, prefix + q_b, id_slot=0)
    assert ref["timings"]["prompt_n"] == len(q_b)
    assert out_b["content"] == ref["content"] and out_b["content"]
    print(
        f"\nA: {len(prefix + q_a)} prompt tokens in {out_a['timings']['prompt_ms']:.0f} ms; uploaded "
        f"{up['bytes_written'] / 1e3:.0f} KB; B: restored {len(prefix)} tokens "
        f"({stats_b['bytes_read'] / 1e3:.0f} KB, {stats_b['load_ms']:.0f} ms), evaluated "
        f"{out_b['timings']['prompt_n']} in {out_b['timings']['prompt_ms']:.0f} ms"
    )


def test_a_restarted_server_gets_the_prefix_restored(cluster: Cluster, redis_url: str) -> None:
    """The proxy recorded what its server's slot held; the server restarts and holds nothing: the
    next request is restored from the store, not computed in full on the proxy's stale record."""
    server, slot_dir = cluster.server("restart")
    proc = cluster.procs[-1]
    proxy = cluster.proxy_of(server, slot_dir, f"{redis_url}?prefix=proxy-restart:")
    prompt = _tokenize(server, sample_text("gfdl-1.3.txt"), add_special=True)[: 3 * CHUNK + 5]
    first, headers = _complete(proxy, prompt)
    assert headers[RESTORED_HEADER] == "0" and first["timings"]["prompt_n"] == len(prompt)
    _wait_uploads(proxy, 1)
    again, headers = _complete(proxy, prompt)  # the slot holds it: nothing to restore
    assert headers[RESTORED_HEADER] == "0" and again["timings"]["prompt_n"] <= 1

    proc.terminate()
    proc.wait(30)
    assert cluster.server("restart", port=int(server.rsplit(":", 1)[1]))[0] == server
    after, headers = _complete(proxy, prompt)
    assert headers[RESTORED_HEADER] == str(3 * CHUNK)
    assert after["timings"]["prompt_n"] == len(prompt) - 3 * CHUNK and after["content"]


def test_unstored_prefix_passes_through(nodes: tuple[Node, Node]) -> None:
    _, b = nodes
    prompt = sample_text("gfdl-1.3.txt")[:1200]
    n = len(_tokenize(b.server, prompt, add_special=True))
    out, headers = _complete(b.proxy, prompt)
    assert headers[RESTORED_HEADER] == "0"
    assert out["timings"]["prompt_n"] >= n - 1 and out["content"]  # the first token may be cached
    # other endpoints go through untouched
    status, body = http_status(b.proxy + "/v1/models")
    assert status == 200 and json.loads(body)["data"]
    assert http_status(b.proxy + "/health")[0] == 200


def _status_and_text(url: str, body: dict[str, Any]) -> tuple[int, str]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _status_of(url: str, body: dict[str, Any]) -> int:
    return _status_and_text(url, body)[0]


def test_a_prompt_over_the_context_goes_straight_to_the_server(nodes: tuple[Node, Node]) -> None:
    """Nothing restored for a prompt the server refuses: the same answer as the server's."""
    a, _ = nodes
    prompt = sample_text("gpl-3.0.txt")[:16000]
    assert len(_tokenize(a.server, prompt, add_special=True)) > N_CTX
    before = _stats(a.proxy)
    body = {"prompt": prompt, "n_predict": 4}
    assert _status_of(a.proxy + "/completion", body) == _status_of(a.server + "/completion", body) == 400
    after = _stats(a.proxy)
    assert (after["completions"], after["restores"]) == (before["completions"], before["restores"])


def test_request_size_limit(nodes: tuple[Node, Node], cluster: Cluster, tmp_path: Path) -> None:
    a, _ = nodes
    proxy = cluster.proxy_of(a.server, a.slot_dir, str(tmp_path), "--max-body-mb", "1")
    assert _status_of(proxy + "/completion", {"prompt": "x" * (2 << 20), "n_predict": 1}) == 413
    assert _status_of(proxy + "/completion", {"prompt": "Hello", "n_predict": 1}) == 200
    # refused from the declared length, before a body that never comes (the reply is all it waits for)
    host, port = proxy.removeprefix("http://").split(":")
    for head in (b"POST /completion", b"GET /slots"):
        with socket.create_connection((host, int(port)), 30) as client:
            client.sendall(head + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n{}")
            assert client.recv(64).startswith(b"HTTP/1.1 413"), head
    # a chunked body declares no length: refused once the proxy has read past the limit, in
    # llama-server's error shape as every error of the proxy's own
    body = b'{"prompt": "' + b"x" * ((1 << 20) + 1000) + b'"}'
    with socket.create_connection((host, int(port)), 30) as client:
        client.sendall(
            b"POST /completion HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n" % len(body)
            + body
            + b"\r\n0\r\n\r\n"
        )
        reply = b""
        while chunk := client.recv(65536):
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"application/json" in head, head
    assert json.loads(payload)["error"]["code"] == 413


def _stream_chat(url: str, messages: list[dict[str, str]]) -> tuple[str, dict[str, Any], dict[str, str], int]:
    """Content, last timings, headers and the number of SSE events of a streamed chat answer."""
    body = {"messages": messages, "max_tokens": 12, "temperature": 0.0, "stream": True}
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    content, timings, events = "", {}, 0
    with urllib.request.urlopen(req, timeout=120) as r:
        headers = dict(r.headers)
        assert headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            events += 1
            for choice in event.get("choices", []):
                content += (choice.get("delta") or {}).get("content") or ""
            timings = event.get("timings", timings)
    return content, timings, headers, events


def test_chat_shared_system_prompt(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    system = {"role": "system", "content": sample_text("difflib.py.txt")[:2000]}
    before = _stats(a.proxy)["uploads"]
    body = {"messages": [system, {"role": "user", "content": "What does this module do?"}], "max_tokens": 8}
    out, headers = _post(a.proxy + "/v1/chat/completions", body)
    assert headers[RESTORED_HEADER] == "0" and out["choices"][0]["message"]["content"]
    _wait_uploads(a.proxy, before + 1)

    content, timings, headers, events = _stream_chat(
        b.proxy, [system, {"role": "user", "content": "Summarize."}]
    )
    restored = int(headers[RESTORED_HEADER])
    assert restored >= 2 * CHUNK and restored % CHUNK == 0
    assert events > 1 and content
    assert timings["cache_n"] == restored and timings["prompt_n"] < CHUNK  # system prompt not recomputed


def test_concurrent_requests(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    text = sample_text("gpl-3.0.txt")[:1500]
    results: list[Any] = []

    def ask(url: str, i: int) -> None:
        try:
            results.append(_complete(url, f"{text}\n\nQuestion {i}: what is this?\nAnswer:")[0])
        except Exception as exc:  # collected: asserted below
            results.append(exc)

    threads = [threading.Thread(target=ask, args=(n.proxy, i)) for i, n in enumerate((a, b, a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == 4 and all(isinstance(r, dict) and r["content"] for r in results), results


@pytest.mark.parametrize(
    ("arch", "write", "shared"),
    [
        ("deepseek2-mla", tiny_models.write_deepseek2_mla, True),
        ("qwen2vl-mrope", tiny_models.write_qwen2vl, True),
        ("lfm2-hybrid", tiny_models.write_lfm2, False),
    ],
)
def test_other_architectures_share_or_say_why(
    cluster: Cluster, tmp_path: Path, arch: str, write: Any, shared: bool
) -> None:
    """Tiny real GGUFs (tests/tiny_models.py): latent attention (K only) and M-RoPE cells are
    shared between two servers, and B answers as it does computing alone; a hybrid model's slot
    holds its recurrent state of the last position, so its upload is refused and nothing loads."""
    model = write(tmp_path / f"{arch}.gguf")
    store = (tmp_path / "store").as_uri()
    proxies, servers = [], []
    for name in ("a", "b"):
        server, slot_dir = cluster.server(f"{arch}-{name}", model)
        servers.append(server)
        proxies.append(cluster.proxy_of(server, slot_dir, store))
    body = _tiny_body(250)
    first = _post(proxies[0] + "/completion", body)[0]["content"]
    stats_a = _wait_uploads(proxies[0], 1)
    second = _post(proxies[1] + "/completion", body)[0]["content"]
    stats_b = _stats(proxies[1])
    alone = _post(servers[1] + "/completion", {**body, "cache_prompt": False})[0]["content"]
    assert first == second == alone
    if shared:
        assert stats_a["uploads"] == 1 and stats_b["restores"] == 1
        assert stats_b["restored_tokens"] == 250 // CHUNK * CHUNK
    else:
        assert stats_a["upload_errors"] == 1 and stats_b["restores"] == 0


def test_a_sliding_window_model_without_swa_full_shares_nothing(cluster: Cluster, tmp_path: Path) -> None:
    """A prompt within the window (tiny gpt-oss: 128 tokens) was uploaded and restored, and
    llama-server computed all of it again (Gemma 3: 256 of 311 restored, 311 computed): every
    load read the store for nothing and the header claimed a reuse. Such a proxy shares nothing,
    and says so at start-up."""
    model = tiny_models.write_gpt_oss(tmp_path / "gpt-oss.gguf")
    store = (tmp_path / "store").as_uri()
    proxies, servers, logs = [], [], []
    for name in ("a", "b"):
        server, slot_dir = cluster.server(f"swa-{name}", model)
        servers.append(server)
        proxies.append(cluster.proxy_of(server, slot_dir, store, "--chunk-tokens", "32"))
        logs.append(cluster.root / f"proxy-{len(cluster.procs) - 1}.log")
    body = _tiny_body(100)
    first = _post(proxies[0] + "/completion", body)[0]["content"]
    deadline = time.monotonic() + 5.0  # a save after the answer took milliseconds
    while time.monotonic() < deadline and not _stats(proxies[0])["saves"]:
        time.sleep(0.2)
    second, headers = _post(proxies[1] + "/completion", body)
    assert first == second["content"] and headers[RESTORED_HEADER] == "0"
    assert _stats(proxies[0])["saves"] == 0 and _stats(proxies[1])["restores"] == 0
    assert all("without --swa-full" in log.read_text() for log in logs)


def test_a_request_the_server_refuses_leaves_the_slot_unsaved(
    nodes: tuple[Node, Node], cluster: Cluster
) -> None:
    """A request llama-server refuses (a grammar it cannot parse: 400) after a long prompt: the
    proxy took the slot to hold the refused prompt, saved it, and logged a context shift that never
    happened. What the slot holds is not known: it is not saved."""
    a, _ = nodes
    text = _tokenize(a.server, sample_text("gfdl-1.3.txt"), add_special=False)
    before = _stats(a.proxy)["saves"]
    logs = {log: log.stat().st_size for log in cluster.root.glob("proxy-*.log")}
    with pytest.raises(urllib.error.HTTPError) as refused:
        _complete(a.proxy, text[:600], grammar="root ::= (")
    assert refused.value.code == 400
    time.sleep(1.0)  # the save after an answer took milliseconds
    assert _stats(a.proxy)["saves"] == before
    assert not any("shifted its context" in log.read_text()[size:] for log, size in logs.items())


def test_store_down_still_answers(nodes: tuple[Node, Node], cluster: Cluster) -> None:
    a, _ = nodes
    dead = f"redis://127.0.0.1:{free_port()}/0"
    proxy = cluster.proxy_of(a.server, a.slot_dir, dead)
    prompt = sample_text("gpl-3.0.txt")[:1500] + "\n\nQuestion: who wrote this?\nAnswer:"
    out, headers = _complete(proxy, prompt)
    assert headers[RESTORED_HEADER] == "0" and out["content"]
    stats = _stats(proxy)
    assert stats["store_errors"] >= 1 and stats["restores"] == 0


def test_a_store_that_stops_answering_does_not_hold_requests(
    nodes: tuple[Node, Node], cluster: Cluster
) -> None:
    """An HTTP store whose connections are accepted and never answered (a frozen or wedged
    server): its client waits a minute per try; the request goes on after the proxy's deadline."""
    a, _ = nodes
    with socket.create_server(("127.0.0.1", 0)) as wedged:  # the kernel accepts, no one answers
        proxy = cluster.proxy_of(a.server, a.slot_dir, f"http://127.0.0.1:{wedged.getsockname()[1]}")
        prompt = sample_text("gpl-3.0.txt")[:1500] + "\n\nQuestion: who wrote this?\nAnswer:"
        out, headers = _complete(proxy, prompt)  # _post gives up after 120 s; the store's client: 180
        assert headers[RESTORED_HEADER] == "0" and out["content"]
        stats = _stats(proxy)
        assert stats["loads_skipped"] == 1 and stats["store_errors"] >= 1


def test_restored_lossy_kv_is_not_uploaded_as_better_chunks(
    nodes: tuple[Node, Node], cluster: Cluster, tmp_path: Path
) -> None:
    """Proxy A stores balanced chunks, B uploads high and balanced: B restores balanced K/V; its
    upload must not store that as high chunks (they would pass for the exact K/V at high)."""
    a, b = nodes
    store = str(tmp_path / "store")
    proxy_a = cluster.proxy_of(a.server, a.slot_dir, store, "--levels", "balanced")
    proxy_b = cluster.proxy_of(b.server, b.slot_dir, store, "--levels", "high", "balanced")
    text = _tokenize(a.server, sample_text("gfdl-1.3.txt"), add_special=True)
    _complete(proxy_a, text[: 4 * CHUNK + 10])
    _wait_uploads(proxy_a, 1)
    _, headers = _complete(proxy_b, text[: 5 * CHUNK + 10])  # one more full chunk for B to upload
    assert headers[RESTORED_HEADER] == str(4 * CHUNK)
    assert _wait_uploads(proxy_b, 1)["uploads"] == 1
    # B's fifth chunk, computed on top of balanced K/V, at balanced; nothing at high
    assert sorted(p.name for p in (tmp_path / "store" / PREFIX / "chunks").glob("*/*")) == ["balanced"] * 5


def test_lossy_kv_the_servers_ram_cache_moves_is_not_uploaded_as_better_chunks(
    cluster: Cluster, tmp_path: Path
) -> None:
    """llama-server's RAM prompt cache (--cache-ram) keeps what a slot held and loads it into
    another slot for a prompt that starts the same way. K/V restored at balanced into slot 0 came
    back in slot 1, from which the proxy, following lossy restores slot by slot, uploaded it at
    high, under its tokens' keys: the exact K/V at high for every other proxy."""
    store = tmp_path / "store"
    writer, writer_slots = cluster.server("ram-writer", None, "-np", "2")  # the same KV streams
    writer_proxy = cluster.proxy_of(writer, writer_slots, str(store), "--levels", "balanced")
    server, slot_dir = cluster.server("ram", None, "-np", "2", "--cache-ram", "256")
    proxy = cluster.proxy_of(server, slot_dir, str(store), "--levels", "high", "balanced")
    text = _tokenize(server, sample_text("gfdl-1.3.txt"), add_special=True)
    prefix = text[: 4 * CHUNK]
    _complete(writer_proxy, prefix + text[4 * CHUNK : 4 * CHUNK + 8])
    _wait_uploads(writer_proxy, 1)
    question = _tokenize(server, " Who publishes this license?\nAnswer:", add_special=False)
    _, headers = _complete(proxy, prefix + question, id_slot=0)
    assert headers[RESTORED_HEADER] == str(4 * CHUNK)  # balanced K/V in slot 0
    shutil.rmtree(store / PREFIX)  # the store loses it: the server's RAM cache still has it
    other = _tokenize(server, sample_text("gpl-3.0.txt"), add_special=True)
    _complete(proxy, other[:40], id_slot=0)  # slot 0's K/V goes into the RAM cache
    _complete(proxy, other[40:80], id_slot=1)
    longer = text[: 5 * CHUNK + 10]
    out, headers = _complete(proxy, longer, id_slot=1)
    assert headers[RESTORED_HEADER] == "0"
    assert out["timings"]["prompt_n"] <= len(longer) - 4 * CHUNK  # the RAM cache gave slot 1 the prefix
    stats = _wait_uploads(proxy, 1)
    assert stats["uploads"] == 1 and stats["objects_written"] > 0
    assert {p.name for p in (store / PREFIX / "chunks").glob("*/*")} == {"balanced"}


def test_a_server_restarted_on_another_model_is_read_again(cluster: Cluster, tmp_path: Path) -> None:
    """The proxy read its server's model once, at start-up. The server restarted behind it on
    another model of the same shape: the proxy restored the first model's chunks into it, and
    stored its K/V under the first model's name. A model file written again (a fine-tune deployed
    over it) cannot tell the proxy which weights the server runs: nothing is shared after it."""
    first = tiny_models.write_qwen3(tmp_path / "first.gguf")
    second = tiny_models.write_qwen3(tmp_path / "second.gguf", seed=1)  # same shape, other weights
    store = tmp_path / "store"
    server, slot_dir = cluster.server("swap", first)
    server_proc = cluster.procs[-1]
    proxy = cluster.proxy_of(server, slot_dir, str(store))
    body = _tiny_body(300)
    _post(proxy + "/completion", body)
    _wait_uploads(proxy, 1)
    server_proc.terminate()
    server_proc.wait(30)
    cluster.server("swap", second, port=int(server.rsplit(":", 1)[1]))
    out, headers = _post(proxy + "/completion", body)
    assert headers[RESTORED_HEADER] == "0"  # nothing of the first model's
    assert out["content"] == _post(server + "/completion", {**body, "cache_prompt": False})[0]["content"]
    stats = _wait_uploads(proxy, 2)
    assert stats["uploads"] == 2 and stats["restores"] == 0 and stats["restore_failures"] == 0
    assert len(list((store / PREFIX / "chunks").glob("*"))) == 4  # two chunks of each, under its name

    tiny_models.write_qwen3(second, seed=2)  # the server still runs seed 1 until it restarts
    _, headers = _post(proxy + "/completion", {**body, "prompt": tiny_models.TOKENS[:400]})
    assert RESTORED_HEADER not in headers  # passed through
    time.sleep(1.0)
    assert _stats(proxy)["uploads"] == 2 and len(list((store / PREFIX / "chunks").glob("*"))) == 4


def test_a_prompt_the_server_computed_is_uploaded_at_its_best_after_a_lossy_restore(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A lossy restore counts for what a server may reuse of it, not for every prompt: a prompt
    that shares only its first tokens with a restored one, computed in full, is stored at `high`
    (one restore kept every later prompt of the server from `high`)."""
    store = tmp_path / "store"
    writer, writer_slots = cluster.server("full-writer", None, "-np", "2")
    writer_proxy = cluster.proxy_of(writer, writer_slots, str(store), "--levels", "balanced")
    server, slot_dir = cluster.server("full", None, "-np", "2", "--cache-ram", "256")
    proxy = cluster.proxy_of(server, slot_dir, str(store), "--levels", "high", "balanced")
    text = _tokenize(server, sample_text("gfdl-1.3.txt"), add_special=True)
    _complete(writer_proxy, text[: 2 * CHUNK + 8])
    _wait_uploads(writer_proxy, 1)
    _, headers = _complete(proxy, text[: 2 * CHUNK + 8], id_slot=0)
    assert headers[RESTORED_HEADER] == str(2 * CHUNK)  # balanced K/V in slot 0
    other = text[:3] + _tokenize(server, sample_text("gpl-3.0.txt"), add_special=True)[: 2 * CHUNK + 5]
    out, headers = _complete(proxy, other, id_slot=1)
    assert headers[RESTORED_HEADER] == "0" and out["timings"]["prompt_n"] == len(other)
    _wait_uploads(proxy, 1)
    levels = {p.name for key in (store / PREFIX / "chunks").iterdir() for p in key.iterdir()}
    assert levels == {"balanced", "high"}  # the writer's balanced chunks, and the new prompt's at high too


def test_a_completion_passed_through_leaves_no_stale_record(cluster: Cluster, tmp_path: Path) -> None:
    """A completion with cache_prompt false is computed in a slot the proxy does not follow: the
    proxy went on believing the slot held its last prompt, did not restore it from the store, and
    the server computed all of it again."""
    server, slot_dir = cluster.server("stale")
    proxy = cluster.proxy_of(server, slot_dir, str(tmp_path / "store"))
    text = _tokenize(server, sample_text("gfdl-1.3.txt"), add_special=True)
    prefix = text[: 3 * CHUNK]
    _complete(proxy, prefix + text[3 * CHUNK : 3 * CHUNK + 8])
    _wait_uploads(proxy, 1)
    other = _tokenize(server, sample_text("gpl-3.0.txt"), add_special=True)[:200]
    _complete(proxy, other, cache_prompt=False)  # slot 0 now holds this
    question = _tokenize(server, " Who publishes this license?\nAnswer:", add_special=False)
    out, headers = _complete(proxy, prefix + question)
    assert headers[RESTORED_HEADER] == str(3 * CHUNK)
    assert out["timings"]["prompt_n"] == len(question)


def test_a_context_the_server_shifted_is_not_uploaded(cluster: Cluster, tmp_path: Path) -> None:
    """A server with --context-shift that generates past its context drops tokens and moves the
    rest: the K/V it keeps was computed beside tokens it dropped, not its own tokens' exact K/V,
    and stored under them it would be another prompt's wrong prefix. The proxy saves the slot,
    sees that it no longer starts with the prompt, and uploads nothing (no test reached this)."""
    server, slot_dir = cluster.llama_server("shift", cluster.binary, 256, None, "--context-shift")
    store = tmp_path / "store"
    proxy = cluster.proxy_of(server, slot_dir, str(store))
    prompt = _tokenize(server, sample_text("gfdl-1.3.txt"), add_special=True)[:200]
    out, _ = _complete(proxy, prompt, n_predict=100, ignore_eos=True)
    assert out["timings"]["predicted_n"] == 100  # past the 256 positions: the server shifted
    deadline = time.monotonic() + 60.0
    while _stats(proxy)["saves"] < 1:
        assert time.monotonic() < deadline, _stats(proxy)
        time.sleep(0.2)
    time.sleep(1.0)  # the upload, if any, is queued right after the save
    stats = _stats(proxy)
    assert (stats["uploads"], stats["upload_errors"], stats["pending_uploads"]) == (0, 0, 0)
    assert not (store / PREFIX).exists()


def test_capacity_bytes_bounds_what_a_proxy_leaves_in_its_store(cluster: Cluster, tmp_path: Path) -> None:
    """`proxy --capacity-bytes`: after its upload the store holds at most that many bytes of
    objects, and the stats say how many were evicted."""
    server, slot_dir = cluster.server("capacity")
    store = tmp_path / "store"
    proxy = cluster.proxy_of(server, slot_dir, str(store), "--capacity-bytes", "100000")
    prompt = _tokenize(server, sample_text("gfdl-1.3.txt"), add_special=True)[: 3 * CHUNK + 5]
    _complete(proxy, prompt)
    stats = _wait_uploads(proxy, 1)
    assert stats["uploads"] == 1 and stats["objects_written"] >= 3
    assert stats["evicted_bytes"] > 0 and _stored_bytes(store) <= 100000


def _slot_state(server: str) -> dict[str, Any]:
    return json.loads(http_status(server + "/slots")[1])[0]


def test_a_client_that_leaves_stops_its_generation(nodes: tuple[Node, Node]) -> None:
    """A client that closes its connection before a non-streamed answer: the proxy closes its
    request to the server, which stops generating (as for its own clients), and the slot is free."""
    a, _ = nodes
    n_predict = N_CTX - 64
    request = {"prompt": "Write a long story.", "n_predict": n_predict, "ignore_eos": True, "temperature": 0}
    body = json.dumps(request).encode()
    host, port = a.proxy.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), 10) as client:
        client.sendall(
            b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 60
        while not _slot_state(a.server)["is_processing"]:  # the generation has begun
            assert time.monotonic() < deadline
            time.sleep(0.05)
    # Looked at every 2 s: llama-server checks a waiting request's connection when no result has
    # come for a second, and each /slots call is a result that postpones the check.
    deadline = time.monotonic() + 120
    while time.sleep(2.0) or (slot := _slot_state(a.server))["is_processing"]:
        assert time.monotonic() < deadline, "the server still generates for a client that left"
    # A released slot keeps its prompt and every token it generated (its counters are reset):
    # stopped, not run to its end, whenever the polls saw it go idle.
    assert 0 < slot["n_prompt_tokens"] < n_predict // 2
    out, _ = _complete(a.proxy, "Hello")  # the slot serves the next request
    assert out["content"]


def test_a_proxy_told_other_cache_types_uploads_nothing(cluster: Cluster, redis_url: str) -> None:
    """A server caching K/V as q8_0 behind a proxy left at f16: its chunks would be stored under
    the f16 fingerprint, and every f16 server would fetch them and have them refused. The upload
    is refused instead, saying which option to give."""
    server, slot_dir = cluster.server("q8", None, "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0")
    proxy = cluster.proxy_of(server, slot_dir, f"{redis_url}?prefix=proxy-q8:")
    _complete(proxy, sample_text("gpl-3.0.txt")[:2000])
    stats = _wait_uploads(proxy, 1)
    assert stats["upload_errors"] == 1 and stats["objects_written"] == 0 and stats["store_errors"] == 0
    log = (cluster.root / f"proxy-{len(cluster.procs) - 1}.log").read_text()
    assert "holds K as q8_0, the proxy was told f16: start it with --cache-type-k q8_0" in log


def test_q8_0_servers_share_a_lossy_prefix(cluster: Cluster, redis_url: str) -> None:
    """Two servers caching K/V as q8_0 (-ctk/-ctv q8_0), their proxies told so, storing `balanced`:
    the q8_0 values are coded lossily (until December 2026 every level stored them as they are,
    1.0x), the other server restores the prefix from them and evaluates only the rest."""
    store = f"{redis_url}?prefix=proxy-q8-shared:"
    kv = ("-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0")
    told = ("--flash-attn", "on", "--cache-type-k", "q8_0", "--cache-type-v", "q8_0")
    nodes = []
    for name in ("q8-a", "q8-b"):
        server, slot_dir = cluster.server(name, None, *kv)
        nodes.append((server, cluster.proxy_of(server, slot_dir, store, *told, "--levels", "balanced")))
    (server_a, proxy_a), (_, proxy_b) = nodes
    text = _tokenize(server_a, sample_text("gpl-3.0.txt"), add_special=True)
    prefix, question = text[: 4 * CHUNK], _tokenize(server_a, "\n\nQuestion: What is this?\nAnswer:", False)
    _complete(proxy_a, prefix + question[:3])
    up = _wait_uploads(proxy_a, 1)
    assert up["uploads"] == 1 and up["upload_errors"] == 0
    kv_bytes = 4 * CHUNK * 30 * 2 * 192 // 32 * 34  # SmolLM2: 30 layers, K and V of 192 values, q8_0
    assert up["bytes_written"] < 0.6 * kv_bytes  # measured: about half
    out, headers = _complete(proxy_b, prefix + question)
    assert headers[RESTORED_HEADER] == str(len(prefix))
    assert out["timings"]["prompt_n"] == len(question) and out["content"]


def test_a_restore_the_server_refuses_sets_the_store_aside(cluster: Cluster, redis_url: str) -> None:
    """Flash attention on behind one proxy, off behind the other, both proxies left at `auto`: one
    fingerprint for two V layouts, so B's server refuses A's prefix. B then skips the store for a
    while (each refusal read the whole prefix first), and names the options to check; the refusal
    is counted as one, not as a store error."""
    store = f"{redis_url}?prefix=proxy-fa:"
    proxies = []
    for name, fa in (("fa-on", "on"), ("fa-off", "off")):
        server, slot_dir = cluster.server(name, None, "-fa", fa)
        proxies.append(cluster.proxy_of(server, slot_dir, store))
        log = cluster.root / f"proxy-{len(cluster.procs) - 1}.log"
    prompt = sample_text("gpl-3.0.txt")[:2000]
    _complete(proxies[0], prompt)
    _wait_uploads(proxies[0], 1)
    # the prefix refused; another text in the slot; the prefix again (the slot lacks it, the store
    # has it): set aside, the store is not asked (it was: refused again)
    start = time.monotonic()
    for text in (prompt + " Who?", sample_text("gfdl-1.3.txt")[:2000], prompt + " Why?"):
        _, headers = _complete(proxies[1], text)
        assert headers[RESTORED_HEADER] == "0"
    # a slow machine may take the requests past the time set aside: the store is asked again then
    # (a CI run under load counted 2)
    windows = 1 + int((time.monotonic() - start) // STORE_BACKOFF_S)
    stats = _stats(proxies[1])
    assert 1 <= stats["restore_failures"] <= windows and stats["store_errors"] == 0, (stats, windows)
    assert stats["bytes_read"] > 0  # the refused prefix was read (it counted only restores taken)
    assert "does the server run with the --flash-attn" in log.read_text()


def test_token_required(nodes: tuple[Node, Node], cluster: Cluster, redis_url: str, tmp_path: Path) -> None:
    a, _ = nodes
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    proxy = cluster.proxy_of(a.server, a.slot_dir, redis_url, "--token-file", str(token_file))
    assert http_status(proxy + "/health")[0] == 200
    body = json.dumps({"prompt": "Hello", "n_predict": 2}).encode()
    for headers, status in (
        ({}, 401),
        ({"Authorization": "Bearer wrong"}, 401),
        ({"Authorization": "Bearer s3cret"}, 200),
    ):
        req = urllib.request.Request(proxy + "/completion", data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                assert r.status == status
        except urllib.error.HTTPError as e:
            assert e.code == status
            assert json.loads(e.read())["error"] == {
                "code": 401,
                "message": "a bearer token is required",
                "type": "authentication_error",
            }


def test_killed_mid_upload_leaves_no_torn_entry(
    nodes: tuple[Node, Node], cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llama_cachegen import codec, stores

    a, b = nodes
    key = "torn-upload-test-key"
    monkeypatch.setenv(stores.KEY_ENV, key)  # both proxies tag and verify every object
    store_url = str(tmp_path / "store")  # a directory: the store where a write could be torn
    n_chunks, levels = 8, ("lossless", "high", "balanced", "compact")
    victim = cluster.proxy_of(a.server, a.slot_dir, store_url, "--levels", *levels)
    victim_proc = cluster.procs[-1]
    prefix = _tokenize(a.server, sample_text("gfdl-1.3.txt"), add_special=True)[: n_chunks * CHUNK]
    q_a = _tokenize(a.server, " Who publishes this license?\nAnswer:", add_special=False)
    q_b = _tokenize(
        a.server, "\n\nQuestion: What may a reader do with this document?\nAnswer:", add_special=False
    )
    assert q_a[0] != q_b[0]

    store = stores.open_store(store_url, auth_key=key)
    try:
        out, headers = _complete(victim, prefix + q_a)
        assert headers[RESTORED_HEADER] == "0" and out["content"]
        deadline = time.monotonic() + 60
        # the levels go up one after the other: kill once the first is whole, the others under way
        while sum(e.key.endswith("/lossless") for e in store.list(f"{PREFIX}chunks/")) < n_chunks:
            assert time.monotonic() < deadline and victim_proc.poll() is None, _stats(victim)
            time.sleep(0.002)
        victim_proc.send_signal(signal.SIGKILL)
        victim_proc.wait(10)

        entries = store.list()
        chunk_keys = [e.key for e in entries if e.key.startswith(f"{PREFIX}chunks/")]
        assert n_chunks <= len(chunk_keys) < n_chunks * len(levels), "killed after the upload, not during it"
        for entry in entries:  # every visible object whole and verified; partial writes are not entries
            value = store.get(entry.key)  # AuthenticationError if torn or untagged
            info = codec.inspect(value)
            if entry.key in chunk_keys:
                assert info["part"] == "chunk" and entry.key.rsplit("/", 1)[1] == info["level"]
        leftovers = store.temporaries()
    finally:
        store.close()

    # the same prefix with a new question on B through a fresh proxy, against two references:
    # B's cold answer and B's answer after restoring A's raw slot file (bit for bit what lossless
    # chunks give back; a cold prefill batches the prefix otherwise, so its answer may drift a few
    # tokens in: only its first token is compared)
    prompt = prefix + q_b
    _post(b.server + "/slots/0?action=erase", {})
    cold, _ = _complete(b.server, prompt, id_slot=0)
    assert cold["timings"]["prompt_n"] == len(prompt)
    _post(a.server + "/slots/0?action=save", {"filename": "raw-torn.bin"})
    shutil.copyfile(a.slot_dir / "raw-torn.bin", b.slot_dir / "raw-torn.bin")
    _post(b.server + "/slots/0?action=restore", {"filename": "raw-torn.bin"})
    ref, _ = _complete(b.server, prompt, id_slot=0)
    assert ref["timings"]["prompt_n"] == len(q_b)
    _post(b.server + "/slots/0?action=erase", {})
    later = cluster.proxy_of(b.server, b.slot_dir, store_url, "--load-level", "lossless")
    out_b, headers_b = _complete(later, prompt)
    restored = int(headers_b[RESTORED_HEADER])
    assert restored == len(prefix)  # every lossless chunk was whole before the kill
    assert out_b["timings"]["prompt_n"] == len(q_b)
    assert out_b["content"] == ref["content"] and out_b["content"]
    first = _tokenize(b.server, out_b["content"], add_special=False)[0]
    assert first == _tokenize(b.server, cold["content"], add_special=False)[0]
    stats = _stats(later)
    assert stats["store_errors"] == 0 and stats["restore_failures"] == 0
    print(
        f"\nkilled mid-upload: {len(chunk_keys)} of {n_chunks * len(levels)} chunk objects stored, "
        f"{len(leftovers)} partial write(s) left; B restored {restored} of {len(prompt)} tokens; "
        f"answer {out_b['content']!r}, cold {cold['content']!r}"
    )


def test_no_kv_moved_from_another_prompt_goes_into_a_slot(nodes: tuple[Node, Node]) -> None:
    """llama-server's cache reuse (a request's n_cache_reuse, or --cache-reuse) moves K/V of an
    earlier prompt to new positions: K/V that saw other tokens, which the slot save after the
    response handed the proxy as these tokens' exact K/V, uploaded for every server. The proxy
    turns it off: B after A+B is computed, not moved."""
    a, _ = nodes
    text = _tokenize(a.server, sample_text("gfdl-1.3.txt"), add_special=False)
    first, second = text[:160], text[160:320]
    _complete(a.proxy, first + second)
    out, _ = _complete(a.proxy, second, n_cache_reuse=16)
    assert out["timings"]["prompt_n"] == len(second)


def test_kv_moved_on_other_routes_is_not_uploaded(cluster: Cluster, tmp_path: Path) -> None:
    """llama-server generates on more routes than completions, and /v1/messages takes no
    n_cache_reuse: a server's --cache-reuse moved K/V there, which the next completion's slot save
    uploaded as its tokens' exact K/V (another server then answered from it). A slot that a request
    passed through may have used is not uploaded from until a restore replaced what it held."""
    server, slot_dir = cluster.server("reuse", None, "-np", "1", "--cache-reuse", "16")
    proxy = cluster.proxy_of(server, slot_dir, f"file://{tmp_path}/store")
    text = sample_text("gfdl-1.3.txt")
    cut = text.index("\n", 440) + 1
    first, second = text[:cut], text[cut:1750]
    both = _post(server + "/apply-template", {"messages": [{"role": "user", "content": first + second}]})[0]
    _complete(proxy, both["prompt"], n_predict=1)
    stored = _wait_uploads(proxy, 1)["objects_written"]
    message = {"model": "m", "max_tokens": 1, "temperature": 0.0}
    message["messages"] = [{"role": "user", "content": second}]
    reply, _ = _post(proxy + "/v1/messages", message)
    assert reply["usage"]["cache_read_input_tokens"] > 100  # the server moved the second part's K/V
    _post(server + "/slots/0?action=save", {"filename": "held.bin"})
    held = [int(t) for t in read_slot_file((slot_dir / "held.bin").read_bytes())[0]]
    more = _tokenize(server, sample_text("gpl-3.0.txt")[:700], add_special=False)
    out, _ = _complete(proxy, held + more, n_predict=1)
    assert out["timings"]["prompt_n"] < len(held) + len(more)  # the server kept what it moved
    deadline = time.monotonic() + 60
    while _stats(proxy)["uploads_unseen"] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    stats = _stats(proxy)
    assert stats["uploads_unseen"] == 1 and stats["objects_written"] == stored and stats["saves"] == 1
    # a restore replaces what the slot held: uploads again
    out, headers = _complete(proxy, both["prompt"] + sample_text("gpl-3.0.txt")[:700], n_predict=1)
    assert int(headers[RESTORED_HEADER]) > 0
    assert _wait_uploads(proxy, 2)["objects_written"] > stored


def test_a_proxy_starts_while_a_slot_generates(cluster: Cluster, tmp_path: Path) -> None:
    """The proxy's start-up save (which tells the KV stream count) goes to an idle slot: llama-server
    saves a busy slot only when its task ends, and the proxy listened only after that. Slot 0
    generates for as long as the client stays (context shift: no end of its own)."""
    server, slot_dir = cluster.server("busy", None, "-np", "2", "--context-shift")
    host, port = server.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "Once", "n_predict": -1, "ignore_eos": True, "id_slot": 0, "stream": True})
    with socket.create_connection((host, int(port)), timeout=60) as client:
        client.sendall(
            f"POST /completion HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        client.recv(1)  # the first streamed bytes: slot 0 is generating
        proxy = cluster.proxy_of(server, slot_dir, f"file://{tmp_path}/store")
        slots = json.loads(http_status(server + "/slots")[1])
        assert slots[0]["is_processing"] and not slots[1]["is_processing"]
        assert http_status(proxy + "/health")[0] == 200


def test_a_proxy_told_another_model_refuses_to_start(
    nodes: tuple[Node, Node], cluster: Cluster, tmp_path: Path
) -> None:
    """--model naming a file other than the one the server loaded: the proxy stored the server's
    K/V under that model's fingerprint (a SmolLM2 server's proxy told --model Gemma did so, and
    every Gemma proxy then had its restores refused), and would restore a same-shape model's."""
    other = tiny_models.write_qwen3(tmp_path / "other.gguf")
    store = tmp_path / "store"
    name = str(len(cluster.procs))
    with pytest.raises(CacheGenError, match="exited with 1"):
        cluster.proxy_of(nodes[0].server, nodes[0].slot_dir, str(store), "--model", str(other))
    log = (cluster.root / f"proxy-{name}.log").read_text()
    assert "and --model names" in log and "other.gguf" in log, log
    assert not store.exists() or not any(p.is_file() for p in store.rglob("*"))


def test_a_server_that_dies_mid_answer_breaks_the_answer_off(cluster: Cluster, tmp_path: Path) -> None:
    """A streamed answer whose server died: the proxy ended it as a whole one (the last chunk
    sent), so a client reading to the end took the cut answer for the full one; it now breaks off
    as the server's own connection does."""
    server, slot_dir = cluster.server("dies")
    server_proc = cluster.procs[-1]
    proxy = cluster.proxy_of(server, slot_dir, str(tmp_path / "store"))
    host, port = proxy.removeprefix("http://").split(":")
    body = {"prompt": "Once upon a time", "n_predict": 4000, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # generating
    server_proc.kill()
    server_proc.wait(30)
    with pytest.raises(http.client.IncompleteRead):
        response.read()
    conn.close()
    status, text = _status_and_text(proxy + "/completion", {"prompt": "Once", "n_predict": 1})
    assert status == 502 and "unreachable" in text and "ssl:default" not in text, text


def test_a_proxy_given_the_wrong_slot_dir_leaves_one_probe_file(
    nodes: tuple[Node, Node], cluster: Cluster, tmp_path: Path
) -> None:
    """Start-up saves a slot to read the server's KV streams: with a wrong --slot-dir it was found
    nowhere, and each try (a supervisor restarting the proxy) left another copy of the slot's
    state in the server's own directory under a new name."""
    before = set(nodes[0].slot_dir.iterdir())
    for _ in range(2):
        name = str(len(cluster.procs))
        with pytest.raises(CacheGenError, match="exited with 1"):
            cluster.proxy_of(nodes[0].server, tmp_path, str(tmp_path / "store"))
        log = (cluster.root / f"proxy-{name}.log").read_text()
        assert "not into" in log and "(and remove llama-cachegen-probe-" in log, log
    left = set(nodes[0].slot_dir.iterdir()) - before
    assert len(left) == 1 and next(iter(left)).name.startswith("llama-cachegen-probe-"), left
    for path in left:
        path.unlink()


def test_a_restarted_proxy_keeps_what_the_slot_holds(cluster: Cluster, tmp_path: Path) -> None:
    """A proxy started beside a server whose slot holds a prompt knew nothing of it: the prompt
    again got the store's copy restored over the slot's own exact K/V (at a lossy level, another
    answer) and its tail computed again. The start-up save tells what the probed slot holds."""
    server, slot_dir = cluster.server("restarted-proxy")
    store = f"file://{tmp_path}/store"
    first = cluster.proxy_of(server, slot_dir, store)
    text = _tokenize(server, sample_text("gpl-3.0.txt"), add_special=True)
    _, headers = _complete(first, text[: 3 * CHUNK + 40])
    assert headers[RESTORED_HEADER] == "0"
    _wait_uploads(first, 1)
    proc = cluster.procs[-1]
    proc.terminate()
    proc.wait(30)
    second = cluster.proxy_of(server, slot_dir, store)
    out, headers = _complete(second, text[: 3 * CHUNK + 40])
    assert headers[RESTORED_HEADER] == "0" and out["timings"]["prompt_n"] == 1, (headers, out["timings"])
    # a longer prompt: the slot's 3 * CHUNK + 40 from before this proxy reused, a fourth chunk
    # computed on them, and not uploaded (what they are, a lossy restore's or not, is unknown)
    out, headers = _complete(second, text[: 4 * CHUNK + 10])
    assert headers[RESTORED_HEADER] == "0" and out["timings"]["prompt_n"] == CHUNK - 30, out["timings"]
    deadline = time.monotonic() + 30
    while _stats(second)["uploads_unseen"] < 2 and time.monotonic() < deadline:  # one per request
        time.sleep(0.1)
    stats = _stats(second)
    assert (stats["uploads_unseen"], stats["uploads"]) == (2, 0), stats
    # a prompt sharing only its first token (a BOS) with what the slot holds: that reuse is exact
    # whatever put it there (lossy levels store their first positions exactly), so it is uploaded
    # (a slot of unknown K/V was uploaded from again only after a prompt computed whole: never,
    # where every prompt starts with the same token)
    other = [text[0], *_tokenize(server, sample_text("gfdl-1.3.txt"), add_special=False)[: 2 * CHUNK]]
    out, _ = _complete(second, other)
    assert out["timings"]["prompt_n"] == len(other) - 1, out["timings"]
    assert _wait_uploads(second, 1)["uploads_unseen"] == 2


def _ggsq_head(n_words: int) -> bytes:
    """A sequence file's header ('ggsq' v3) before n_words token words."""
    return struct.pack("<III", 0x67677371, 3, n_words)


def test_packed_slot_token_lists_that_lie_are_refused() -> None:
    """A packed token list (marker -1, version 1, count, tokens, media chunks) whose count runs
    past its words, or that ends in anything but 0 media chunks, is CorruptDataError (not an
    IndexError, not tokens)."""
    plain = [-1, 1, 2, 7, 8, 0]
    tokens, offset = read_slot_file(_ggsq_head(len(plain)) + struct.pack("<6i", *plain))
    assert tokens.tolist() == [7, 8] and offset == 12 + 4 * len(plain)
    for words in ([-1, 1, 3, 7, 8, 0], [-1, 1, 9, 7, 8, 0]):  # a count past the words
        with pytest.raises(CorruptDataError, match="unreadable packed"):
            read_slot_file(_ggsq_head(len(words)) + struct.pack(f"<{len(words)}i", *words))
    media = [-1, 1, 2, 7, 8, 1]  # the count fits; the last word says one media chunk follows
    with pytest.raises(CorruptDataError, match="media"):
        read_slot_file(_ggsq_head(len(media)) + struct.pack("<6i", *media))


def test_level_choice_meets_the_slo_and_falls_back_to_the_server() -> None:
    """load_level if every chunk has it; else the best level whose fetch fits 80% of the SLO (the
    smallest when none does); None (the server computes) when even that is estimated slower than
    the server's measured prefill."""
    sharing = Sharing("file:///nonexistent", {"n_layer": 2, "n_embd": 8}, 1024, slo=40.0)
    stored = [("lossless", "high", "balanced")] * 2
    assert sharing.choose_level(stored, 100) == "lossless"  # nothing measured: every estimate 0
    sharing.throughput = 1000.0
    sharing.bytes_per_token = {"lossless": 1000.0, "high": 500.0, "balanced": 250.0}
    assert sharing.choose_level(stored, 100) == "balanced"  # 100 s, 50 s, 25 s: under 32 s
    sharing.slo = 70.0
    assert sharing.choose_level(stored, 100) == "high"
    sharing.slo = 1.0
    assert sharing.choose_level(stored, 100) == "balanced"  # none fits: the smallest
    sharing.compute_tps = 1.0  # the server: 100 s for the prefix
    assert sharing.choose_level(stored, 100) == "balanced"
    sharing.compute_tps = 10.0  # 10 s: the fetch (25 s) is slower
    assert sharing.choose_level(stored, 100) is None
    assert sharing.choose_level([("lossless",), ("high",)], 100) is None  # no level every chunk has
    sharing.load_level = "high"
    assert sharing.choose_level(stored, 100) == "high"
    assert sharing.choose_level([("lossless",), ("lossless",)], 100) is None
