"""The RoPE transform of keys (native/src/rope.h): coded rotated back by position, decoded rotated
forward; smaller at the same squared error where keys carry RoPE, exact where it must be."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import llama_cachegen as lcg
import numpy as np
import pytest
from conftest import kv_cache_bytes, seq_buffer
from llama_cachegen import codec, quality
from llama_cachegen.codec import Rope
from llama_cachegen.llama import model_rope
from test_bad_input import reseal, sections

N_HEAD, HEAD_DIM, BASE = 2, 32, 10000.0


def _rotate(x: np.ndarray, pos: np.ndarray, pairing: str, sign: float) -> np.ndarray:
    """x (cells, heads x HEAD_DIM) turned by sign x pos x theta_i, pairs as llama.cpp's rope types."""
    half = HEAD_DIM // 2
    theta = BASE ** (-2.0 * np.arange(half) / HEAD_DIM)
    ang = sign * pos[:, None, None] * theta[None, None, :]
    h = x.reshape(len(x), N_HEAD, HEAD_DIM).astype(np.float64)
    first, second = (h[..., 0::2], h[..., 1::2]) if pairing == "adjacent" else (h[..., :half], h[..., half:])
    a, b = first.copy(), second.copy()
    first[...], second[...] = a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)
    return h.reshape(len(x), -1)


def rope_state(cells: int, pairing: str) -> tuple[bytes, list[int]]:
    """A 2-layer state whose keys are steady per-channel values plus noise, rotated by position as
    llama.cpp stores them; returns it and the byte offsets of its two K tensors."""
    rng = np.random.default_rng(cells)
    n_embd = N_HEAD * HEAD_DIM
    state = bytearray(seq_buffer(kv_cache_bytes(rng, n_embd=n_embd, cells_per_stream=(cells,))))
    pos = np.arange(cells, dtype=np.float64)
    offsets = []
    # io magic + seq id, n_stream, cell count, cells (pos, 1, seq id), v_trans + n_layer
    at = 8 + 4 + 4 + 12 * cells + 8
    for _ in range(2):
        at += 12  # ggml type, row bytes
        steady = rng.normal(0, 2.0, n_embd) + rng.normal(0, 0.3, (cells, n_embd))
        k = _rotate(steady, pos, pairing, 1.0).astype(np.float16)
        state[at : at + k.nbytes] = k.tobytes()
        offsets.append(at)
        at += k.nbytes
    return bytes(state), offsets


def _keys(state: bytes, offsets: list[int], cells: int) -> np.ndarray:
    n = cells * N_HEAD * HEAD_DIM
    return np.stack([np.frombuffer(state, np.float16, n, o).astype(np.float64) for o in offsets])


@pytest.mark.parametrize("pairing", ["adjacent", "halves"])
@pytest.mark.parametrize("level", ["high", "balanced", "compact"])
def test_rope_codes_keys_smaller_at_the_same_error(pairing: str, level: str) -> None:
    cells = 300
    state, offsets = rope_state(cells, pairing)
    rope = Rope(pairing, HEAD_DIM, HEAD_DIM, (500000.0, BASE))  # the second base is the keys'
    plain, rotated = lcg.encode(state, level), lcg.encode(state, level, rope=rope)
    assert len(rotated) < 0.9 * len(plain)
    ref = _keys(state, offsets, cells)
    err_plain = ((_keys(lcg.decode(plain), offsets, cells) - ref) ** 2).sum()
    decoded = lcg.decode(rotated)
    err_rope = ((_keys(decoded, offsets, cells) - ref) ** 2).sum()
    assert err_rope <= 1.1 * err_plain
    # V untouched by the transform; the same bytes on any thread count
    v_at = offsets[1] + cells * N_HEAD * HEAD_DIM * 2
    assert decoded[v_at:] == lcg.decode(plain)[v_at:]
    assert lcg.encode(state, level, rope=rope, threads=1) == rotated
    assert lcg.decode(rotated, threads=1) == decoded
    # the wrong pairing does not shrink the spread: keys coded as stored
    other = "halves" if pairing == "adjacent" else "adjacent"
    assert lcg.encode(state, level, rope=Rope(other, HEAD_DIM, HEAD_DIM, (BASE,))) == plain


def test_rope_identical_on_the_scalar_path() -> None:
    state, _ = rope_state(77, "adjacent")
    rope = Rope("adjacent", HEAD_DIM, HEAD_DIM, (BASE,))
    blob = lcg.encode(state, "balanced", rope=rope)
    digest = hashlib.sha256(blob + lcg.decode(blob)).hexdigest()
    script = (
        "import hashlib, sys; import llama_cachegen as lcg; from llama_cachegen.codec import Rope; "
        "from test_rope import rope_state; s, _ = rope_state(77, 'adjacent'); "
        f"b = lcg.encode(s, 'balanced', rope=Rope('adjacent', {HEAD_DIM}, {HEAD_DIM}, ({BASE},))); "
        "print(hashlib.sha256(b + lcg.decode(b)).hexdigest())"
    )
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, LCG_NO_SIMD="1", PYTHONPATH=path)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == digest


def test_rope_chunks_decode_as_the_whole() -> None:
    state, _ = rope_state(200, "halves")
    rope = Rope("halves", HEAD_DIM, HEAD_DIM, (BASE,))
    whole = lcg.decode(lcg.encode(state, "balanced", rope=rope))
    chunker = codec.Chunker(state, "balanced", rope=rope)
    stats = chunker.stats()
    stats_id = hashlib.sha256(stats).digest()
    out = codec.skeleton_state(codec.encode_skeleton(state), 200)
    decoder = codec.Stats(stats, stats_id)
    for begin in range(0, 200, 64):
        codec.decode_chunk(chunker.chunk(begin, min(200, begin + 64), stats_id), decoder, out)
    assert bytes(out) == whole


def test_rope_forged_parameters_are_refused() -> None:
    state, _ = rope_state(64, "adjacent")
    blob = lcg.encode(state, "balanced", rope=Rope("adjacent", HEAD_DIM, HEAD_DIM, (BASE,)))
    stats = [s for s in sections(blob) if s[0] == 5]
    k0, v0 = stats[0], stats[2]  # tensors: K of each layer, then V
    assert struct.unpack_from("<H", blob, k0[2] + 2)[0] == 2  # coded with RoPE
    for patch in (
        lambda b: struct.pack_into("<B", b, k0[2] + 4, 3),  # no such pairing
        lambda b: struct.pack_into("<H", b, k0[2] + 7, 33),  # odd rotated dims
        lambda b: struct.pack_into("<f", b, k0[2] + 9, float("nan")),  # base
        lambda b: struct.pack_into("<H", b, v0[2] + 2, 2),  # values are never rotated
    ):
        forged = bytearray(blob)
        patch(forged)
        with pytest.raises(lcg.CorruptDataError):
            lcg.decode(reseal(forged))


def test_rope_arguments_are_checked() -> None:
    state, _ = rope_state(32, "adjacent")
    for bad in (
        Rope("diagonal", HEAD_DIM, HEAD_DIM, (BASE,)),
        Rope("adjacent", HEAD_DIM, HEAD_DIM, ()),
        Rope("adjacent", HEAD_DIM, HEAD_DIM - 1, (BASE,)),
        Rope("adjacent", HEAD_DIM, 2 * HEAD_DIM, (BASE,)),
        Rope("adjacent", HEAD_DIM, HEAD_DIM, (0.5,)),
    ):
        with pytest.raises(lcg.InvalidArgumentError):
            lcg.encode(state, "balanced", rope=bad)
    good = Rope("adjacent", HEAD_DIM, HEAD_DIM, (BASE,))
    with pytest.raises(lcg.InvalidArgumentError, match="anchor"):
        lcg.encode(state, "balanced", rope=good, transform="anchor-delta")
    # lossless ignores it: bit-exact as ever
    assert lcg.decode(lcg.encode(state, "lossless", rope=good)) == state


def test_model_rope_on_smollm2(model_path: Path, gpl_tokens: list[int]) -> None:
    """SmolLM2 (llama, NORM rope, 64-channel heads, base 100,000): its keys code smaller with RoPE
    and the decoded state continues as the level promises."""
    llm = quality.make_llama(model_path, n_ctx=512)
    rope = model_rope(llm)
    assert rope == Rope("adjacent", 64, 64, (100000.0, 10000.0), 1.0)
    prefix, cont = gpl_tokens[:384], gpl_tokens[384:448]
    state = quality.state_of(llm, prefix)
    ref = quality.continuation_logits(llm, state, prefix, cont)
    plain, rotated = lcg.encode(state, "compact"), lcg.encode(state, "compact", rope=rope)
    assert len(rotated) < len(plain)
    kl = {}
    for name, blob in (("plain", plain), ("rope", rotated)):
        logits = quality.continuation_logits(llm, lcg.decode(blob), prefix, cont)
        kl[name] = quality.compare_logits(ref, logits, cont)["kl"]
    assert kl["rope"] < 1.5 * kl["plain"] + 0.005, kl
