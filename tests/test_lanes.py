"""The 32-lane stream layout at its edges: the AVX2 decoder and the scalar reference write the same
bytes (LCG_NO_SIMD forces the scalar paths in a subprocess), any thread count gives the same
container, and a state cut into chunks decodes to exactly what the whole container gives."""

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
from test_bad_input import sections

LEVELS = ("lossless", "high", "balanced", "compact")
# Stream slices (docs/format.md, "Streams"): the default, one step, and 3 steps (a last slice of
# any length below it).
SLICES = (None, 32, 96)
# (cells, channels, v_trans): 1 token, 1 channel, cells and channels that are not multiples of
# 32 / 8 / 4, the SmolLM2 shape, and more rows than the quantizer sums in 32 bits (8,192).
SHAPES = [
    (1, 64, False),
    (1, 64, True),
    (5, 1, False),
    (37, 24, True),
    (64, 40, False),
    (300, 64, True),
    (300, 64, False),
    (256, 192, True),
    (9, 3, True),
    (8200, 32, True),
]


def _state(cells: int, channels: int, v_trans: bool, kind: str) -> bytes:
    rng = np.random.default_rng(cells * 1000 + channels)
    state = bytearray(
        seq_buffer(kv_cache_bytes(rng, n_embd=channels, cells_per_stream=(cells,), v_trans=v_trans))
    )
    if kind == "outliers":  # escapes: a few values hundreds of steps from their channel's mean
        body = (
            np.frombuffer(state, np.uint8, offset=len(state) - 2 * cells * channels).view(np.float16).copy()
        )
        body[:: max(1, body.size // 7)] = 900.0
        state[len(state) - body.nbytes :] = body.tobytes()
    elif kind == "constant":  # one-symbol tables: the whole last tensor at one value
        state[len(state) - 2 * cells * channels :] = np.full(cells * channels, 0.25, np.float16).tobytes()
    return bytes(state)


def _cases() -> dict[str, bytes]:
    cases = {}
    for cells, channels, v_trans in SHAPES:
        for kind in ("normal", "outliers", "constant"):
            cases[f"{cells}x{channels}{'T' if v_trans else ''}-{kind}"] = _state(
                cells, channels, v_trans, kind
            )
    return cases


_DIGESTS = """
import hashlib, sys, llama_cachegen as l
for path in sys.argv[1:]:
    s = open(path, 'rb').read()
    for level in {levels!r}:
        for slices in {slices!r}:
            blob = l.encode(s, level, threads=1, slice_elements=slices)
            digests = [hashlib.sha256(b).hexdigest() for b in (blob, l.decode(blob))]
            print(path, level, slices, *digests)
        if level != "lossless":  # sink rows: left out of the statistics, stored exactly
            blob = l.encode(s, level, threads=1, sink_tokens=3)
            print(path, level, "sinks", hashlib.sha256(blob).hexdigest())
    # steps of 1/500 of a deviation: 4 raw bits per value (high has 2), escapes beyond them
    blob = l.encode(s, "high", threads=1, k_step=0.002, v_step=0.002, slice_elements=96)
    print(path, "fine", *[hashlib.sha256(b).hexdigest() for b in (blob, l.decode(blob))])
"""


def _digests(paths: list[str], env: dict[str, str]) -> list[str]:
    script = _DIGESTS.format(levels=LEVELS, slices=SLICES)
    out = subprocess.run(
        [sys.executable, "-c", script, *paths], env=env, capture_output=True, check=True, text=True
    )
    return out.stdout.splitlines()


def test_simd_and_scalar_paths_agree_on_every_shape(tmp_path: Path) -> None:
    paths = []
    for name, state in _cases().items():
        path = tmp_path / f"{name}.bin"
        path.write_bytes(state)
        paths.append(str(path))
    scalar = _digests(paths, os.environ | {"LCG_NO_SIMD": "1"})
    assert len(scalar) == len(paths) * (len(LEVELS) * len(SLICES) + len(LEVELS))
    for lookup in ("LCG_GATHER", "LCG_SCALAR_LOADS"):  # the AVX2 decoders' two table lookups
        assert _digests(paths, os.environ | {lookup: "1"}) == scalar, lookup


@pytest.mark.parametrize("name", sorted(_cases()))
def test_round_trip_and_threads(name: str) -> None:
    state = _cases()[name]
    for slices in SLICES:
        assert lcg.decode(lcg.encode(state, "lossless", slice_elements=slices)) == state
    for level in LEVELS[1:]:
        blob = lcg.encode(state, level, threads=1)
        assert lcg.encode(state, level, threads=2) == blob
        out = lcg.decode(blob, threads=2)
        assert out == lcg.decode(blob, threads=1) and len(out) == len(state)
        for slices in SLICES[1:]:  # slicing changes the coding, never the values
            assert lcg.decode(lcg.encode(state, level, threads=2, slice_elements=slices)) == out
        if name.endswith("constant"):  # a constant tensor comes back exactly
            tail = 2 * int(name.split("x")[0]) * int(name.split("x")[1].split("-")[0].rstrip("T"))
            assert out[-tail:] == state[-tail:]


def _assembled(chunker: lcg.codec.Chunker, state: bytes, cells: int, size: int) -> bytearray:
    """The state rebuilt from its skeleton and the chunker's chunks of `size` positions, decoded
    last first (any order works), one call each; and the same from one `decode_chunks` call."""
    stats = chunker.stats()
    stats_id = hashlib.sha256(stats).digest()
    opened = lcg.codec.Stats(stats, stats_id)
    skeleton = lcg.codec.encode_skeleton(state)
    out = lcg.codec.skeleton_state(skeleton, cells)
    assert len(out) == len(state)
    bounds = [*range(0, cells, size), cells]
    chunks = [chunker.chunk(begin, end, stats_id) for begin, end in zip(bounds, bounds[1:], strict=False)]
    for chunk in reversed(chunks):
        lcg.codec.decode_chunk(chunk, opened, out)
    batched = lcg.codec.skeleton_state(skeleton, cells)
    lcg.codec.decode_chunks(chunks, opened, batched, threads=2)
    assert batched == out
    return out


@pytest.mark.parametrize("chunk", [1, 7, 32, 100])
@pytest.mark.parametrize("level", LEVELS)
def test_chunks_decode_to_the_whole_containers_state(chunk: int, level: str) -> None:
    """Chunks share the whole state's statistics: assembling them gives the whole decode, bit for bit."""
    for cells, channels, v_trans in [(300, 64, True), (300, 64, False), (37, 24, True), (5, 1, False)]:
        state = _state(cells, channels, v_trans, "outliers")
        chunker = lcg.codec.Chunker(state, level, slice_elements=SLICES[chunk % len(SLICES)])
        out = _assembled(chunker, state, cells, chunk)
        assert out == lcg.decode(lcg.encode(state, level))
        if level == "lossless":
            assert out == state


@pytest.mark.parametrize("level", LEVELS)
def test_chunks_of_cells_out_of_position_order(level: str) -> None:
    """Cells holding positions in reverse order: a chunk's rows are not a run of cells, so its
    planes and symbols are gathered and placed element by element; still the whole decode."""
    for cells, channels, v_trans in [(300, 64, True), (300, 64, False)]:
        state = bytearray(_state(cells, channels, v_trans, "outliers"))
        for i in range(cells):  # seq buffer header (8), streams and cells (8), then 12 bytes a cell
            struct.pack_into("<i", state, 16 + 12 * i, cells - 1 - i)
        state = bytes(state)
        out = _assembled(lcg.codec.Chunker(state, level), state, cells, 64)
        assert out == lcg.decode(lcg.encode(state, level))
        if level == "lossless":
            assert out == state


@pytest.mark.parametrize("level", LEVELS[1:])
def test_anchor_delta_transform(level: str) -> None:
    """Anchor/delta keeps the error of plain coding (each delta is coded against its anchor as
    decoded), decodes the same on every path, cuts into chunks at multiples of its group, and is
    refused where it cannot decode: chunks starting inside a group, the GPU."""
    for cells, channels, v_trans in [(300, 64, True), (300, 64, False), (37, 24, True)]:
        state = _state(cells, channels, v_trans, "outliers")
        values = _last_tensor(state, cells * channels)
        plain = lcg.encode(state, level)
        knobs = {"transform": "anchor-delta", "anchor_tokens": 4}
        blob = lcg.encode(state, level, **knobs)
        assert blob != plain and lcg.encode(state, level, threads=2, **knobs) == blob
        err_plain = np.mean((_last_tensor(lcg.decode(plain), cells * channels) - values) ** 2)
        err = np.mean((_last_tensor(lcg.decode(blob), cells * channels) - values) ** 2)
        assert err <= 1.05 * err_plain, (err, err_plain)
        chunker = lcg.codec.Chunker(state, level, **knobs)
        assert _assembled(chunker, state, cells, 12) == lcg.decode(blob)
        with pytest.raises(lcg.InvalidArgumentError, match="multiple of 4"):
            chunker.chunk(2, 8, hashlib.sha256(chunker.stats()).digest())
    with pytest.raises(lcg.InvalidArgumentError, match="unknown transform"):
        lcg.encode(state, level, transform="pca")


def test_anchor_delta_on_f32_keeps_the_error() -> None:
    """The post-pass rounds to the tensor's own type: an f32 cache keeps plain coding's error."""
    rng = np.random.default_rng(3)
    state = seq_buffer(kv_cache_bytes(rng, n_embd=64, cells_per_stream=(90,), v_trans=True, dtype="f32"))
    values = np.frombuffer(state[len(state) - 4 * 90 * 64 :], np.float32).astype(np.float64)

    def err(blob: bytes) -> float:
        out = lcg.decode(blob)
        return float(np.mean((np.frombuffer(out[len(out) - 4 * 90 * 64 :], np.float32) - values) ** 2))

    plain = err(lcg.encode(state, "balanced"))
    assert 0 < err(lcg.encode(state, "balanced", transform="anchor-delta", anchor_tokens=5)) <= 1.05 * plain


def _last_tensor(state: bytes, n: int) -> np.ndarray:
    """The last K/V tensor of a test state (its last n f16 values), as floats."""
    return np.frombuffer(bytes(state[len(state) - 2 * n :]), np.float16).astype(np.float64)


def test_prefix_states_and_splice() -> None:
    state = _state(300, 64, True, "normal")
    skeleton = lcg.codec.encode_skeleton(state)
    prefix = lcg.codec.skeleton_state(skeleton, 100)
    assert lcg.inspect_state(prefix)["cells"] == 100 and lcg.inspect_state(prefix)["chunkable"]
    lcg.codec.splice(prefix, state, 0, 100)  # rows of positions 0..99 from the full state
    chunker = lcg.codec.Chunker(state, "lossless")
    stats = chunker.stats()
    sid = hashlib.sha256(stats).digest()
    rebuilt = lcg.codec.skeleton_state(skeleton, 100)
    opened = lcg.codec.Stats(stats, sid)
    lcg.codec.decode_chunk(chunker.chunk(0, 100, sid), opened, rebuilt)
    assert rebuilt == prefix
    with pytest.raises(lcg.CorruptDataError, match="other statistics"):
        lcg.codec.decode_chunk(chunker.chunk(0, 100, sid), lcg.codec.Stats(stats, bytes(32)), rebuilt)
    with pytest.raises(lcg.InvalidArgumentError):
        lcg.codec.decode_chunk(chunker.chunk(100, 200, sid), opened, rebuilt)  # past the prefix


def test_decode_chunks_checks_every_chunk_before_writing() -> None:
    state = _state(300, 64, True, "outliers")
    skeleton = lcg.codec.encode_skeleton(state)
    chunker = lcg.codec.Chunker(state, "balanced")
    stats = chunker.stats()
    sid = hashlib.sha256(stats).digest()
    opened = lcg.codec.Stats(stats, sid)
    good = [chunker.chunk(0, 100, sid), chunker.chunk(100, 200, sid)]
    out = lcg.codec.skeleton_state(skeleton, 300)
    before = bytes(out)
    damaged = bytearray(chunker.chunk(200, 300, sid))
    damaged[-1] ^= 1
    other = lcg.codec.Chunker(state, "compact")
    other_stats = other.stats()
    for bad, error in [
        (bytes(damaged), lcg.CorruptDataError),  # a checksum
        (other.chunk(200, 300, hashlib.sha256(other_stats).digest()), lcg.CorruptDataError),  # other stats
        (chunker.chunk(200, 300, sid)[:100], lcg.TruncatedDataError),
    ]:
        with pytest.raises(error):
            lcg.codec.decode_chunks([*good, bad], opened, out)
        assert out == before  # the good chunks before it were not written either
    lcg.codec.decode_chunks([], opened, out)
    assert out == before
    lcg.codec.decode_chunks([*good, chunker.chunk(200, 300, sid)], opened, out)
    assert out == lcg.decode(lcg.encode(state, "balanced"))


class _CauchyRng:
    """Stands in for kv_cache_bytes' generator: heavy-tailed values (standard Cauchy, within f16)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def normal(self, loc: float, scale: float, size: tuple[int, int]) -> np.ndarray:
        return np.clip(loc + scale * self.rng.standard_cauchy(size), -6e4, 6e4)


def _raw_bits(blob: bytes) -> list[int]:
    """Each tensor's raw_bits (docs/format.md, stats section: u8 coding, u8 group, u16 transform, u8
    raw_bits)."""
    return [blob[off + 4] for kind, _, off, _ in sections(blob) if kind == 5]


def test_raw_bits_follow_the_bulk_of_the_values() -> None:
    """At `high`, q's low bits go raw where most values spread over many steps (Gaussian), not where
    a few far values inflate the deviation the steps follow (Cauchy: the bulk is a few steps wide,
    and raw bits would cost ~25%); both decode to the same values as the scalar reference does."""
    shape = dict(n_layer=2, n_embd=128, cells_per_stream=(1000,))
    normal = seq_buffer(kv_cache_bytes(np.random.default_rng(5), **shape))
    heavy = seq_buffer(kv_cache_bytes(_CauchyRng(5), **shape))  # type: ignore[arg-type]
    blobs = [lcg.encode(normal, "high"), lcg.encode(heavy, "high")]
    assert min(_raw_bits(blobs[0])) >= 1 and max(_raw_bits(blobs[0])) >= 2
    assert max(_raw_bits(blobs[1])) <= 1  # (a rule on the deviation took 4)
    out = np.frombuffer(bytes(lcg.decode(blobs[1]))[-2 * 1000 * 128 :], np.float16)
    assert np.isfinite(out).all()
    decode = "import sys, llama_cachegen as l; sys.stdout.buffer.write(l.decode(sys.stdin.buffer.read()))"
    for blob in blobs:
        env = os.environ | {"LCG_NO_SIMD": "1"}
        scalar = subprocess.run([sys.executable, "-c", decode], input=blob, env=env, capture_output=True)
        assert scalar.returncode == 0 and scalar.stdout == lcg.decode(blob)


def test_a_state_of_few_tokens_is_never_larger_than_lossless() -> None:
    """A tensor of a few cells whose lossy statistics (steps, means, tables) cost more than
    quantizing saves is coded exactly instead: no lossy level is larger than lossless (a 1-token
    state then comes back exactly); with more cells quantizing pays again."""
    for cells in (1, 2, 8, 24):
        rng = np.random.default_rng(cells)
        state = seq_buffer(kv_cache_bytes(rng, n_embd=192, cells_per_stream=(cells,)))
        exact = len(lcg.encode(state, "lossless"))
        for level in LEVELS[1:]:
            assert len(lcg.encode(state, level)) <= exact, (cells, level)
        if cells == 1:
            assert lcg.decode(lcg.encode(state, "compact")) == state
        if cells == 24:
            assert len(lcg.encode(state, "compact")) < exact
