"""Issue 7 on the real model: a shared cache never serves a state the context cannot load or did
not write, a refused load changes nothing, and a malformed envelope is a CorruptDataError."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest
from conftest import chunk_objects, greedy, kv_cache_bytes, multi_seq_llama, seq_buffer, smollm
from llama_cachegen import chunks, codec, envelope, stream
from llama_cachegen.cache import CompressedStateCache
from llama_cachegen.chunks import PREFIX, root_key
from llama_cachegen.errors import (
    AuthenticationError,
    CorruptDataError,
    InvalidArgumentError,
    LimitExceededError,
    ModelMismatchError,
)
from llama_cachegen.llama import (
    ENVELOPE_MAGIC,
    StateMeta,
    capture_meta,
    capture_state,
    check_fingerprint,
    fingerprint_key,
    load_compressed_state,
    model_fingerprint,
    save_compressed_state,
)
from llama_cachegen.model import sample_text
from llama_cachegen.stores import KEY_ENV, open_store, write_url

PROMPT = "The capital of France is"  # SmolLM2: " Paris."
OTHER = "The capital of Japan is"  # SmolLM2: " Tokyo."
# prompt-cache tests: 24 tokens, the country inside the first 16-token chunk
LONG = "In one word, which city is the capital of {}, the country we talk about here? The capital of {} is"
LONG_PROMPT, LONG_OTHER = LONG.format("France", "France"), LONG.format("Japan", "Japan")
C = 16


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """Answers of a context without any cache."""
    llm = smollm()
    return {p: greedy(llm, p, 6) for p in (PROMPT, OTHER, LONG_PROMPT)}


_FLASH_WRITER = """
import sys
from llama_cachegen import CompressedStateCache, Llama
from llama_cachegen.model import default_model_path
llm = Llama(str(default_model_path()), n_ctx=512, n_threads=2, flash_attn=True, verbose=False)
llm.set_cache(CompressedStateCache(sys.argv[1], level="lossless", chunk_tokens=16))
llm.create_completion(sys.argv[2], max_tokens=6, temperature=0.0)
"""


def test_processes_differing_only_in_flash_attention_share_no_entry(
    tmp_path: Path, reference: dict[str, str]
) -> None:
    """The issue's scenario: the flash-attention writer's chunks are a miss for the other context,
    which then answers exactly as without a cache (it raised RuntimeError, then answered '-1000.')."""
    subprocess.run(
        [sys.executable, "-c", _FLASH_WRITER, tmp_path.as_uri(), LONG_PROMPT],
        check=True,
        capture_output=True,
        timeout=300,
    )
    llm = smollm()
    cache = CompressedStateCache(tmp_path.as_uri(), level="lossless", chunk_tokens=C)
    llm.set_cache(cache)
    for _ in range(2):
        llm.reset()
        assert greedy(llm, LONG_PROMPT, 6) == reference[LONG_PROMPT]
    assert cache.hits == 1  # the second completion hits this context's own chunks, not the writer's
    assert model_fingerprint(llm)["flash_attn"] == "disabled"
    assert len(cache.store.list(f"{PREFIX}skeletons/")) == 2  # one per fingerprint: nothing shared


def test_chunks_llama_cpp_refuses_are_dropped_as_a_miss(tmp_path: Path, reference: dict[str, str]) -> None:
    """A flash-attention state filed under this context's fingerprint (no key: any writer can):
    llama.cpp refuses it, its chunks go, the completion is a miss and is right."""
    flash = smollm(flash_attn=True)
    flash.eval(flash.tokenize(LONG_PROMPT.encode()))
    llm = smollm()
    cache = CompressedStateCache(tmp_path, level="lossless", chunk_tokens=C, model=llm)
    cache[[]] = flash.save_state()
    forged = chunk_objects(cache)
    llm.set_cache(cache)
    assert greedy(llm, LONG_PROMPT, 6) == reference[LONG_PROMPT]
    assert (cache.hits, cache.misses) == (0, 1)
    honest = chunk_objects(cache)  # the completion filed its own chunks under the same keys
    assert honest.keys() == forged.keys() and all(honest[k] != forged[k] for k in forged)
    llm.reset()
    assert greedy(llm, LONG_PROMPT, 6) == reference[LONG_PROMPT]
    assert cache.hits == 1


def test_poisoned_chunks_are_refused_with_a_key(
    tmp_path: Path, reference: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's poisoning: the state of the Japan prompt filed under the France prompt's
    tokens. With a key, the reader refuses the forger's chunks and answers from the prompt."""
    llm = smollm()
    japan = llm.tokenize(LONG_OTHER.encode())
    france = llm.tokenize(LONG_PROMPT.encode())
    assert len(japan) == len(france) > C
    llm.eval(japan)
    poisoned = llm.save_state()
    poisoned.input_ids[: len(france)] = france  # claims the France tokens, holds the Japan KV
    llm.reset()
    forger = CompressedStateCache(tmp_path, level="lossless", chunk_tokens=C, model=llm)  # no key
    forger[france] = poisoned
    assert france in forger  # without a key, a reader would take it
    monkeypatch.setenv(KEY_ENV, "shared secret")
    victim = smollm()
    cache = CompressedStateCache(tmp_path, level="lossless", chunk_tokens=C)
    victim.set_cache(cache)
    assert cache.namespace == forger.namespace
    assert greedy(victim, LONG_PROMPT, 6) == reference[LONG_PROMPT]
    assert " Paris" in reference[LONG_PROMPT]
    assert (cache.hits, cache.misses) == (0, 1)  # refused (AuthenticationError), dropped, a miss


def test_load_with_a_key_refuses_a_forged_file_before_touching_the_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = smollm()
    llm.eval(llm.tokenize(OTHER.encode()))
    forged = save_compressed_state(llm, level="lossless")
    write_url(tmp_path / "state.lcg", forged, auth_key="")  # written without the key
    save_compressed_state(llm, tmp_path / "honest.lcg", level="lossless")  # no key yet: untagged too
    monkeypatch.setenv(KEY_ENV, "shared secret")
    save_compressed_state(llm, tmp_path / "tagged.lcg", level="lossless")
    target = smollm()
    target.eval(target.tokenize(PROMPT.encode()))
    before = _python_side(target)
    for name in ("state.lcg", "honest.lcg"):
        with pytest.raises(AuthenticationError):
            load_compressed_state(target, tmp_path / name)
        _assert_same(before, _python_side(target))
    (tmp_path / "tagged.lcg").rename(tmp_path / "renamed.lcg")
    with pytest.raises(AuthenticationError):
        load_compressed_state(target, tmp_path / "renamed.lcg")
    (tmp_path / "renamed.lcg").rename(tmp_path / "tagged.lcg")
    assert load_compressed_state(target, tmp_path / "tagged.lcg").tokens == len(llm.tokenize(OTHER.encode()))


def _python_side(llm: llama_cpp.Llama) -> dict[str, Any]:
    return {
        "input_ids": llm.input_ids.copy(),
        "n_tokens": llm.n_tokens,
        "scores": llm.scores.copy(),
        "requires_eval": llm._requires_eval,
        "state": codec.decode(save_compressed_state(llm, level="lossless")),
    }


def _assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    for key, value in before.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(value, after[key], err_msg=key)
        else:
            assert value == after[key], key


def test_refused_loads_leave_the_llama_object_exactly_as_it_was() -> None:
    flash = smollm(flash_attn=True, logits_all=True)
    flash.eval(flash.tokenize(OTHER.encode()))
    blob = save_compressed_state(flash, level="lossless")
    llm = smollm(logits_all=True)
    llm.eval(llm.tokenize(PROMPT.encode()))
    before = _python_side(llm)
    with pytest.raises(ModelMismatchError, match="flash_attn: saved 'enabled', this context 'disabled'"):
        load_compressed_state(llm, blob)
    _assert_same(before, _python_side(llm))
    # the same state with a fingerprint forged to fit: llama.cpp itself refuses (V transposition)
    meta = StateMeta.unpack(codec.user_meta(blob))
    meta.fingerprint = model_fingerprint(llm)
    forged = codec.encode(codec.decode(blob), "lossless", user_meta=meta.pack())
    with pytest.raises(ModelMismatchError, match="put back as it was"):
        load_compressed_state(llm, forged)
    _assert_same(before, _python_side(llm))


def test_fingerprint_covers_the_kv_layout(model_path: Path) -> None:
    base = model_fingerprint(smollm())
    assert base["flash_attn"] == "disabled" and base["n_stream"] == 1
    assert base["swa_full"] is None  # SmolLM2 has no sliding-window layers
    assert "llama-cpp-python 0.3.36" in base["state_format"] and "seq v3" in base["state_format"]
    assert model_fingerprint(smollm(flash_attn=True))["flash_attn"] == "enabled"
    assert model_fingerprint(smollm(type_v=llama_cpp.GGML_TYPE_Q8_0, flash_attn=True))["type_v"] == "q8_0"
    streams = model_fingerprint(multi_seq_llama(model_path, 3, unified=False, n_ctx=256, logits_all=False))
    unified = model_fingerprint(multi_seq_llama(model_path, 3, unified=True, n_ctx=256, logits_all=False))
    assert streams["n_stream"] == 3 and unified["n_stream"] == 1


def test_fingerprint_covers_rope_and_metadata_overrides(tmp_path: Path) -> None:
    """llama.cpp caches keys rotated by the context's RoPE: a context with rope_freq_scale 0.5
    loading (or sharing a prompt cache of) chunks of a default context got keys rotated for other
    positions, silently (next-token KL 1.3). The model hash reads the file's metadata, not
    kv_overrides."""
    llm = smollm()
    base = model_fingerprint(llm)
    scaled = smollm(rope_freq_scale=0.5)
    other = model_fingerprint(scaled)
    assert base["rope"] is None and "rope_freq_scale=0.5" in other["rope"]
    assert base["overrides"] is None
    overridden = model_fingerprint(smollm(kv_overrides={"llama.rope.freq_base": 20000.0}))
    assert overridden["overrides"] == '{"llama.rope.freq_base": 20000.0}'
    assert root_key(overridden, C) != root_key(base, C)
    assert fingerprint_key(other) != fingerprint_key(base) and root_key(other, C) != root_key(base, C)
    # a default context's keys are those stores held before the fields existed
    before = {k: v for k, v in base.items() if k not in ("rope", "overrides")}
    assert root_key(before, C) == root_key(base, C) and fingerprint_key(before) == fingerprint_key(base)
    llm.eval(llm.tokenize(PROMPT.encode(), add_bos=True))
    url = f"file://{tmp_path}/ctx"
    chunks.save_chunked(llm, url, levels=("lossless",), chunk_tokens=C, tokens=llm.input_ids[: llm.n_tokens])
    with pytest.raises(ModelMismatchError, match="rope"):
        chunks.load_chunked(scaled, url)


def _next_logits(llm: Any, seq: int, pos: int) -> np.ndarray:
    """The logits after token 42 at `pos` of sequence `seq`, which is then removed again."""
    stream._decode_tokens(llm.ctx, np.array([42]), pos, seq, 1)
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), (llm.n_vocab(),)).copy()
    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm.ctx), seq, pos, -1)
    return logits


def test_a_context_of_several_streams_is_saved_whole(model_path: Path, tmp_path: Path) -> None:
    """kv_unified off: each sequence has a stream of its own, and chunks keyed by sequence 0's
    tokens made two contexts with the same sequence 0 share every chunk: the second one loaded
    with the first one's sequence 1. Saved whole instead, each loads as it was."""
    first = smollm().tokenize(sample_text("gpl-3.0.txt").encode(), add_bos=True)[:70]
    second = smollm().tokenize(sample_text("gfdl-1.3.txt").encode(), add_bos=True)
    reference = {}
    for name, seq1 in (("x", second[:70]), ("y", second[100:170])):
        llm = multi_seq_llama(model_path, 2, False, n_ctx=256, logits_all=False)
        llm.eval(first)
        stream._decode_tokens(llm.ctx, np.asarray(seq1), 0, 1, 70)
        reference[name] = _next_logits(llm, 1, 70)
        report = chunks.save_chunked(llm, f"file://{tmp_path}/{name}", levels=("lossless",), chunk_tokens=C)
        assert report.chunk_tokens is None and report.fallback
        assert not codec.inspect_state(capture_state(llm, None), "full_buffer")["chunkable"]
    assert not np.array_equal(reference["x"], reference["y"])
    llm = multi_seq_llama(model_path, 2, False, n_ctx=256, logits_all=False)
    chunks.load_chunked(llm, f"file://{tmp_path}/y")
    assert np.array_equal(_next_logits(llm, 1, 70), reference["y"])


def test_non_causal_attention_is_in_the_fingerprint_and_never_chunked(tmp_path: Path) -> None:
    """With non-causal attention a token's K/V saw the tokens after it. Its chunks had a causal
    context's keys: load_prefix gave a causal context that K/V as exact (next-token KL 0.95)."""
    tokens = smollm().tokenize(sample_text("gpl-3.0.txt").encode(), add_bos=True)[:140]
    non_causal = smollm(attention_type=llama_cpp.LLAMA_ATTENTION_TYPE_NON_CAUSAL)
    causal = smollm()
    for llm in (non_causal, causal):
        llm.eval(tokens)
    assert capture_state(non_causal, None) != capture_state(causal, None)
    assert model_fingerprint(non_causal)["attention"] == "non-causal"
    assert model_fingerprint(causal)["attention"] is None
    url = f"file://{tmp_path}/ctx"
    report = chunks.save_chunked(non_causal, url, levels=("lossless",), chunk_tokens=C)
    assert report.chunk_tokens is None and "non-causal" in report.fallback  # saved whole
    assert chunks.load_prefix(smollm(), f"file://{tmp_path}", tokens, chunk_tokens=C).tokens == 0
    with pytest.raises(ModelMismatchError, match="attention"):
        chunks.load_chunked(smollm(), url)
    # a causal context's keys are those stores held before the field existed
    base = model_fingerprint(causal)
    before = {k: v for k, v in base.items() if k != "attention"}
    assert root_key(before, C) == root_key(base, C) and fingerprint_key(before) == fingerprint_key(base)


def test_a_sequence_must_fit_its_own_kv_stream(model_path: Path, tmp_path: Path) -> None:
    """kv_unified off: a sequence's cells go into its own stream of n_ctx / n_seq_max cells. The
    checks compared with the whole n_ctx, so a load that could not fit got as far as llama.cpp's
    refusal (a streaming load after seconds of computing text) and a message naming n_ctx."""
    tokens = smollm().tokenize(sample_text("gpl-3.0.txt").encode(), add_bos=True)[:300]
    source = multi_seq_llama(model_path, 2, False, n_ctx=1024, logits_all=False)
    stream._decode_tokens(source.ctx, np.asarray(tokens), 0, 1, 64)
    url = f"file://{tmp_path}/ctx"
    chunks.save_chunked(source, url, seq_id=1, tokens=tokens, levels=("lossless",), chunk_tokens=C)
    blob = save_compressed_state(source, level="lossless", seq_id=1, tokens=tokens)
    target = multi_seq_llama(model_path, 2, False, n_ctx=512, logits_all=False)  # 256 per stream
    assert llama_cpp.llama_n_ctx_seq(target.ctx) == 256
    for load in (
        lambda: load_compressed_state(target, blob, seq_id=1),
        lambda: chunks.load_chunked(target, url, seq_id=1),
        lambda: stream.load_streaming(target, url, seq_id=1, slo_s=30.0, compute_tps=1e6),
    ):
        with pytest.raises(ModelMismatchError, match="256 per sequence"):
            load()
    roomy = multi_seq_llama(model_path, 2, False, n_ctx=1024, logits_all=False)
    assert chunks.load_chunked(roomy, url, seq_id=1).cells == 300


def test_arguments_of_another_type_are_refused(tmp_path: Path) -> None:
    llm = smollm()
    llm.eval(llm.tokenize(PROMPT.encode(), add_bos=True))
    url = f"file://{tmp_path}/ctx"
    for seq_id in (1.0, "0", np.int32(0), True):
        with pytest.raises(InvalidArgumentError, match="seq_id must be an int"):
            chunks.save_chunked(llm, url, seq_id=seq_id)
    with pytest.raises(InvalidArgumentError, match="unknown level"):
        codec.encode(capture_state(llm, None), ["high"])  # type: ignore[arg-type]
    # levels by number, as encode takes them
    tokens = llm.input_ids[: llm.n_tokens]
    report = chunks.save_chunked(llm, url, levels=(2, 0), chunk_tokens=C, tokens=tokens)
    assert report.levels == ("lossless", "balanced")
    assert chunks.load_chunked(smollm(), url, level=0).tokens == llm.n_tokens
    for name in ("compute_tps", "prior_mbps", "slo_s"):
        for bad in (0, -1.0, math.inf, math.nan, "1", True):
            with pytest.raises(InvalidArgumentError, match=name):
                stream.load_streaming(llm, url, **{name: bad})


# ---- envelopes -------------------------------------------------------------------------------


def _envelope(header: bytes | dict[str, Any], tail: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<4sII", ENVELOPE_MAGIC, 1, len(raw)) + raw + tail


_GOOD = {
    "fingerprint": {},
    "scope": "all",
    "seq_id": None,
    "n_ctx": 8,
    "n_tokens": 1,
    "n_logits": 0,
    "seed": 1,
}
MALFORMED = {
    "empty": b"",
    "short": ENVELOPE_MAGIC + b"\x01",
    "other magic": _envelope(_GOOD, b"\0" * 4).replace(ENVELOPE_MAGIC, b"XXXX", 1),
    "bad json": _envelope(b"{not json", b"\0" * 4),
    "bad utf-8": _envelope(b'{"a": "\xff"}'),
    "not an object": _envelope([1, 2, 3]),  # type: ignore[arg-type]
    "deep nesting": _envelope(b"[" * 100000 + b"]" * 100000),
    "huge int": _envelope(b'{"n_tokens": 1' + b"0" * 5000 + b"}"),
    "string count": _envelope({**_GOOD, "n_tokens": "1"}, b"\0" * 4),
    "bool count": _envelope({**_GOOD, "n_tokens": True}, b"\0" * 4),
    "float count": _envelope({**_GOOD, "n_tokens": 1.0}, b"\0" * 4),
    "negative count": _envelope({**_GOOD, "n_tokens": -1}),
    "forged count": _envelope({**_GOOD, "n_tokens": 1 << 40}),
    "list fingerprint": _envelope({**_GOOD, "fingerprint": []}, b"\0" * 4),
    "nested fingerprint": _envelope({**_GOOD, "fingerprint": {"a": {"b": 1}}}, b"\0" * 4),
    "bad scope": _envelope({**_GOOD, "scope": 1}, b"\0" * 4),
    "string n_ctx": _envelope({**_GOOD, "n_ctx": "8"}, b"\0" * 4),
    "missing n_ctx": _envelope({k: v for k, v in _GOOD.items() if k != "n_ctx"}, b"\0" * 4),
    "negative seq_id": _envelope({**_GOOD, "seq_id": -2}, b"\0" * 4),
    "string seed": _envelope({**_GOOD, "seed": "x"}, b"\0" * 4),
    "lossy not a pair": _envelope({**_GOOD, "lossy": "balanced"}, b"\0" * 4),
    "lossy lossless": _envelope({**_GOOD, "lossy": [0, "lossless"]}, b"\0" * 4),
    "lossy unknown level": _envelope({**_GOOD, "lossy": [0, "best"]}, b"\0" * 4),
    "lossy negative position": _envelope({**_GOOD, "lossy": [-1, "balanced"]}, b"\0" * 4),
    "short arrays": _envelope(_GOOD, b"\0" * 3),
    "header overrun": struct.pack("<4sII", ENVELOPE_MAGIC, 1, 1 << 30) + b"{}",
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_every_malformed_envelope_is_corrupt_data(name: str) -> None:
    with pytest.raises(CorruptDataError):
        StateMeta.unpack(MALFORMED[name])


def test_malformed_envelopes_reach_neither_the_context_nor_the_cache(tmp_path: Path) -> None:
    llm = smollm()
    llm.eval(llm.tokenize(LONG_PROMPT.encode()))
    state = codec.decode(save_compressed_state(llm, level="lossless"))
    cache = CompressedStateCache(tmp_path, level="lossless", chunk_tokens=C, model=llm)
    tokens = llm.input_ids[: llm.n_tokens].tolist()
    for bad in ("deep nesting", "string count", "not an object"):
        blob = codec.encode(state, "lossless", kind="full_buffer", user_meta=MALFORMED[bad])
        with pytest.raises(CorruptDataError):
            load_compressed_state(llm, blob)
        cache[tokens] = llm.save_state()
        (key,) = chunk_objects(cache)
        cache.store.put(key, blob)  # a container with a malformed header where a chunk should be
        with pytest.raises(KeyError, match="unusable"):
            cache[tokens]
        assert not chunk_objects(cache)  # dropped


def test_token_ids_outside_the_vocabulary_never_reach_the_context() -> None:
    """A well-formed envelope (a store without a key) whose token ids are not the model's: they went
    into llama-cpp-python's token list, which llama.cpp later reads unchecked (detokenize)."""
    llm = smollm()
    llm.eval(llm.tokenize(LONG_PROMPT.encode()))
    meta = capture_meta(llm, None)
    state = codec.decode(save_compressed_state(llm, level="lossless"))
    before = capture_state(llm, None), llm.n_tokens
    for bad in (llm.n_vocab(), -1, 2**31 - 1):
        meta.tokens[3] = bad
        blob = codec.encode(state, "lossless", kind="full_buffer", user_meta=meta.pack())
        with pytest.raises(CorruptDataError, match="vocabulary"):
            load_compressed_state(llm, blob)
        assert (capture_state(llm, None), llm.n_tokens) == before


def test_a_skeleton_whose_state_passes_the_models_bound_is_refused_before_it_is_built(tmp_path: Path) -> None:
    """A skeleton (hashing to its id) of a layout far wider than the model's, 16 positions of K/V
    rows of 4,096 values where the fingerprint says 64: its state is refused by the bound before
    one byte of it is allocated (a 368-byte forgery asked for 676 MB), not built and checked after.
    The same skeleton under a fingerprint of its own width builds."""
    rng = np.random.default_rng(0)
    skeleton = codec.encode_skeleton(seq_buffer(kv_cache_bytes(rng, n_embd=4096, cells_per_stream=(16,))))
    tokens = np.arange(16, dtype=np.intc)

    def build(n_embd: int) -> np.ndarray:
        fingerprint = {"arch": "test", "n_layer": 2, "n_embd": n_embd}
        reader = chunks._ChunkReader(open_store(str(tmp_path)), fingerprint, tokens, 16, [], [])
        return reader.skeleton_state(hashlib.sha256(skeleton).hexdigest(), skeleton)

    assert len(build(4096)) > 16 * 2 * 2 * 4096 * 2  # its own width: K and V of 2 layers, f16
    with pytest.raises(CorruptDataError, match="the skeleton.s state needs"):
        build(64)


def test_a_forged_or_untagged_skeleton_cuts_the_prefix_before_the_chunk_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A skeleton is the state chunks decode into, placed by its cells' positions. One forged in a
    store without a key (a cell at position 50,000,000, checksums and id made to match) crashed
    every load of a prefix through it, the proxy's too (a heap overflow); one without the key's tag
    failed the load (AuthenticationError), which a proxy took for the store failing. Either cuts the
    prefix before the chunk naming it; the forged one is removed."""
    from test_bad_input import reseal

    llm = smollm()
    tokens = llm.tokenize((LONG_PROMPT + " " + LONG_OTHER).encode())[:40]
    llm.eval(tokens)
    chunks.save_chunked(llm, f"file://{tmp_path}/ctx", levels=("lossless",), chunk_tokens=C)
    (skeleton_path,) = (tmp_path / PREFIX / "skeletons").iterdir()
    skeleton = skeleton_path.read_bytes()
    forged = bytearray(skeleton)
    cell5 = struct.pack("<iIi", 5, 1, 0) + struct.pack("<iIi", 6, 1, 0)  # cells 5 and 6's records
    struct.pack_into("<i", forged, skeleton.index(cell5), 50_000_000)
    forged = bytes(reseal(forged))
    forged_id = hashlib.sha256(forged).hexdigest()
    (skeleton_path.parent / forged_id).write_bytes(forged)
    keys = chunks.chain_keys(model_fingerprint(llm), np.asarray(tokens), C)
    last = tmp_path / PREFIX / "chunks" / keys[-1] / "lossless"  # chunk 2 (positions 32..39) names it
    repointed = last.read_bytes().replace(skeleton_path.name.encode(), forged_id.encode())
    last.write_bytes(bytes(reseal(bytearray(repointed))))
    fresh = smollm()
    report = chunks.load_prefix(fresh, f"file://{tmp_path}", tokens, chunk_tokens=C)
    assert report.tokens == 32 and fresh.n_tokens == 32
    assert not (skeleton_path.parent / forged_id).exists() and skeleton_path.exists()
    fresh.eval(tokens[32:])
    np.testing.assert_array_equal(fresh.scores[39], llm.scores[39])  # lossless chunks, then computed

    monkeypatch.setenv(KEY_ENV, "shared secret")
    keyed = tmp_path / "keyed"
    chunks.save_chunked(llm, f"file://{keyed}/ctx", levels=("lossless",), chunk_tokens=C)
    (skeleton_path,) = (keyed / PREFIX / "skeletons").iterdir()
    skeleton_path.write_bytes(skeleton_path.read_bytes()[40:])  # the tag stripped (40 bytes: magic and HMAC)
    fresh = smollm()
    report = chunks.load_prefix(fresh, f"file://{keyed}", tokens, chunk_tokens=C)  # no AuthenticationError
    assert report.tokens == 0 and fresh.n_tokens == 0
    chunks.save_chunked(llm, f"file://{keyed}/ctx", levels=("lossless",), chunk_tokens=C)  # written over
    assert chunks.load_prefix(smollm(), f"file://{keyed}", tokens, chunk_tokens=C).tokens == 40


def test_a_header_past_its_bound_is_refused_though_the_object_holds_it() -> None:
    """unpack bounds the JSON header by max_header before parsing, not only by the object's size
    (a manifest or chunk header of megabytes of JSON inside a large object was parsed)."""
    data = envelope.pack(b"LCGT", 1, {"pad": "x" * 1000})
    size = len(data) - envelope.PREFIX.size
    header, offset = envelope.unpack(data, b"LCGT", 1, size, "test object")
    assert header == {"pad": "x" * 1000} and offset == len(data)
    with pytest.raises(CorruptDataError, match="overruns"):
        envelope.unpack(data, b"LCGT", 1, size - 1, "test object")
    with pytest.raises(CorruptDataError, match="overruns"):
        envelope.unpack(data[:-1], b"LCGT", 1, size, "test object")


def test_a_manifest_naming_too_few_or_too_many_chunks_is_refused_when_read() -> None:
    """Manifest.unpack checks that it names one chunk per chunk_tokens of its tokens: a manifest
    read alone (read_manifest, `info`) is checked as a load checks it."""

    meta = StateMeta({"arch": "llama"}, "all", None, 64, np.arange(40, dtype=np.intc))
    for n, ok in ((3, True), (2, False), (4, False)):  # 40 tokens at 16: 3 chunks
        manifest = chunks.Manifest(
            meta,
            16,
            "a" * 64,
            {"lossless": "b" * 64},
            [chunks.ChunkEntry(f"{i:064x}", {"lossless": 10}) for i in range(n)],
        )
        if ok:
            assert len(chunks.Manifest.unpack(manifest.pack()).chunks) == 3
        else:
            with pytest.raises(CorruptDataError, match="chunk count"):
                chunks.Manifest.unpack(manifest.pack())


def test_contexts_differing_only_in_the_v_cache_type_share_no_key() -> None:
    """type_v is a field of its own: a q8_0 V cache beside an f16 one (the same K type, flash
    attention both) is another fingerprint, another key space, and a refused load."""
    f16 = model_fingerprint(smollm(flash_attn=True))
    q8 = model_fingerprint(smollm(flash_attn=True, type_v=llama_cpp.GGML_TYPE_Q8_0))
    assert f16["type_k"] == q8["type_k"] and f16["type_v"] != q8["type_v"]
    assert fingerprint_key(f16) != fingerprint_key(q8) and chunks.root_key(f16, 16) != chunks.root_key(q8, 16)
    with pytest.raises(ModelMismatchError, match="type_v"):
        check_fingerprint(q8, f16)


def _saved_whole(tmp_path: Path, n: int) -> tuple[str, Path]:
    """A non-causal context of n tokens saved by save_chunked: whole, under a manifest."""
    llm = smollm(attention_type=llama_cpp.LLAMA_ATTENTION_TYPE_NON_CAUSAL)
    llm.eval(llm.tokenize(sample_text("gpl-3.0.txt").encode(), add_bos=True)[:n])
    url = f"file://{tmp_path}/ctx{n}"
    assert chunks.save_chunked(llm, url, levels=("lossless",), chunk_tokens=16).chunk_tokens is None
    return url, tmp_path / f"ctx{n}"


def test_a_whole_container_swapped_for_another_valid_one_is_refused(tmp_path: Path) -> None:
    """A manifest's whole container is checked against its id: another valid container of the same
    model under that id (40 tokens where 60 were saved) is not loaded."""
    url, _ = _saved_whole(tmp_path, 60)
    _saved_whole(tmp_path, 40)
    wholes = sorted((tmp_path / PREFIX / "wholes").iterdir(), key=lambda p: p.stat().st_size)
    small, large = wholes
    manifest = chunks.read_manifest(url)
    assert manifest.wholes["lossless"][0] == large.name
    large.write_bytes(small.read_bytes())
    target = smollm(attention_type=llama_cpp.LLAMA_ATTENTION_TYPE_NON_CAUSAL)
    with pytest.raises(CorruptDataError, match="does not hash to its id"):
        chunks.load_chunked(target, url)
    assert target.n_tokens == 0


def test_a_manifest_past_the_contexts_bound_is_not_read(tmp_path: Path) -> None:
    """What a manifest URL holds is read no further than a context of this size can need (a
    planted 1 GiB object was read whole before the manifest check refused it)."""
    url, path = _saved_whole(tmp_path, 40)
    os.truncate(path, 1 << 30)
    with pytest.raises(LimitExceededError, match="more than"):
        chunks.load_chunked(smollm(attention_type=llama_cpp.LLAMA_ATTENTION_TYPE_NON_CAUSAL), url)


def test_of_two_saves_a_query_extends_the_longest_partial_chunk_is_found(tmp_path: Path) -> None:
    """Two saves of one conversation (210, then 230 tokens) leave two partial last chunks after
    the same three whole ones: a query extending both finds the longer (the tail probe takes the
    longest length stored, not the first)."""
    llm = smollm()
    tokens = llm.tokenize(sample_text("gpl-3.0.txt").encode(), add_bos=True)[:250]
    llm.eval(tokens[:210])
    chunks.save_chunked(llm, f"file://{tmp_path}/first", levels=("lossless",), chunk_tokens=64)
    llm.eval(tokens[210:230])
    chunks.save_chunked(llm, f"file://{tmp_path}/second", levels=("lossless",), chunk_tokens=64)
    match = chunks.longest_prefix(tmp_path, llm, tokens, chunk_tokens=64)
    assert (match.chunks, match.positions) == (4, 230)
    assert chunks.longest_prefix(tmp_path, llm, tokens[:220], chunk_tokens=64).positions == 210


def test_a_prefix_longer_than_the_context_is_refused_before_any_fetch(tmp_path: Path) -> None:
    """load_prefix checks the room first: a prefix of 230 tokens into a context of 128 is a
    ModelMismatchError naming the size, before a chunk is read, and the context is left alone."""
    llm = smollm()
    tokens = llm.tokenize(sample_text("gpl-3.0.txt").encode(), add_bos=True)[:230]
    llm.eval(tokens)
    chunks.save_chunked(llm, f"file://{tmp_path}/ctx", levels=("lossless",), chunk_tokens=64)
    small = smollm(n_ctx=128)
    with pytest.raises(ModelMismatchError, match="context too small"):
        chunks.load_prefix(small, f"file://{tmp_path}", tokens, chunk_tokens=64)
    assert small.n_tokens == 0
