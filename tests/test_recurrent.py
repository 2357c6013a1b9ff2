"""Models with a recurrent state, on real llama.cpp: hybrids (LFM2: short-convolution layers and
attention layers; Jamba and Granite 4 H: Mamba(-2) layers and attention layers; Falcon-H1: both in
every layer) and purely recurrent ones (Mamba, RWKV-7),
tiny GGUFs with random weights (tiny_models.py). A recurrent state is of the last position only:
the attention KV compresses and chunks as any other, the recurrent part travels verbatim with
the whole context, and nothing ever pairs a prefix's KV with the state of a longer context."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import llama_cachegen as lcg
import numpy as np
import pytest
from conftest import multi_seq_llama
from llama_cachegen import chunks, codec, stream
from llama_cachegen.cache import CompressedStateCache
from llama_cachegen.errors import InvalidArgumentError, UnsupportedFormatError
from llama_cachegen.llama import (
    StateMeta,
    capture_state,
    load_compressed_state,
    lossy_level,
    model_fingerprint,
    save_compressed_state,
)
from llama_cachegen.proxy import Sharing, seq_buffer_to_slot_file
from llama_cachegen.shaper import Relay, Trace
from tiny_models import (
    LETTERS_ONLY,
    OTHER,
    TOKENS,
    C,
    N,
    continuation,
    make,
    reference_logits,
    write_falcon_h1,
    write_granitehybrid,
    write_jamba,
    write_lfm2,
    write_mamba,
    write_rwkv7,
)

# a hybrid's writer and how many of its layers attend
HYBRIDS = {
    "lfm2": (write_lfm2, 2),  # short convolutions, two layers of four attend
    "jamba": (write_jamba, 2),  # Mamba layers, two of four attend
    "granitehybrid": (write_granitehybrid, 2),  # Mamba-2 layers, two of five attend (2 and 1 KV heads)
    "falcon-h1": (write_falcon_h1, 3),  # attention and Mamba-2 side by side in every layer
}


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return HYBRIDS[request.param][0](tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf")


@pytest.fixture(scope="module", params=["mamba", "rwkv7"])
def recurrent(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model of a recurrent state only: Mamba, or RWKV-7 (a token-shift and a WKV state)."""
    write = write_mamba if request.param == "mamba" else write_rwkv7
    return write(tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf")


@pytest.fixture(scope="module")
def reference(hybrid: Path) -> dict[str, np.ndarray]:
    return reference_logits(hybrid)


@pytest.fixture(scope="module")
def source(hybrid: Path) -> lcg.Llama:
    llm = make(hybrid)
    llm.eval(TOKENS)
    return llm


def test_a_hybrid_state_is_its_attention_kv_plus_a_verbatim_tail(hybrid: Path, source: lcg.Llama) -> None:
    info = codec.inspect_state(capture_state(source, None))
    # one KV cache of the layers that attend, every position; the recurrent state follows it and
    # is carried as it is
    layers = HYBRIDS[hybrid.stem][1]
    assert (info["caches"], info["layers"], info["positions"], info["tail"]) == (1, layers, (0, N), True)


@pytest.mark.parametrize("level", ["lossless", "balanced"])
def test_hybrid_whole_and_chunked_round_trips(
    tmp_path: Path, hybrid: Path, source: lcg.Llama, reference: dict[str, np.ndarray], level: str
) -> None:
    save_compressed_state(source, tmp_path / "ctx.lcg", level=level)
    chunks.save_chunked(source, f"file://{tmp_path}/store/ctx", levels=(level,), chunk_tokens=C)
    for load in (
        lambda llm: load_compressed_state(llm, tmp_path / "ctx.lcg"),
        lambda llm: chunks.load_chunked(llm, f"file://{tmp_path}/store/ctx"),
    ):
        llm = make(hybrid)
        load(llm)
        got = continuation(llm, N)
        if level == "lossless":
            np.testing.assert_array_equal(got, reference["all"])
        else:  # random weights: only that the lossy state loads and runs
            assert np.isfinite(got).all()


def test_a_hybrid_prefix_is_refused_never_paired_with_the_longer_state(
    tmp_path: Path, hybrid: Path, source: lcg.Llama, reference: dict[str, np.ndarray]
) -> None:
    chunks.save_chunked(source, f"file://{tmp_path}/ctx", levels=("lossless",), chunk_tokens=C)
    llm = make(hybrid)
    with pytest.raises(UnsupportedFormatError, match="recurrent part.*load it whole"):  # and what to do
        chunks.load_prefix(llm, f"file://{tmp_path}", TOKENS[:200] + OTHER, chunk_tokens=C)
    assert llm.n_tokens == 0
    # the whole context is a prefix of itself: its full length loads
    report = chunks.load_prefix(llm, f"file://{tmp_path}", TOKENS, chunk_tokens=C)
    assert report.tokens == N
    np.testing.assert_array_equal(continuation(llm, N), reference["all"])


def test_a_hybrid_stream_computes_from_the_first_token_after_a_failed_chunk(
    tmp_path: Path, hybrid: Path, source: lcg.Llama, reference: dict[str, np.ndarray]
) -> None:
    """Chunks 0-1 arrive, chunk 2 is damaged (fails twice): what is not in the buffer is computed
    from text. A recurrent state cannot be restored for a prefix, so llama.cpp computes from
    position 0 (the load failed before)."""
    url = f"file://{tmp_path}/ctx"
    chunks.save_chunked(source, url, levels=("lossless",), chunk_tokens=C)
    key = chunks.read_manifest(url).chunks[2].key
    obj = tmp_path / chunks._chunk_key(key, "lossless")
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x40
    obj.write_bytes(bytes(data))
    llm = make(hybrid)
    report = stream.load_streaming(llm, url)
    assert report.text_chunks[0] == 2 and report.fallback
    np.testing.assert_array_equal(continuation(llm, N), reference["all"])


def test_the_prompt_cache_of_a_hybrid_serves_whole_contexts_that_start_the_prompt(
    tmp_path: Path, hybrid: Path, source: lcg.Llama
) -> None:
    """No prefix can be cut from a hybrid's state: the cache stores whole contexts and serves the
    longest whose tokens all start the prompt; chunks that save_chunked stored beside them stay."""
    store = f"file://{tmp_path}"
    chunks.save_chunked(source, f"{store}/ctx", levels=("balanced",), chunk_tokens=C)
    saved = {p for p in tmp_path.rglob("*") if p.is_file()}

    def complete(prompt: list[int], cached: bool) -> tuple[str, CompressedStateCache, lcg.Llama]:
        llm = make(hybrid)  # a fresh context each time: llama-cpp-python cannot cut one back
        cache = CompressedStateCache(store, chunk_tokens=C, level="lossless")
        if cached:
            llm.set_cache(cache)
        out = llm.create_completion(prompt, max_tokens=4, temperature=0.0, logit_bias=LETTERS_ONLY)
        return out["choices"][0]["text"], cache, llm

    first, cache, llm = complete(TOKENS[:200], True)  # a miss that stores the context
    assert (cache.hits, cache.misses) == (0, 1)
    follow_up = [int(t) for t in llm.input_ids[: llm.n_tokens]] + OTHER[:20]
    first_follow_up, cache, _ = complete(follow_up, True)
    assert cache.hits == 1 and first_follow_up == complete(follow_up, False)[0]
    assert complete(TOKENS[:150], True)[1].hits == 0  # a stored context longer than the prompt: no hit
    snapshots = [p for p in tmp_path.rglob("*") if "snapshots" in p.parts and p.is_file()]
    assert len(snapshots) >= 2 and saved <= {p for p in tmp_path.rglob("*") if p.is_file()}
    (damaged,) = (p for p in snapshots if p.name.startswith(f"{llm.n_tokens}-"))  # what follow_up hit
    other = next(p for p in snapshots if p != damaged)
    good = damaged.read_bytes()
    damaged.write_bytes(other.read_bytes())  # another context filed under this one's name
    text, cache, _ = complete(follow_up, True)
    assert (cache.hits, cache.misses) == (0, 1) and not damaged.exists() and text == first_follow_up
    damaged.write_bytes(good[:-50])  # cut short: a miss, and it goes
    text, cache, _ = complete(follow_up, True)
    assert (cache.hits, cache.misses) == (0, 1) and not damaged.exists() and text == first_follow_up


def test_snapshots_keep_their_level_their_sequence_and_their_neighbours(tmp_path: Path, hybrid: Path) -> None:
    """Snapshots are filed by level: a lossless cache never sees a compact cache's snapshot (it
    served one, recorded exact). A context holding K/V of a lossy hit is stored again losslessly
    with that record (encoded again at every hit-extend-save cycle, a conversation's first tokens
    drifted further each turn: logits 0.43 -> 3.9 apart after 8 turns). A state of two sequences
    and one larger than the capacity are not stored; eviction takes snapshots only."""
    store = tmp_path.as_uri()
    chunks.save_chunked(make(hybrid), f"{store}/empty", chunk_tokens=C)  # save_chunked's objects
    saved = {p for p in tmp_path.rglob("*") if p.is_file()}
    llm = make(hybrid)
    llm.eval(TOKENS[:100])
    compact = CompressedStateCache(store, chunk_tokens=C, level="compact", model=llm)
    compact[TOKENS[:100]] = llm.save_state()
    assert TOKENS[:120] in compact
    assert TOKENS[:120] not in CompressedStateCache(store, chunk_tokens=C, level="lossless", model=llm)

    reader = make(hybrid)  # hits the compact snapshot, computes 20 tokens more, saves
    cache = CompressedStateCache(store, chunk_tokens=C, level="compact", model=reader)
    reader.load_state(cache[TOKENS[:120]])
    reader.eval(TOKENS[100:120])
    cache[TOKENS[:120]] = reader.save_state()
    (again,) = (p for p in tmp_path.rglob("120-*") if p.is_file())
    blob = again.read_bytes()
    assert codec.inspect(blob)["level"] == "lossless"
    assert StateMeta.unpack(codec.user_meta(blob)).lossy == (0, "compact")
    last = make(hybrid)
    last.load_state(cache[TOKENS[:130]])  # the lossless container of compact K/V: recorded compact
    assert lossy_level(last, None, np.asarray(TOKENS[:120], np.intc)) == "compact"

    two = multi_seq_llama(hybrid, 2, True, n_ctx=1024, n_threads=1)
    two.eval(TOKENS[:90])  # (tokens no record holds, at the level of the records: only its sequences stop it)
    assert stream._decode_tokens(two.ctx, np.asarray(OTHER[:30], np.intc), 0, 1, int(two.n_batch))
    before = {p for p in tmp_path.rglob("*") if p.is_file()}
    CompressedStateCache(store, chunk_tokens=C, level="compact", model=two)[TOKENS[:90]] = two.save_state()
    assert {p for p in tmp_path.rglob("*") if p.is_file()} == before  # the other sequence is not shared

    # compact: the reader's record holds these tokens lossy, which a better cache would not store
    small = CompressedStateCache(store, chunk_tokens=C, level="compact", capacity_bytes=len(blob), model=llm)
    llm.eval(TOKENS[100:110])
    small[TOKENS[:110]] = llm.save_state()  # fits: the others go, save_chunked's objects stay
    kept = {p for p in tmp_path.rglob("*") if p.is_file()}
    assert saved < kept and [p.name[:4] for p in kept - saved] == ["110-"]
    llm.eval(TOKENS[110:300])
    small[TOKENS[:300]] = llm.save_state()  # larger than the capacity: not stored, nothing evicted
    assert {p for p in tmp_path.rglob("*") if p.is_file()} == kept


def test_a_snapshot_below_its_caches_level_is_refused(tmp_path: Path, hybrid: Path) -> None:
    """A snapshot filed under `balanced` that holds compact K/V (written by another tool, or
    forged in a store without a key): refused as corrupt, a miss, and it goes; one that is better
    than its level (lossless) serves."""
    llm = make(hybrid)
    llm.eval(TOKENS[:100])
    cache = CompressedStateCache(tmp_path.as_uri(), chunk_tokens=C, level="balanced", model=llm)
    key = cache._snapshot_key(np.asarray(TOKENS[:100], np.intc))
    meta = StateMeta(model_fingerprint(llm), "all", None, 1024, np.asarray(TOKENS[:100], np.intc))
    state = capture_state(llm, None)
    for level, hits in (("compact", 0), ("lossless", 1)):
        cache.store.put(key, codec.encode(state, level, kind="full_buffer", user_meta=meta.pack()))
        assert (TOKENS[:120] in cache) and cache.hits == 0
        if hits:
            assert cache[TOKENS[:120]].n_tokens == 100 and cache.hits == 1
        else:
            with pytest.raises(KeyError, match="below the cache's balanced"):
                cache[TOKENS[:120]]
            assert not cache.store.exists(key)


def test_a_hybrid_state_names_every_position_or_none(tmp_path: Path, hybrid: Path, source: lcg.Llama) -> None:
    """Fewer token ids than positions are fine where llama-cpp-python's next eval drops the rest;
    a recurrent state cannot be cut back (that eval failed in llama_decode): refused at the save,
    and a container that does so anyway is refused at the load, the context left as it was."""
    with pytest.raises(InvalidArgumentError, match="recurrent state"):
        save_compressed_state(source, tmp_path / "a.lcg", tokens=TOKENS[:250])
    meta = StateMeta(model_fingerprint(source), "all", None, 1024, np.asarray(TOKENS[:250], np.intc))
    blob = codec.encode(capture_state(source, None), "lossless", kind="full_buffer", user_meta=meta.pack())
    fresh = make(hybrid)
    fresh.eval(TOKENS[:10])
    with pytest.raises(UnsupportedFormatError, match="recurrent state cannot drop"):
        load_compressed_state(fresh, blob)
    other = make(hybrid)
    other.eval(TOKENS[:10])
    assert fresh.n_tokens == 10 and np.allclose(continuation(fresh, 10), continuation(other, 10), atol=1e-5)


def test_a_recurrent_model_is_refused_with_a_clear_error(tmp_path: Path, recurrent: Path) -> None:
    llm = make(recurrent)
    llm.eval(TOKENS[:50])
    with pytest.raises(UnsupportedFormatError, match=f"{recurrent.stem} is a recurrent model"):
        save_compressed_state(llm, tmp_path / "ctx.lcg")
    with pytest.raises(UnsupportedFormatError, match="recurrent model"):
        chunks.save_chunked(llm, f"file://{tmp_path}/ctx")
    with pytest.raises(UnsupportedFormatError, match="recurrent model"):  # before calibrating
        stream.load_streaming(llm, f"file://{tmp_path}/ctx", slo_s=1.0)
    with pytest.raises(UnsupportedFormatError, match=r"holds none \(a recurrent model, such as Mamba"):
        codec.inspect_state(capture_state(llm, None))  # the raw state, as a file given to the CLI
    assert not list(tmp_path.iterdir())
    # the prompt cache stays out of the way: the completion is not lost
    fresh = make(recurrent)
    fresh.set_cache(CompressedStateCache(f"file://{tmp_path}/cache", chunk_tokens=C))
    out = fresh.create_completion(TOKENS[:100], max_tokens=2, temperature=0.0, logit_bias=LETTERS_ONLY)
    assert out["usage"]["completion_tokens"] == 2
    assert not list(tmp_path.rglob(f"{chunks.PREFIX}*"))


def test_llama_server_sharing_refuses_a_hybrid_slot_and_says_why(tmp_path: Path, source: lcg.Llama) -> None:
    """The sequence state llama.cpp writes for a hybrid model, as a llama-server slot file: the
    proxy's upload refuses it before opening the store (the request it follows is not failed)."""
    slot = seq_buffer_to_slot_file(capture_state(source, 0), np.asarray(TOKENS, dtype=np.int32))
    sharing = Sharing((tmp_path / "store").as_uri(), model_fingerprint(source), 1024, chunk_tokens=C)
    with pytest.raises(UnsupportedFormatError, match="hybrid model"):
        sharing.upload(slot)
    assert not (tmp_path / "store").exists()


def test_cli_eval_names_what_it_could_not_measure(hybrid: Path, recurrent: Path) -> None:
    args = ("--tokens", "100", "--cont", "16", "--threads", "1")
    out = subprocess.run(
        [sys.executable, "-m", "llama_cachegen", "eval", "--model", str(recurrent), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0 and f"{recurrent.stem} is a recurrent model" in out.stderr
    assert "Traceback" not in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "llama_cachegen", "eval", "--model", str(hybrid), *args, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rows = {r["method"]: r for r in json.loads(out.stdout)["rows"]}
    assert rows["llama-cachegen lossless"]["kl"] == 0.0


@pytest.mark.parametrize(
    ("rate", "slo_s", "tps"), [(3e4, 0.3, 600.0), (1e5, 0.15, 1200.0), (2e5, 0.6, 300.0)]
)
def test_a_hybrid_streamed_over_a_slow_link_loads_exactly(
    http_server: tuple[str, Path],
    hybrid: Path,
    source: lcg.Llama,
    reference: dict[str, np.ndarray],
    rate: float,
    slo_s: float,
    tps: float,
) -> None:
    """A shaped link and a deadline: chunks computed from the front (racing fetches, some given up
    midway: a recurrent state is not cut back), fetched from the back, all exact at lossless.
    Which mix a case gets depends on the machine (this tiny model computes a chunk in ~1 ms: the
    slower links' cases compute every chunk while the skeleton is late); each is exact."""
    base, _ = http_server
    url = f"{base}/{hybrid.stem}-{rate:g}/ctx"
    chunks.save_chunked(source, url, levels=("lossless",), chunk_tokens=C)
    with Relay(url) as relay:
        relay.set_trace(Trace.constant(rate))
        llm = make(hybrid)
        report = stream.load_streaming(llm, f"{relay.url}", slo_s=slo_s, compute_tps=tps)
    k = len(report.text_chunks)
    assert report.text_chunks == list(range(k))
    assert all(r.level == "lossless" for r in report.records[k:])
    np.testing.assert_array_equal(continuation(llm, N), reference["all"])


def test_a_large_recurrent_state_loads_whole_and_as_a_prefix_of_itself(tmp_path: Path) -> None:
    """A Falcon-H1 of 1.5B-Deep's proportions (SSM inner 2.4 x n_embd, state size 256), scaled
    down: its recurrent state (16 MB) outweighs 200 tokens of K/V. The bound a skeleton is read
    under took it for a planted object (and removed it) until it counted such states."""
    path = write_falcon_h1(
        tmp_path / "falcon-h1-deep.gguf", n_embd=320, n_layer=20, d_inner=768, d_state=256, ssm_heads=24
    )
    source = make(path, n_ctx=512)
    source.eval(TOKENS[:200])
    url = f"file://{tmp_path}/ctx"
    chunks.save_chunked(source, url, levels=("lossless",), chunk_tokens=C)
    (skeleton,) = (tmp_path / chunks.PREFIX / "skeletons").iterdir()
    assert skeleton.stat().st_size > 15 << 20
    for load in (
        lambda llm: chunks.load_chunked(llm, url),
        lambda llm: chunks.load_prefix(llm, f"file://{tmp_path}", TOKENS[:200], chunk_tokens=C),
    ):
        llm = make(path, n_ctx=512)
        assert load(llm).tokens == 200
        assert capture_state(llm, None) == capture_state(source, None)
    assert skeleton.exists()
