"""Chunked contexts on the real model and real stores: lossless rebuilds, mixed decoded/computed
assembly, prefix sharing, refusal of bad objects, the whole-container fallback."""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import greedy, smollm
from llama_cachegen import chunks, codec, envelope, stores, stream
from llama_cachegen.chunks import PREFIX
from llama_cachegen.errors import (
    AuthenticationError,
    ChecksumError,
    CorruptDataError,
    InvalidArgumentError,
    LimitExceededError,
    ModelMismatchError,
    TruncatedDataError,
    UnsupportedVersionError,
)
from llama_cachegen.llama import Llama, capture_state, model_fingerprint, restore_state
from llama_cachegen.model import sample_text
from llama_cachegen.quality import compare_logits

N, CONT = 1030, 16  # N is divisible by none of the chunk sizes below
_llama = partial(smollm, n_ctx=1100)
LEVELS = ("lossless", "balanced")


def _set(llm: Llama, state: bytes | bytearray, tokens: list[int]) -> None:
    """The whole context := `state` holding `tokens`."""
    assert restore_state(llm, state, None)
    llm.input_ids[: len(tokens)] = tokens
    llm.n_tokens = len(tokens)


def _objects(store: stores.Store, part: str) -> list[str]:
    return sorted(e.key for e in store.list(f"{PREFIX}{part}/"))


def _decode_into(store: stores.Store, key: str, level: str, state: bytearray) -> None:
    """Decodes one stored chunk into `state`, with codec calls only."""
    chunk = store.get(f"{PREFIX}chunks/{key}/{level}")
    stats_id = codec.inspect(chunk)["stats_id"]
    stats = codec.Stats(store.get(f"{PREFIX}stats/{stats_id}"), bytes.fromhex(stats_id))
    codec.decode_chunk(chunk, stats, state)


@pytest.fixture(scope="module")
def original(gpl_tokens: list[int], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """N tokens saved losslessly at C = 64, 256 and 1000, the logits of a CONT-token continuation
    and the greedy answer."""
    root = tmp_path_factory.mktemp("chunks")
    llm = _llama(logits_all=True)
    prefix, cont = gpl_tokens[:N], gpl_tokens[N : N + CONT]
    llm.eval(prefix)
    state = capture_state(llm, None)
    reports = {
        c: chunks.save_chunked(llm, root / f"c{c}" / "ctx", levels=LEVELS, chunk_tokens=c)
        for c in (64, 256, 1000)
    }
    last_row = llm.scores[N - 1].copy()
    llm.eval(cont)
    cont_rows = llm.scores[N : N + CONT].copy()  # row i: after cont[i]
    llm.n_tokens = N
    answer = greedy(llm, prefix)
    return {
        "root": root,
        "prefix": prefix,
        "cont": cont,
        "state": state,
        "last_row": last_row,
        "cont_rows": cont_rows,
        "greedy": answer,
        "reports": reports,
    }


@pytest.fixture(scope="module")
def loader() -> Llama:
    return _llama(logits_all=True)


@pytest.mark.parametrize("c", [64, 256, 1000])
def test_lossless_rebuild_is_byte_identical_and_continues(
    original: dict[str, Any], loader: Llama, c: int
) -> None:
    url = original["root"] / f"c{c}" / "ctx"
    report = original["reports"][c]
    assert N % c and report.chunks == -(-N // c) and report.fallback is None
    assert report.objects_written == 2 * report.chunks + 2 + 1  # chunks per level, 2 stats, 1 skeleton
    manifest = chunks.read_manifest(url)
    assert manifest.chunk_tokens == c and manifest.levels == LEVELS
    with stores.open_store(str(url.parent)) as store:
        state = codec.skeleton_state(store.get(f"{PREFIX}skeletons/{manifest.skeleton}"), N)
        for entry in manifest.chunks:
            _decode_into(store, entry.key, "lossless", state)
        assert state == original["state"]
    loaded = chunks.load_chunked(loader, url)
    assert loaded.tokens == N and loaded.extra["levels"] == {"lossless": report.chunks}
    assert capture_state(loader, None) == original["state"]
    np.testing.assert_array_equal(loader.scores[N - 1], original["last_row"])  # from the manifest
    loader.eval(original["cont"])
    np.testing.assert_array_equal(loader.scores[N : N + CONT], original["cont_rows"])
    loader.n_tokens = N
    assert greedy(loader, original["prefix"]) == original["greedy"]


def test_lossy_level_loads_when_asked(original: dict[str, Any], loader: Llama) -> None:
    loaded = chunks.load_chunked(loader, original["root"] / "c256" / "ctx", level="balanced")
    assert loaded.extra["levels"] == {"balanced": 5} and loaded.tokens == N
    loader.eval(original["cont"])
    metrics = compare_logits(original["cont_rows"], loader.scores[N : N + CONT], original["cont"])
    assert 0.0 < metrics["kl"] < 0.05 and metrics["top1"] >= 0.85, metrics


def test_a_lossy_load_is_recorded_from_past_its_exact_attention_sinks(
    original: dict[str, Any], loader: Llama
) -> None:
    """A lossy level keeps the first positions exact (sink_tokens): a context holding no more of
    a lossy load than those holds none of its lossy K/V (a proxy keys its records by this)."""
    from llama_cachegen.llama import lossy_level, lossy_record

    url = original["root"] / "c256" / "ctx"
    chunks.load_chunked(loader, url, level="balanced")
    ids = np.asarray(original["prefix"], np.intc)
    with stores.open_store(str(url.parent)) as store:
        first = store.get(chunks._chunk_key(chunks.read_manifest(url).chunks[0].key, "balanced"))
    sinks = codec.inspect(first)["sink_tokens"]
    assert sinks == 4 and lossy_record(loader, None, ids) == (sinks, "balanced")
    assert lossy_level(loader, None, ids[:sinks]) is None
    assert lossy_level(loader, None, ids[: sinks + 1]) == "balanced"


def test_a_lossy_load_is_never_stored_as_exact_chunks(
    original: dict[str, Any], loader: Llama, tmp_path: Path
) -> None:
    """A context loaded at balanced, saved at lossless into another store: as chunks under its
    tokens' keys, every later lossless load of those tokens would get its balanced K/V (the
    original's own lossless save would find them present and write nothing). It is saved whole."""
    chunks.load_chunked(loader, original["root"] / "c256" / "ctx", level="balanced")
    loader.eval(original["cont"])  # K/V computed on top of lossy K/V: not exact either
    store = tmp_path / "store"
    derived = chunks.save_chunked(loader, store / "derived", levels=["high", "balanced"])
    assert derived.chunk_tokens is None and "loaded at balanced" in (derived.fallback or "")
    assert not (store / PREFIX / "chunks").exists()
    # at its own level or worse it is chunked as before (what the prompt cache does too)
    assert chunks.save_chunked(loader, store / "same", levels=["balanced", "compact"]).fallback is None
    # the original's lossless chunks go in, and load exactly
    _set(loader, original["state"], original["prefix"])  # not a load of this library's: the record stays
    exact = chunks.save_chunked(loader, store / "original", levels=["lossless"])
    assert exact.fallback and "loaded at balanced" in exact.fallback  # the record follows the tokens
    chunks.load_chunked(loader, original["root"] / "c256" / "ctx", level="lossless")  # an exact load
    again = chunks.save_chunked(loader, store / "original", levels=["lossless"])
    assert again.fallback is None and again.chunks == 5
    fresh = _llama(logits_all=True)
    chunks.load_chunked(fresh, store / "original", level="lossless")
    assert capture_state(fresh, None) == original["state"]


def test_a_keyed_save_writes_over_objects_it_cannot_verify(
    original: dict[str, Any], loader: Llama, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Objects written without the key (or with another) are not the keyed writer's to keep: a
    keyed save that skipped them as present could never be loaded by a keyed reader."""
    _set(loader, original["state"], original["prefix"])
    chunks.load_chunked(loader, original["root"] / "c256" / "ctx", level="lossless")  # exact, recorded
    store = tmp_path / "store"
    monkeypatch.setenv("LLAMA_CACHEGEN_KEY", "other")
    chunks.save_chunked(loader, store / "a", levels=["lossless"])
    monkeypatch.delenv("LLAMA_CACHEGEN_KEY")
    chunks.save_chunked(loader, store / "b", levels=["lossless"])  # untagged: writes nothing new
    monkeypatch.setenv("LLAMA_CACHEGEN_KEY", "mine")
    again = chunks.save_chunked(loader, store / "c", levels=["lossless"])
    assert again.objects_written >= 5 + 2  # every chunk, the statistics and the skeleton
    fresh = _llama(logits_all=True)
    chunks.load_chunked(fresh, store / "c", level="lossless")
    assert capture_state(fresh, None) == original["state"]


def test_mixed_assembly_of_decoded_and_computed_chunks(original: dict[str, Any], loader: Llama) -> None:
    """Chunks 2 and the last are computed by llama.cpp on top of the assembled chunks before them
    and spliced in; the rest are decoded. The result continues like the original."""
    prefix, c = original["prefix"], 64
    manifest = chunks.read_manifest(original["root"] / f"c{c}" / "ctx")
    ranges = chunks.chunk_ranges(N, c)
    computed = {2, len(ranges) - 1}
    with stores.open_store(str(original["root"] / f"c{c}")) as store:
        skeleton = store.get(f"{PREFIX}skeletons/{manifest.skeleton}")
        state = codec.skeleton_state(skeleton, N)
        for i, (begin, end) in enumerate(ranges):
            if i in computed:
                before = codec.skeleton_state(skeleton, begin)
                codec.splice(before, state, 0, begin)
                _set(loader, before, prefix[:begin])
                loader.eval(prefix[begin:end])
                codec.splice(state, capture_state(loader, None), begin, end)
            else:
                _decode_into(store, manifest.chunks[i].key, "lossless", state)
    assert len(state) == len(original["state"])
    _set(loader, state, prefix)
    loader.eval(original["cont"])
    metrics = compare_logits(original["cont_rows"], loader.scores[N : N + CONT], original["cont"])
    assert metrics["kl"] < 1e-3 and metrics["top1"] == 1.0, metrics
    loader.n_tokens = N
    assert greedy(loader, prefix) == original["greedy"]


# ---- prefix sharing on every store --------------------------------------------------------------


@pytest.fixture(scope="module")
def contexts(gpl_tokens: list[int]) -> dict[str, Any]:
    """A and B share 3 chunks of 64; D diverges from both inside chunk 4. With their states and the
    logits after D evaluated as 192 + the rest tokens."""
    other = _llama(n_ctx=64).tokenize(sample_text("gfdl-1.3.txt").encode(), add_bos=False)
    a, b, d = gpl_tokens[:230], gpl_tokens[:192] + other[:100], gpl_tokens[:200] + other[100:150]
    llm = _llama(n_ctx=512)
    states = {}
    for name, tokens in (("a", a), ("b", b)):
        llm.reset()
        llm.eval(tokens)
        states[name] = capture_state(llm, None)
    llm.reset()
    llm.eval(d[:192])
    llm.eval(d[192:])
    return {"tokens": {"a": a, "b": b, "d": d}, "states": states, "d_row": llm.scores[len(d) - 1].copy()}


@pytest.fixture(params=["file", "redis", "http"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "file":
        yield tmp_path.as_uri()
    elif request.param == "redis":
        yield request.getfixturevalue("redis_url") + f"?prefix=chunks{os.getpid()}:"
    else:
        yield request.getfixturevalue("http_server")[0]


def _manifest_url(store_url: str, name: str) -> str:
    base, _, query = store_url.partition("?")
    return f"{base}/{name}" + (f"?{query}" if query else "")


def test_prefix_sharing_on_every_store(contexts: dict[str, Any], store_url: str) -> None:
    tokens, states = contexts["tokens"], contexts["states"]
    llm = _llama(n_ctx=512)
    with stores.open_store(store_url) as store:
        _set(llm, states["a"], tokens["a"])
        saved_a = chunks.save_chunked(llm, _manifest_url(store_url, "ctx-a"), levels=LEVELS, chunk_tokens=64)
        assert (saved_a.chunks, saved_a.objects_written, saved_a.objects_present) == (4, 4 * 2 + 2 + 1, 0)
        _set(llm, states["b"], tokens["b"])
        saved_b = chunks.save_chunked(llm, _manifest_url(store_url, "ctx-b"), levels=LEVELS, chunk_tokens=64)
        # B's 3 shared chunks were not uploaded again: 4 + 2 distinct chunks per level
        assert (saved_b.chunks, saved_b.objects_present, saved_b.objects_written) == (5, 3 * 2, 2 * 2 + 2 + 1)
        assert len(_objects(store, "chunks")) == (4 + 2) * 2
        assert len(_objects(store, "stats")) == 4 and len(_objects(store, "skeletons")) == 2

        loaded = chunks.load_chunked(llm, _manifest_url(store_url, "ctx-a"))
        assert loaded.tokens == 230 and capture_state(llm, None) == states["a"]

        d = tokens["d"]
        match = chunks.longest_prefix(store_url, llm, d, chunk_tokens=64)
        assert (match.chunks, match.positions, match.levels) == (3, 192, [LEVELS] * 3)
        assert match.keys == chunks.chain_keys(model_fingerprint(llm), tokens["a"], 64)[:3]
        llm.reset()
        loaded = chunks.load_prefix(llm, store_url, d, chunk_tokens=64)
        assert loaded.tokens == 192 and llm.n_tokens == 192 and loaded.extra["levels"] == {"lossless": 3}
        llm.eval(d[192:])
        np.testing.assert_array_equal(llm.scores[len(d) - 1], contexts["d_row"])

        # a save after the hit writes only D's new chunk: the loaded prefix is never re-encoded
        shared = {key: store.get(key) for key in _objects(store, "chunks")}
        saved_d = chunks.save_chunked(llm, _manifest_url(store_url, "ctx-d"), levels=LEVELS, chunk_tokens=64)
        assert (saved_d.objects_present, saved_d.objects_written) == (3 * 2, 1 * 2 + 2 + 1)
        assert all(store.get(key) == value for key, value in shared.items())
        assert len(_objects(store, "chunks")) == (4 + 2 + 1) * 2


def test_a_prefix_lookup_asks_an_http_store_in_one_request_per_round(
    contexts: dict[str, Any], http_server: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup sent one HEAD per level per chunk (a proxy's, at every request: 105 chunks took
    420 round trips); now one POST per round of chunks (4, then 16, ...), with the same answer."""
    from llama_cachegen.stores.http import HttpStore

    base, c = http_server[0], 48  # a chunk size no other test stores these tokens at
    llm = _llama(n_ctx=512)
    _set(llm, contexts["states"]["a"], contexts["tokens"]["a"])
    chunks.save_chunked(llm, f"{base}/ctx-rounds", levels=LEVELS, chunk_tokens=c)
    sent: list[str] = []
    request = HttpStore._request

    def counted(self: HttpStore, method: str, key: str, *args: Any, **kwargs: Any) -> Any:
        sent.append(method)
        return request(self, method, key, *args, **kwargs)

    monkeypatch.setattr(HttpStore, "_request", counted)
    for tokens, stored, rounds in (
        # 6 chunks, A's first 4 (192 tokens): 4 found, then 1 of 2, then A's last chunk (a partial
        # one) among the lengths of D's next chunk (_tail)
        (contexts["tokens"]["d"], 4, 3),
        (contexts["tokens"]["a"], 5, 2),
        (contexts["tokens"]["d"][1:], 0, 2),
    ):
        sent.clear()
        match = chunks.longest_prefix(base, llm, tokens, chunk_tokens=c)
        assert (match.chunks, match.levels, sent) == (stored, [LEVELS] * stored, ["POST"] * rounds)


def test_a_prefix_lookup_without_a_size_finds_chunks_of_any_size(
    contexts: dict[str, Any], tmp_path: Path
) -> None:
    """load_prefix and longest_prefix without chunk_tokens find chunks stored at another size: a
    save at 64, and the prompt cache's 128-token chunks (a lookup at the default 256 found neither,
    and said nothing); a size named is the only one tried, as before."""
    from llama_cachegen import CompressedStateCache

    tokens, states = contexts["tokens"], contexts["states"]
    llm = _llama(n_ctx=512)
    _set(llm, states["a"], tokens["a"])
    chunks.save_chunked(llm, tmp_path / "saves" / "ctx", levels=("lossless",), chunk_tokens=64)
    cache = CompressedStateCache(tmp_path / "prompts", level="lossless", model=llm)
    cache[tuple(tokens["a"])] = llm.save_state()
    for store, size, positions in ((tmp_path / "saves", 64, 230), (tmp_path / "prompts", 128, 128)):
        assert chunks.longest_prefix(store, llm, tokens["a"], chunk_tokens=256).chunks == 0
        match = chunks.longest_prefix(store, llm, tokens["a"])
        assert (match.chunk_tokens, match.positions) == (size, positions)
        other = _llama(n_ctx=512)
        loaded = chunks.load_prefix(other, store, tokens["a"])
        assert loaded.tokens == positions and loaded.extra["match"].chunk_tokens == size
        if positions == len(tokens["a"]):
            assert capture_state(other, None) == states["a"]
    # the longest chain wins where several sizes hold the prefix
    chunks.save_chunked(llm, tmp_path / "prompts" / "ctx", levels=("lossless",), chunk_tokens=32)
    assert chunks.longest_prefix(tmp_path / "prompts", llm, tokens["a"]).positions == 230
    # a partial chunk at the default size (a short save) does not hide a longer chain at another
    first = _llama(n_ctx=512)
    first.eval(tokens["a"][:100])
    chunks.save_chunked(first, tmp_path / "mixed" / "short", levels=("lossless",))
    chunks.save_chunked(llm, tmp_path / "mixed" / "long", levels=("lossless",), chunk_tokens=64)
    assert chunks.longest_prefix(tmp_path / "mixed", llm, tokens["a"] + [13]).positions == 230
    # a save shorter than its chunk size: one partial chunk, found by the tokens it holds
    short = tokens["a"][:81]
    writer = _llama(n_ctx=512)
    writer.eval(short)
    for size in (128, 512):
        chunks.save_chunked(
            writer, tmp_path / f"short{size}" / "ctx", levels=("lossless",), chunk_tokens=size
        )
        match = chunks.longest_prefix(tmp_path / f"short{size}", llm, short)
        assert (match.chunk_tokens, match.positions) == (size, 81)


def test_a_query_that_extends_a_save_finds_its_last_partial_chunk(
    contexts: dict[str, Any], tmp_path: Path
) -> None:
    """A save's last chunk holds as many tokens as the save had; a follow-up question after a saved
    context matched up to the last whole chunk and computed the rest of the save again (a save
    shorter than one chunk: all of it). Its partial chunk is found among the lengths that fit."""
    tokens, states = contexts["tokens"], contexts["states"]
    llm = _llama(n_ctx=512)
    _set(llm, states["a"], tokens["a"])
    chunks.save_chunked(llm, tmp_path / "ctx", levels=("lossless",), chunk_tokens=64)
    follow_up = tokens["a"] + tokens["b"][200:220]  # 230 saved tokens (chunk 3: 38), then 20 more
    for size in (64, None):
        match = chunks.longest_prefix(tmp_path, llm, follow_up, chunk_tokens=size)
        assert (match.chunks, match.positions, match.levels) == (4, 230, [("lossless",)] * 4)
    other = _llama(n_ctx=512)
    assert chunks.load_prefix(other, tmp_path, follow_up).tokens == 230
    assert capture_state(other, None) == states["a"]
    # shorter than one chunk at the default size (256), and asked without a size
    chunks.save_chunked(llm, tmp_path / "short" / "ctx", levels=("lossless",))
    assert chunks.longest_prefix(tmp_path / "short", llm, follow_up).positions == 230
    assert chunks.longest_prefix(tmp_path / "short", llm, follow_up[:100]).positions == 0  # none that short


def test_a_level_asked_of_a_whole_container(contexts: dict[str, Any], tmp_path: Path) -> None:
    """load_compressed_state(url, level=) where a save with level= wrote one whole container: at its
    own level it loads (as without level=), at another it is refused naming the level stored (it
    was "not a llama-cachegen manifest", a valid container called corrupt)."""
    llm = _llama(n_ctx=512)
    _set(llm, contexts["states"]["a"], contexts["tokens"]["a"])
    llm.save_compressed_state(tmp_path / "whole.lcg", level="lossless")
    for level in ("lossless", 0, None):
        other = _llama(n_ctx=512)
        assert other.load_compressed_state(tmp_path / "whole.lcg", level=level).tokens == 230
        assert capture_state(other, None) == contexts["states"]["a"]
    _refused(
        other,
        lambda: other.load_compressed_state(tmp_path / "whole.lcg", level="high"),
        InvalidArgumentError,
        "one whole container at lossless, not a chunked context: level='high'",
    )
    # damaged, it says so; a chunk object is no context
    blob = bytearray((tmp_path / "whole.lcg").read_bytes())
    blob[8] ^= 1
    (tmp_path / "damaged.lcg").write_bytes(blob)
    with pytest.raises(ChecksumError):
        other.load_compressed_state(tmp_path / "damaged.lcg", level="lossless")
    llm.save_compressed_state(tmp_path / "ctx", levels=("lossless",), chunk_tokens=64)
    chunk = next(p for p in tmp_path.rglob("*") if p.is_file() and "/chunks/" in p.as_posix())
    with pytest.raises(InvalidArgumentError, match="a chunked context's chunk object: load the context from"):
        other.load_compressed_state(chunk, level="lossless")


# ---- refusals -----------------------------------------------------------------------------------


@pytest.fixture
def saved_small(contexts: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """Context A saved at C = 64 into a fresh directory, and a target context holding other tokens."""
    writer = _llama(n_ctx=512, logits_all=True)  # its manifest keeps the last logits
    _set(writer, contexts["states"]["a"], contexts["tokens"]["a"])
    url = tmp_path / "ctx"
    chunks.save_chunked(writer, url, levels=LEVELS, chunk_tokens=64)
    target = _llama(n_ctx=512)
    target.eval(target.tokenize(b"An unrelated context that must survive a failed load."))
    store = stores.open_store(str(tmp_path))
    return {
        "url": url,
        "store": store,
        "manifest": chunks.read_manifest(url),
        "target": target,
        "writer": writer,
    }


def _refused(target: Llama, load: Any, exc: type[Exception], match: str | None = None) -> None:
    before, n_tokens = capture_state(target, None), target.n_tokens
    ids = target.input_ids[:n_tokens].copy()
    with pytest.raises(exc, match=match):
        load()
    assert capture_state(target, None) == before and target.n_tokens == n_tokens
    assert np.array_equal(target.input_ids[:n_tokens], ids)


def test_bad_chunks_are_refused_and_leave_the_context(saved_small: dict[str, Any]) -> None:
    store, manifest, target, url = (saved_small[k] for k in ("store", "manifest", "target", "url"))
    key = [f"{PREFIX}chunks/{entry.key}/lossless" for entry in manifest.chunks]
    good = store.get(key[2])
    load = lambda: chunks.load_chunked(target, url)  # noqa: E731

    store.put(key[2], store.get(key[1]))  # another chunk under this key
    _refused(target, load, CorruptDataError, "holds another chunk")
    store.put(key[2], good[: len(good) // 2])
    _refused(target, load, TruncatedDataError)
    store.put(key[2], good)
    os.truncate(saved_small["url"].parent / key[2], 1 << 30)  # more than a chunk can hold: not read
    _refused(target, load, LimitExceededError, "more than")
    assert not store.exists(key[2])  # no chunk is that large: removed, or every load would read it
    store.put(key[2], good)
    # statistics and a skeleton planted at 1 GiB: read no further than the model's bound for them;
    # statistics past theirs are removed, a skeleton (a heuristic bound) is refused and kept
    stats_key = f"{PREFIX}stats/{manifest.stats['lossless']}"
    skeleton_key = f"{PREFIX}skeletons/{manifest.skeleton}"
    for planted, removed in ((stats_key, True), (skeleton_key, False)):
        kept = store.get(planted)
        os.truncate(saved_small["url"].parent / planted, 1 << 30)
        _refused(target, load, LimitExceededError, "more than")
        assert store.exists(planted) != removed
        store.put(planted, kept)
    flipped = bytearray(good)
    flipped[len(flipped) * 3 // 4] ^= 0x10
    store.put(key[2], bytes(flipped))
    _refused(target, load, ChecksumError)

    # a chunk that is right in every way but names another model's fingerprint
    meta = chunks.ChunkMeta.unpack(codec.user_meta(good))
    meta.fingerprint_key = "0" * 16
    state = capture_state(saved_small["writer"], None)
    chunker = codec.Chunker(state, "lossless", kind="full_buffer")
    store.put(key[2], chunker.chunk(meta.begin, meta.end, bytes.fromhex(meta.stats_id), meta.pack()))
    _refused(target, load, ModelMismatchError, "another model")
    meta = chunks.ChunkMeta.unpack(codec.user_meta(good))
    meta.level = ["lossless"]  # type: ignore[assignment]  # JSON a writer of its own could make
    store.put(key[2], chunker.chunk(meta.begin, meta.end, bytes.fromhex(meta.stats_id), meta.pack()))
    _refused(target, load, CorruptDataError, "level")
    store.put(key[2], good)

    stats_key = f"{PREFIX}stats/{meta.stats_id}"
    stats = store.get(stats_key)
    store.put(stats_key, store.get(f"{PREFIX}stats/{manifest.stats['balanced']}"))
    _refused(target, load, CorruptDataError, "does not hash to its id")
    store.put(stats_key, stats)

    chunks.load_chunked(target, url)  # all repaired: it loads, and the context works
    assert target.n_tokens == 230 and greedy(target, target.input_ids[:230].tolist())


def test_a_chunk_damaged_in_the_store_is_removed_and_a_save_heals_it(saved_small: dict[str, Any]) -> None:
    """A byte of a chunk's K/V flipped where it is stored: the load is refused (the context as it
    was) and the object removed, since a save skips objects that exist and every later load would
    fail on it; saving the context again writes it, and it loads."""
    store, manifest, target, url = (saved_small[k] for k in ("store", "manifest", "target", "url"))
    key = f"{PREFIX}chunks/{manifest.chunks[1].key}/lossless"
    good = store.get(key)
    at = len(good) // 2  # inside a tensor section
    store.put(key, good[:at] + bytes([good[at] ^ 1]) + good[at + 1 :])
    _refused(target, lambda: chunks.load_chunked(target, url), ChecksumError, "tensor section.*removed")
    assert not store.exists(key)
    report = chunks.save_chunked(saved_small["writer"], url, levels=LEVELS, chunk_tokens=64)
    assert store.exists(key) and report.objects_written >= 1
    chunks.load_chunked(target, url)
    assert capture_state(target, None) == capture_state(saved_small["writer"], None)


def test_bad_manifests_are_refused(saved_small: dict[str, Any]) -> None:
    store, target, url = saved_small["store"], saved_small["target"], saved_small["url"]
    good = store.get("ctx")
    load = lambda: chunks.load_chunked(target, url)  # noqa: E731
    assert saved_small["manifest"].meta.logits is not None
    for bad in (good[:100], good[:-4], b"LCGM\x02\x00\x00\x00\xff\xff\xff\xff"):
        store.put("ctx", bad)
        _refused(target, load, CorruptDataError)
    # what a reader checks behind the digest (a writer of its own could have made these)
    body = good[: -envelope.DIGEST_BYTES]
    for bad, match in (
        (b"LCGM\x02\x00\x00\x00\xff\xff\xff\xff", "overruns"),
        (body.replace(b'"chunk_tokens":64', b'"chunk_tokens":65'), "do not recompute"),
        (body.replace(b'"chunk_tokens":64', b'"chunk_tokens":10'), "chunk_tokens"),  # < 16
    ):
        store.put("ctx", envelope.with_digest(bad))
        _refused(target, load, CorruptDataError, match)
    # one bit anywhere (the header, the token ids, the last logits, the digest): the SHA-256 says so
    for at in (20, len(good) // 2, len(good) - 40, len(good) - 1):
        store.put("ctx", good[:at] + bytes([good[at] ^ 0x80]) + good[at + 1 :])
        _refused(target, load, ChecksumError, "manifest checksum")
    for version in (b"\x01", b"\x03"):  # 1: before manifests carried their SHA-256
        store.put("ctx", b"LCGM" + version + good[5:])
        _refused(target, load, UnsupportedVersionError)
    tokens = saved_small["manifest"].meta.tokens.copy()
    tokens[100] += 1  # keys no longer recompute from the tokens
    forged = saved_small["manifest"]
    forged.meta.tokens = tokens
    store.put("ctx", forged.pack())
    _refused(target, load, CorruptDataError, "do not recompute")
    store.put("ctx", good)


def test_a_bad_tag_is_refused_when_a_key_is_set(
    contexts: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(stores.KEY_ENV, "the right key")
    writer = _llama(n_ctx=512)
    _set(writer, contexts["states"]["a"], contexts["tokens"]["a"])
    url = tmp_path / "ctx"
    chunks.save_chunked(writer, url, levels=("lossless",), chunk_tokens=64)
    key = f"{PREFIX}chunks/{chunks.read_manifest(url).chunks[1].key}/lossless"
    with stores.open_store(str(tmp_path), auth_key="another key") as other:
        other.put(key, stores.open_store(str(tmp_path)).get(key))
    target = _llama(n_ctx=512)
    target.eval(target.tokenize(b"Survives."))
    _refused(target, lambda: chunks.load_chunked(target, url), AuthenticationError)
    tokens = contexts["tokens"]["a"]
    _refused(
        target, lambda: chunks.load_prefix(target, tmp_path, tokens, chunk_tokens=64), AuthenticationError
    )


# ---- fallback and arguments ---------------------------------------------------------------------


def test_a_state_of_two_sequences_is_saved_whole(gpl_tokens: list[int], tmp_path: Path) -> None:
    llm = _llama(n_ctx=512, n_seq_max=2)
    llm.eval(gpl_tokens[:40])
    seq1 = capture_state(llm, 0)
    llm.reset()
    llm.eval(gpl_tokens[100:170])
    assert restore_state(llm, seq1, 1)  # sequence 1: other tokens at the same positions
    state = capture_state(llm, None)
    report = chunks.save_chunked(llm, tmp_path / "two", levels=LEVELS, chunk_tokens=64)
    assert report.fallback and report.chunk_tokens is None and report.chunks == 0
    assert report.objects_written == 2 and sorted(report.level_bytes) == sorted(LEVELS)
    manifest = chunks.read_manifest(tmp_path / "two")
    assert manifest.levels == LEVELS and not manifest.chunks
    other = _llama(n_ctx=512, n_seq_max=2)
    loaded = chunks.load_chunked(other, tmp_path / "two")
    assert loaded.extra["levels"] == {"lossless": 1} and other.n_tokens == 70
    assert capture_state(other, None) == state


@pytest.mark.parametrize("how", ["hole-filled-by-a-copy", "another-sequence-in-the-hole"])
def test_cells_of_another_sequence_are_never_chunks_of_this_one(
    gpl_tokens: list[int], tmp_path: Path, how: str
) -> None:
    """Sequence 0 with a hole (seq_rm) that sequence 1's cells fill: the cells still held positions
    0..n-1 once each, so the context was cut into chunks keyed by sequence 0's tokens, and another
    context's load_prefix of those tokens got the hole, or sequence 1's K/V of other tokens as
    theirs (logits 1-2 apart). Such a state is saved whole."""
    import llama_cpp

    tokens = gpl_tokens[:192]
    llm = _llama(n_ctx=512, n_seq_max=2)
    llm.eval(tokens)
    memory = llama_cpp.llama_get_memory(llm.ctx)
    if how == "hole-filled-by-a-copy":
        llama_cpp.llama_memory_seq_cp(memory, 0, 1, -1, -1)
        llama_cpp.llama_memory_seq_rm(memory, 0, 40, 60)
    else:  # sequence 1 alone: 20 other tokens at the positions sequence 0 gave up
        llama_cpp.llama_memory_seq_rm(memory, 0, 40, 60)
        assert stream._decode_tokens(llm.ctx, np.asarray(gpl_tokens[300:320]), 40, 1, 512)
    report = chunks.save_chunked(llm, tmp_path / "ctx", levels=("lossless",), chunk_tokens=64)
    assert report.fallback and "not one sequence" in report.fallback and report.chunks == 0
    assert chunks.load_prefix(_llama(n_ctx=512, n_seq_max=2), tmp_path, tokens, chunk_tokens=64).tokens == 0


def test_lossy_kv_copied_from_another_sequence_is_not_stored_as_exact(
    gpl_tokens: list[int], tmp_path: Path
) -> None:
    """A compact load into sequence 1, copied to sequence 0 (llama_memory_seq_cp, which this
    library does not see): a lossless save of sequence 0 stored the compact K/V as its tokens'
    exact chunks (another context's load_prefix at level="lossless" then got logits 2 apart)."""
    import llama_cpp

    tokens = gpl_tokens[:192]
    src = _llama(n_ctx=512)
    src.eval(tokens)
    llm = _llama(n_ctx=512, n_seq_max=2)
    llm.load_compressed_state(src.save_compressed_state(level="compact", seq_id=0), seq_id=1)
    llama_cpp.llama_memory_seq_cp(llama_cpp.llama_get_memory(llm.ctx), 1, 0, -1, -1)
    llm.input_ids[: len(tokens)] = tokens
    llm.n_tokens = len(tokens)
    report = chunks.save_chunked(llm, tmp_path / "ctx", levels=("lossless",), chunk_tokens=64, seq_id=0)
    assert report.fallback and "loaded at compact" in report.fallback and report.chunks == 0


def test_a_lossy_whole_load_is_recorded_for_every_sequence_it_holds(
    gpl_tokens: list[int], tmp_path: Path
) -> None:
    """A whole context of two sequences loaded at balanced: sequence 1's K/V is balanced too, and
    a lossless save of sequence 1 is stored whole (it was recorded for sequence 0 only, so the
    save stored sequence 1's decoded K/V as its tokens' exact chunks). A lossless load clears it."""
    from llama_cachegen.llama import lossy_level

    llm = _llama(n_ctx=512, n_seq_max=2)
    tokens = gpl_tokens[:70]  # sequence 1's
    llm.eval(tokens)
    seq1 = capture_state(llm, 0)
    llm.reset()
    llm.eval(gpl_tokens[100:140])
    assert restore_state(llm, seq1, 1)
    other = _llama(n_ctx=512, n_seq_max=2)
    other.load_compressed_state(llm.save_compressed_state(level="balanced"))
    assert lossy_level(other, 1, np.asarray(tokens, np.intc)) == "balanced"
    report = chunks.save_chunked(
        other, tmp_path / "seq1", levels=("lossless",), chunk_tokens=64, seq_id=1, tokens=tokens
    )
    assert report.fallback and "balanced" in report.fallback and report.chunk_tokens is None
    assert not list(stores.open_store(str(tmp_path)).list(f"{PREFIX}chunks/"))
    other.load_compressed_state(llm.save_compressed_state(level="lossless"))
    assert lossy_level(other, 1, np.asarray(tokens, np.intc)) is None


def test_a_missing_skeleton_costs_the_prefixes_ending_on_it_only(
    gpl_tokens: list[int], tmp_path: Path
) -> None:
    """A context saved, grown and saved again: its first chunks name the first save's skeleton.
    With that one gone, a load of the short prefix finds nothing and removes nothing (it removed
    the chunks, which the long prefix, ending on a skeleton that is there, still needed)."""
    writer = _llama(n_ctx=512)
    tokens = gpl_tokens[:128]
    writer.eval(tokens[:64])
    chunks.save_chunked(writer, tmp_path / "short", levels=("balanced",), chunk_tokens=32)
    store = stores.open_store(str(tmp_path))
    (first,) = store.list(f"{PREFIX}skeletons/")
    writer.eval(tokens[64:])
    chunks.save_chunked(writer, tmp_path / "long", levels=("balanced",), chunk_tokens=32)
    store.delete(first.key)
    for _ in range(2):
        assert chunks.load_prefix(_llama(n_ctx=512), tmp_path, tokens[:64], chunk_tokens=32).tokens == 0
        assert chunks.load_prefix(_llama(n_ctx=512), tmp_path, tokens, chunk_tokens=32).tokens == 128
    assert len(store.list(f"{PREFIX}chunks/")) == 4


def test_lossy_kv_stays_lossy_through_a_lossless_container_and_without_tokens(
    gpl_tokens: list[int], tmp_path: Path
) -> None:
    """K/V loaded at balanced and saved whole at lossless: the load of that container recorded the
    context exact, and its lossless chunks held balanced K/V (the envelope now carries the saver's
    record). A lossy state saved without token ids (a sequence's default) was recorded for no
    tokens at all: held by none, so it was exact too (now: any tokens hold it)."""
    from llama_cachegen.llama import lossy_level

    tokens = gpl_tokens[:70]
    src = _llama(n_ctx=512, n_seq_max=2)
    src.eval(tokens)
    mid = _llama(n_ctx=512, n_seq_max=2)
    mid.load_compressed_state(src.save_compressed_state(level="balanced"))
    dst = _llama(n_ctx=512, n_seq_max=2)
    dst.load_compressed_state(mid.save_compressed_state(level="lossless"))
    ids = np.asarray(tokens, np.intc)
    assert lossy_level(dst, None, ids) == "balanced"
    report = chunks.save_chunked(dst, tmp_path / "a", levels=("lossless",), chunk_tokens=64)
    assert report.fallback and report.chunk_tokens is None
    seq1 = src.save_compressed_state(level="balanced", seq_id=0, tokens=[])
    dst.load_compressed_state(seq1, seq_id=1)
    assert lossy_level(dst, 1, ids) == "balanced"
    report = chunks.save_chunked(
        dst, tmp_path / "b", levels=("lossless",), chunk_tokens=64, seq_id=1, tokens=tokens
    )
    assert report.fallback and report.chunk_tokens is None
    assert not stores.open_store(str(tmp_path)).list(f"{PREFIX}chunks/")
    # a lossless container, without token ids, of a sequence loaded balanced with them
    dst.load_compressed_state(src.save_compressed_state(level="balanced", seq_id=0), seq_id=1)
    other = _llama(n_ctx=512, n_seq_max=2)
    other.load_compressed_state(dst.save_compressed_state(level="lossless", seq_id=1, tokens=[]), seq_id=1)
    assert lossy_level(other, 1, ids) == "balanced"


def _saved_balanced(
    gpl_tokens: list[int], tmp_path: Path
) -> tuple[Llama, list[int], stores.Store, stores.EntryInfo]:
    """150 tokens saved at balanced in 32-token chunks under tmp_path/ctx: the writer, the tokens,
    the store and its one statistics entry."""
    writer = _llama(n_ctx=512)
    tokens = gpl_tokens[:150]
    writer.eval(tokens)
    chunks.save_chunked(writer, tmp_path / "ctx", levels=("balanced",), chunk_tokens=32)
    store = stores.open_store(str(tmp_path))
    (stats,) = store.list(f"{PREFIX}stats/")
    return writer, tokens, store, stats


def test_statistics_damaged_in_the_store_are_removed_and_a_save_heals_them(
    gpl_tokens: list[int], tmp_path: Path
) -> None:
    """A byte of a statistics object flipped where it is stored: kept, it failed every load of
    its chunks for good, since saving the same state makes statistics of the same id, which the
    save skips as present (a prompt cache missed, and wrote its chunks again, at every turn)."""
    writer, _, store, stats = _saved_balanced(gpl_tokens, tmp_path)
    damaged = bytearray(store.get(stats.key))
    damaged[len(damaged) // 2] ^= 0x01
    store.put(stats.key, bytes(damaged))
    llm = _llama(n_ctx=512)
    with pytest.raises(CorruptDataError, match="does not hash to its id.*removed"):
        chunks.load_chunked(llm, tmp_path / "ctx")
    assert not store.exists(stats.key) and llm.n_tokens == 0
    chunks.save_chunked(writer, tmp_path / "ctx", levels=("balanced",), chunk_tokens=32)
    assert store.exists(stats.key)  # the same statistics, written again
    assert chunks.load_chunked(llm, tmp_path / "ctx").tokens == 150


def test_chunks_whose_statistics_are_gone_are_removed_and_saved_again(
    gpl_tokens: list[int], tmp_path: Path
) -> None:
    """Statistics evicted or deleted while their chunks stay: every load through those chunks
    failed, and saving again skipped the chunks (they exist), so it never healed. A load now removes
    them and finds what is left (nothing: a 0-token report); the next save writes them again. A
    chunk evicted between the lookup and its read: looked up again, the prefix before it loads."""
    writer, tokens, store, stats = _saved_balanced(gpl_tokens, tmp_path)
    store.delete(stats.key)
    llm = _llama(n_ctx=512)
    assert chunks.load_prefix(llm, tmp_path, tokens, chunk_tokens=32).tokens == 0
    assert not store.list(f"{PREFIX}chunks/") and llm.n_tokens == 0
    chunks.save_chunked(writer, tmp_path / "ctx", levels=("balanced",), chunk_tokens=32)
    assert chunks.load_prefix(llm, tmp_path, tokens, chunk_tokens=32).tokens == 150

    match = chunks._match
    evicted = []

    def match_then_evict(*args: Any, **kwargs: Any) -> chunks.PrefixMatch:
        found = match(*args, **kwargs)
        if not evicted:  # another process's eviction between the lookup and the read
            evicted.append(chunks._chunk_key(found.keys[-1], "balanced"))
            store.delete(evicted[0])
        return found

    chunks._match = match_then_evict
    try:
        assert chunks.load_prefix(_llama(n_ctx=512), tmp_path, tokens, chunk_tokens=32).tokens == 128
    finally:
        chunks._match = match
    assert len(store.list(f"{PREFIX}chunks/")) == 4


@pytest.mark.parametrize(
    "tokens", [[2**31], [-1], [10**9] * 20, ["a"], "abc", [1.5], [[1, 2], [3, 4]], [[1], [2, 3]]]
)
def test_token_ids_that_are_no_tokens_are_refused(loader: Llama, tmp_path: Path, tokens: Any) -> None:
    """numpy wrapped 2**31 or raised its own errors, cut 1.5 to 1, and ids past the vocabulary
    were saved and loaded as the context's tokens."""
    with pytest.raises(InvalidArgumentError, match="token ids"):
        chunks.load_prefix(loader, tmp_path, tokens, chunk_tokens=64)
    with pytest.raises(InvalidArgumentError, match="token ids"):
        chunks.longest_prefix(tmp_path, loader, tokens, chunk_tokens=64)
    with pytest.raises(InvalidArgumentError, match="token ids"):
        loader.save_compressed_state(tmp_path / "x.lcg", tokens=tokens)


def test_keys_chain_over_tokens_and_chunk_size(loader: Llama) -> None:
    fp = model_fingerprint(loader)
    keys = chunks.chain_keys(fp, list(range(200)), 64)
    assert len(keys) == 4 and chunks.chain_keys(fp, list(range(150)), 64)[:2] == keys[:2]
    assert chunks.chain_keys(fp, list(range(150)), 64)[2] != keys[2]  # a partial chunk keys only its tokens
    assert chunks.chain_keys(fp, list(range(200)), 32)[0] != keys[0]
    assert chunks.chain_keys({**fp, "type_k": "q8_0"}, list(range(200)), 64)[0] != keys[0]
    for bad in (8, 5000, 64.0):
        with pytest.raises(InvalidArgumentError):
            chunks.chain_keys(fp, [1, 2], bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        chunks.save_chunked(loader, "/tmp/unused", levels=("best",))


def test_llama_methods_save_in_chunks_and_load_either_format(
    contexts: dict[str, Any], tmp_path: Path
) -> None:
    import llama_cachegen

    assert (
        llama_cachegen.save_chunked is chunks.save_chunked
        and llama_cachegen.load_prefix is chunks.load_prefix
    )
    writer = _llama(n_ctx=512)
    _set(writer, contexts["states"]["a"], contexts["tokens"]["a"])
    assert writer.save_compressed_state(
        tmp_path / "ctx", levels=("lossless", "compact"), chunk_tokens=64
    ) == str(tmp_path / "ctx")
    writer.save_compressed_state(tmp_path / "whole.lcg", level="lossless")
    assert envelope.is_manifest((tmp_path / "ctx").read_bytes())
    assert (tmp_path / "whole.lcg").read_bytes()[:4] == b"LCGC"
    llm = _llama(n_ctx=512)
    report = llm.load_compressed_state(tmp_path / "ctx")
    assert report.extra["levels"] == {"lossless": 4} and capture_state(llm, None) == contexts["states"]["a"]
    assert llm.load_compressed_state((tmp_path / "ctx").as_uri(), level="compact").extra["levels"] == {
        "compact": 4
    }
    report = llama_cachegen.load_compressed_state(llm, (tmp_path / "whole.lcg").as_uri())
    assert report.tokens == 230 and capture_state(llm, None) == contexts["states"]["a"]
    with pytest.raises(InvalidArgumentError, match="from its URL"):
        llm.load_compressed_state((tmp_path / "ctx").read_bytes())
    with pytest.raises(InvalidArgumentError, match="levels="):
        writer.save_compressed_state(tmp_path / "x", levels=("high",), level="high")


def test_a_sequence_save_loads_its_prefix_into_another_sequence(
    contexts: dict[str, Any], tmp_path: Path
) -> None:
    writer = _llama(n_ctx=512)
    _set(writer, contexts["states"]["a"], contexts["tokens"]["a"])
    chunks.save_chunked(writer, tmp_path / "seq", levels=("lossless",), chunk_tokens=64, seq_id=0)
    assert chunks.read_manifest(tmp_path / "seq").meta.scope == "seq"
    llm = _llama(n_ctx=512, n_seq_max=2)
    llm.eval(contexts["tokens"]["b"][:20])
    seq0 = capture_state(llm, 0)
    report = chunks.load_prefix(llm, tmp_path, contexts["tokens"]["a"][:200], chunk_tokens=64, seq_id=1)
    assert (report.seq_id, report.tokens, report.cells, llm.n_tokens) == (1, 0, 192, 20)
    assert capture_state(llm, 0) == seq0 and codec.inspect_state(capture_state(llm, 1))["cells"] == 192
    chunks.save_chunked(writer, tmp_path / "all", levels=("lossless",), chunk_tokens=64)
    _refused(llm, lambda: chunks.load_chunked(llm, tmp_path / "all", seq_id=1), InvalidArgumentError, "whole")


def test_load_prefix_takes_a_level_by_number(saved_small: dict[str, Any], tmp_path: Path) -> None:
    """As load_chunked does: level=0 is lossless (it matched no chunk: the number was compared
    with level names)."""
    tokens = saved_small["manifest"].meta.tokens
    by_name = chunks.load_prefix(_llama(n_ctx=512), tmp_path, tokens, chunk_tokens=64, level="lossless")
    by_number = chunks.load_prefix(_llama(n_ctx=512), tmp_path, tokens, chunk_tokens=64, level=0)
    assert by_number.tokens == by_name.tokens == tokens.size == 230  # its tokens, all of them


def test_a_lora_context_shares_no_chunks_with_its_model(gpl_tokens: list[int], tmp_path: Path) -> None:
    """A LoRA adapter on K changes every key the context caches: its chunks are not the model's
    (they were: same fingerprint and keys, and each was served the other's K/V as its own)."""
    from tiny_models import write_lora_k

    lora = write_lora_k(tmp_path / "lora-k.gguf", n_layer=30, n_embd=576, n_embd_k=192)
    adapted, plain = _llama(n_ctx=512, lora_path=str(lora)), _llama(n_ctx=512)
    tokens = gpl_tokens[:130]
    adapted.eval(tokens)
    plain.eval(tokens)
    assert capture_state(adapted, None) != capture_state(plain, None)  # the adapter moves K
    fingerprint = model_fingerprint(adapted)
    assert fingerprint["lora"] and model_fingerprint(plain)["lora"] is None
    chunks.save_chunked(adapted, tmp_path / "adapted", levels=("lossless",), chunk_tokens=64)
    report = chunks.save_chunked(plain, tmp_path / "plain", levels=("lossless",), chunk_tokens=64)
    assert report.objects_written > 0  # none of the adapted context's chunks passed for its own
    _refused(plain, lambda: chunks.load_chunked(plain, tmp_path / "adapted"), ModelMismatchError, "lora")


def test_a_chunk_coded_at_another_level_than_its_key_and_header_say_is_refused(
    saved_small: dict[str, Any],
) -> None:
    """A chunk whose header names the level of its key (lossless) while its container is coded at
    another (balanced; statistics that exist and hash to their id): balanced K/V would load, and be
    recorded, as lossless. Refused by the container's own level."""
    store, manifest, target, url = (saved_small[k] for k in ("store", "manifest", "target", "url"))
    key = f"{PREFIX}chunks/{manifest.chunks[2].key}/lossless"
    good = store.get(key)
    meta = chunks.ChunkMeta.unpack(codec.user_meta(good))
    meta.stats_id = manifest.stats["balanced"]
    chunker = codec.Chunker(capture_state(saved_small["writer"], None), "balanced", kind="full_buffer")
    store.put(key, chunker.chunk(meta.begin, meta.end, bytes.fromhex(meta.stats_id), meta.pack()))
    _refused(target, lambda: chunks.load_chunked(target, url), CorruptDataError, "is coded at level balanced")
    store.put(key, good)
    chunks.load_chunked(target, url)


def test_a_chunk_whose_container_holds_other_positions_than_its_header_is_refused(
    saved_small: dict[str, Any],
) -> None:
    """A chunk whose header is right (key, tokens, begin/end of chunk 2) but whose container codes
    the rows of other positions (chunk 1's, as long): decoded, they would land on chunk 1's rows
    and leave chunk 2's zero. Refused: its container disagrees with its header."""
    store, manifest, target, url = (saved_small[k] for k in ("store", "manifest", "target", "url"))
    key = f"{PREFIX}chunks/{manifest.chunks[2].key}/lossless"
    good = store.get(key)
    meta = chunks.ChunkMeta.unpack(codec.user_meta(good))
    n = meta.end - meta.begin
    assert n == 64
    chunker = codec.Chunker(capture_state(saved_small["writer"], None), "lossless", kind="full_buffer")
    forged = chunker.chunk(meta.begin - n, meta.begin, bytes.fromhex(meta.stats_id), meta.pack())
    store.put(key, forged)
    _refused(target, lambda: chunks.load_chunked(target, url), CorruptDataError, "disagrees with its header")
    store.put(key, good)
    chunks.load_chunked(target, url)
    assert capture_state(target, None) == capture_state(saved_small["writer"], None)
