"""Bad input gets a specific error and never a crash: truncation, bit flips, forged sizes,
unknown formats; and the synthetic layouts SmolLM2 cannot produce still round-trip."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

import llama_cachegen as lcg
import numpy as np
import pytest
from conftest import full_buffer, kv_cache_bytes, seq_buffer, seq_file, session_file
from llama_cachegen import codec, quality

HEADER = 64
ENTRY = 32
DATA = Path(__file__).parent / "data"


def crc32c(data: bytes, crc: int = 0) -> int:
    table = _crc_table()
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = (crc >> 8) ^ table[(crc ^ b) & 0xFF]
    return crc ^ 0xFFFFFFFF


def _crc_table() -> list[int]:
    if not _TABLE:
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
            _TABLE.append(c)
    return _TABLE


_TABLE: list[int] = []


def sections(blob: bytes) -> list[tuple[int, int, int, int]]:
    """(type, tensor, offset, size) of each section table entry."""
    (n,) = struct.unpack_from("<I", blob, 12)
    return [struct.unpack_from("<IIQQ", blob, HEADER + ENTRY * i) for i in range(n)]


def reseal(blob: bytearray) -> bytearray:
    """Recomputes every section CRC and the header CRC, as a forger would."""
    for i, (_, _, off, size) in enumerate(sections(bytes(blob))):
        struct.pack_into("<I", blob, HEADER + ENTRY * i + 24, crc32c(bytes(blob[off : off + size])))
    (n,) = struct.unpack_from("<I", blob, 12)
    head = crc32c(bytes(blob[: HEADER - 4]))
    head = crc32c(bytes(blob[HEADER : HEADER + ENTRY * n]), head)
    struct.pack_into("<I", blob, HEADER - 4, head)
    return blob


@pytest.fixture(scope="module")
def small_state(model_path: Path, gpl_tokens: list[int]) -> bytes:
    llm = quality.make_llama(model_path, n_ctx=64, logits_all=False)
    return quality.state_of(llm, gpl_tokens[:24])


@pytest.fixture(scope="module", params=["lossless", "balanced"])
def blob(request: pytest.FixtureRequest, small_state: bytes) -> bytes:
    return lcg.encode(small_state, request.param)


def test_reseal_reproduces_the_encoder(blob: bytes) -> None:
    assert bytes(reseal(bytearray(blob))) == blob


def test_checksums_of_large_sections_match_a_plain_crc32c() -> None:
    # the native CRC runs three 16 KiB blocks side by side past 48 KiB: sections of ~60-90 KiB
    rng = np.random.default_rng(7)
    state = seq_buffer(kv_cache_bytes(rng, n_layer=1, n_embd=232, cells_per_stream=(197,)))
    blob = lcg.encode(state, "lossless")
    assert max(size for _, _, _, size in sections(blob)) > 3 * 16384
    assert bytes(reseal(bytearray(blob))) == blob


def test_truncation_at_every_section_boundary(blob: bytes) -> None:
    cuts = {0, 3, 4, 10, HEADER - 1, HEADER, len(blob) - 1}
    for _, _, off, size in sections(blob):
        cuts |= {off, off + 1, off + size // 2, off + size - 1}
    for cut in sorted(c for c in cuts if c < len(blob)):
        with pytest.raises((lcg.TruncatedDataError, lcg.NotAContainerError)):
            lcg.decode(blob[:cut])


@pytest.mark.parametrize("region", ["header", "table", "layout", "verbatim", "tensor"])
def test_flipped_bits_are_caught_by_checksums(blob: bytes, region: str) -> None:
    rng = np.random.default_rng(7)
    secs = sections(blob)
    (n,) = struct.unpack_from("<I", blob, 12)
    if region == "header":
        spans = [(16, HEADER)]  # past magic, version and the level/kind bytes checked first
    elif region == "table":
        spans = [(HEADER, HEADER + ENTRY * n)]
    else:
        kind = {"layout": 1, "verbatim": 2, "tensor": 3}[region]
        spans = [(off, off + size) for t, _, off, size in secs if t == kind and size]
    for _ in range(40):
        lo, hi = spans[rng.integers(len(spans))]
        pos = int(rng.integers(lo, hi))
        bad = bytearray(blob)
        bad[pos] ^= 1 << int(rng.integers(8))
        with pytest.raises((lcg.ChecksumError, lcg.TruncatedDataError, lcg.LimitExceededError)):
            lcg.decode(bad)


def test_wrong_magic_and_version(blob: bytes) -> None:
    with pytest.raises(lcg.NotAContainerError, match="LCGC"):
        lcg.decode(b"PK\x03\x04" + blob[4:])
    with pytest.raises(lcg.NotAContainerError):
        lcg.decode(b"")
    newer = bytearray(blob)
    struct.pack_into("<H", newer, 4, GOLDEN_VERSION + 1)
    with pytest.raises(lcg.UnsupportedVersionError, match=f"version {GOLDEN_VERSION + 1}"):
        lcg.decode(reseal(newer))
    with pytest.raises(lcg.UnsupportedVersionError):
        lcg.inspect(reseal(newer))


def test_absurd_sizes_are_refused_before_allocating(blob: bytes) -> None:
    huge_state = bytearray(blob)
    struct.pack_into("<Q", huge_state, 16, 1 << 50)
    with pytest.raises(lcg.LimitExceededError):
        lcg.decoded_size(reseal(huge_state))
    expanded = bytearray(blob)
    struct.pack_into("<Q", expanded, 16, 5000 * len(blob) + (1 << 21))
    with pytest.raises(lcg.LimitExceededError, match="expansion"):
        lcg.decode(reseal(expanded))
    many_sections = bytearray(blob)
    struct.pack_into("<I", many_sections, 12, 1 << 30)
    with pytest.raises(lcg.LimitExceededError, match="sections"):
        lcg.decode(many_sections)


def test_a_forged_state_size_is_refused_before_allocating(blob: bytes) -> None:
    """Issue 7: a container declaring a state 1000x its size (within the expansion bound) made
    decode zero that much memory before the layout check refused it. The layout is now checked
    first: the forged decode peaks far below the honest one's output."""
    import tracemalloc

    forged = bytearray(blob)
    struct.pack_into("<Q", forged, 16, 1000 * len(blob))
    forged = reseal(forged)
    tracemalloc.start()
    try:
        with pytest.raises(lcg.CorruptDataError, match="segments add up"):
            lcg.decode(forged)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(blob) + (1 << 20) < 1000 * len(blob)


def test_forged_layout_is_inconsistent(blob: bytes) -> None:
    layout = next((off, size) for t, _, off, size in sections(blob) if t == 1)
    for field_offset, value in ((4, 1 << 31), (8, 1 << 31), (36 + 16, 1 << 30), (36 + 20, 3), (36 + 24, 0)):
        bad = bytearray(blob)
        struct.pack_into("<I", bad, layout[0] + field_offset, value)
        with pytest.raises(lcg.CorruptDataError):
            lcg.decode(reseal(bad))


def test_random_resealed_mutations_never_crash(blob: bytes) -> None:
    rng = np.random.default_rng(11)
    secs = [(off, size) for t, _, off, size in sections(blob) if t in (1, 3) and size]
    outcomes = set()
    for _ in range(150):
        bad = bytearray(blob)
        off, size = secs[rng.integers(len(secs))]
        for _ in range(int(rng.integers(1, 4))):
            bad[off + int(rng.integers(size))] = int(rng.integers(256))
        try:
            out = lcg.decode(reseal(bad))
            outcomes.add("decoded")
            assert len(out) == lcg.decoded_size(blob)
        except lcg.CacheGenError as err:
            outcomes.add(type(err).__name__)
    assert "CorruptDataError" in outcomes


# ---- llama.cpp states this library does not read ------------------------------------------------


def test_unknown_states_are_refused_with_what_was_found(small_state: bytes) -> None:
    with pytest.raises(lcg.UnsupportedFormatError, match="0x46445025"):
        lcg.encode(b"%PDF-1.7 not a state at all")
    with pytest.raises(lcg.UnsupportedFormatError, match="at least 8 bytes"):
        lcg.encode(b"\x01\x02")
    with pytest.raises(lcg.UnsupportedFormatError):
        lcg.encode(small_state[: len(small_state) // 2])
    memory = kv_cache_bytes(np.random.default_rng(0))
    with pytest.raises(lcg.UnsupportedFormatError, match="version 2; this library reads version 3"):
        lcg.encode(seq_file(memory, [1, 2, 3], version=2))
    with pytest.raises(lcg.UnsupportedFormatError, match="version 9"):
        lcg.encode(session_file(memory, [1, 2], version=9))
    bad_type = bytearray(small_state)
    # first K layer's ggml type: after magic, seq id, n_stream, cell_count, cells, v_trans, n_layer
    n_cells = struct.unpack_from("<I", small_state, 12)[0]
    struct.pack_into("<i", bad_type, 16 + 12 * n_cells + 8, 12)  # q4_K: not a KV cache type
    with pytest.raises(lcg.UnsupportedFormatError, match="ggml type 12"):
        lcg.encode(bad_type)
    with pytest.raises(lcg.InvalidArgumentError):
        lcg.encode(small_state, "ultra")
    with pytest.raises(lcg.InvalidArgumentError):
        lcg.encode("a string is not a buffer")  # type: ignore[arg-type]
    with pytest.raises(lcg.InvalidArgumentError, match="k_step"):
        lcg.encode(small_state, "balanced", k_step=float("nan"))


# ---- synthetic layouts --------------------------------------------------------------------------


def _round_trips(state: bytes, tensors: int) -> None:
    assert lcg.inspect_state(state)["tensors"] == tensors
    assert lcg.decode(lcg.encode(state, "lossless")) == state
    lossy = lcg.decode(lcg.encode(state, "compact", sink_tokens=2))
    assert len(lossy) == len(state) and codec.encode_skeleton(lossy) == codec.encode_skeleton(state)


@pytest.mark.parametrize("v_trans", [False, True])
def test_synthetic_layouts_round_trip(v_trans: bool) -> None:
    rng = np.random.default_rng(1)
    swa = kv_cache_bytes(rng, cells_per_stream=(5,), v_trans=v_trans)
    base = kv_cache_bytes(rng, cells_per_stream=(9,), v_trans=v_trans)
    _round_trips(seq_buffer(base + swa), 8)  # interleaved SWA: two caches
    _round_trips(full_buffer(kv_cache_bytes(rng, cells_per_stream=(7, 0, 3, 11), v_trans=v_trans)), 12)
    _round_trips(full_buffer(kv_cache_bytes(rng, ext=True, v_trans=v_trans), "qwen2vl"), 4)
    _round_trips(seq_buffer(kv_cache_bytes(rng, with_v=False)), 2)  # MLA-style: no V
    _round_trips(full_buffer(kv_cache_bytes(rng, seqs_per_cell=3, dtype="f32", v_trans=v_trans)), 4)
    _round_trips(seq_file(base, list(range(9))), 4)
    _round_trips(session_file(base, list(range(9))), 4)
    _round_trips(seq_buffer(struct.pack("<II", 1, 0)), 0)  # empty cache


def test_hybrid_tail_is_carried_verbatim() -> None:
    rng = np.random.default_rng(2)
    tail = b"\x07\x00\x00\x00recurrent-state" + bytes(range(200))
    state = full_buffer(kv_cache_bytes(rng) + tail, "jamba")
    _round_trips(state, 4)
    assert lcg.decode(lcg.encode(state, "compact")).endswith(tail)
    assert codec.inspect_state(state)["tail"]
    assert not codec.inspect_state(full_buffer(kv_cache_bytes(rng)))["tail"]


def test_non_finite_values_fall_back_to_lossless() -> None:
    rng = np.random.default_rng(3)
    state = bytearray(seq_buffer(kv_cache_bytes(rng, n_embd=32)))
    nan_at = len(state) - 10
    state[nan_at : nan_at + 2] = np.array([np.nan], np.float16).tobytes()
    out = lcg.decode(lcg.encode(bytes(state), "compact"))
    assert np.isnan(np.frombuffer(bytes(out[nan_at : nan_at + 2]), np.float16)[0])


@pytest.mark.parametrize("transform", ["none", "anchor-delta"])
@pytest.mark.parametrize("level", ["high", "balanced", "compact"])
def test_values_at_the_edge_of_f16_never_decode_to_inf(level: str, transform: str) -> None:
    """A channel at +-65504 (f16's largest finite value) beside ordinary ones: a lossy value may
    land a step past it, which f16 holds only as inf (and anchor/delta's differences reach twice
    it): such a tensor is coded losslessly, every other stays lossy."""
    rng = np.random.default_rng(5)
    cells, channels = 256, 64
    state = bytearray(seq_buffer(kv_cache_bytes(rng, n_embd=channels, cells_per_stream=(cells,))))
    tail = len(state) - 2 * cells * channels  # the last tensor (V of the last layer)
    edge = np.frombuffer(bytes(state[tail:]), np.float16).reshape(cells, channels).copy()
    edge[:, 0] = np.float16(65504) * np.where(rng.random(cells) < 0.5, 1, -1)
    edge[:, 1] = rng.uniform(60000, 65504, cells).astype(np.float16)
    state[tail:] = edge.tobytes()
    out = lcg.decode(lcg.encode(bytes(state), level, transform=transform))
    values = np.frombuffer(bytes(out[tail:]), np.float16)
    assert np.isfinite(values).all() and out[tail:] == state[tail:]
    ordinary = slice(tail - 2 * cells * channels, tail)  # the tensor before: still lossy
    assert np.isfinite(np.frombuffer(bytes(out[ordinary]), np.float16)).all()
    assert out[ordinary] != state[ordinary]


# ---- golden files -------------------------------------------------------------------------------

# 1,024 symbols per stream in slices of 96: ten full slices and a short one.
GOLDEN_SLICE = 96
GOLDEN_VERSION = 4
GOLDEN_LEVELS = ["lossless", "high", "balanced"]
# the error scales the golden containers were written with (the levels' defaults may be retuned)
GOLDEN_SCALE = {"lossless": None, "high": 0.6, "balanced": 2.5}


def golden_state() -> bytes:
    rng = np.random.default_rng(2024)
    # K of 64 channels: two groups of 32, coded group by group (docs/format.md, "grouped")
    return seq_buffer(kv_cache_bytes(rng, n_layer=2, n_embd=64, cells_per_stream=(16,)))


def golden_container(level: str) -> bytes:
    scale = GOLDEN_SCALE.get(level)
    extra = {} if scale is None else {"error_scale": scale}
    return lcg.encode(golden_state(), level, threads=1, slice_elements=GOLDEN_SLICE, **extra)


@pytest.mark.parametrize("level", GOLDEN_LEVELS)
def test_golden_containers_still_decode(level: str) -> None:
    """Containers written by format version 4 decode to the same bytes forever, and the encoder
    still writes exactly what it wrote when its output last changed on purpose (the scalar and SIMD
    paths, any thread count; `encoder-v4-*`, else the golden container); `high` codes raw bits."""
    blob = (DATA / f"golden-v{GOLDEN_VERSION}-{level}.lcg").read_bytes()
    expected = (DATA / f"golden-v{GOLDEN_VERSION}-{level}.state").read_bytes()
    assert lcg.version()[1] == GOLDEN_VERSION
    assert lcg.decode(blob) == expected
    pinned = DATA / f"encoder-v{GOLDEN_VERSION}-{level}.lcg"
    assert golden_container(level) == (pinned.read_bytes() if pinned.exists() else blob)
    if level == "lossless":
        assert expected == golden_state()


@pytest.mark.parametrize("version", [1, 2, 3])
@pytest.mark.parametrize("level", ["lossless", "balanced"])
def test_older_versions_are_refused_clearly(version: int, level: str) -> None:
    blob = (DATA / f"golden-v{version}-{level}.lcg").read_bytes()
    expected = f"version {version}; this library reads version 4 .*encode the state again"
    for call in (lcg.decode, lcg.inspect, lcg.decoded_size, lcg.user_meta):
        with pytest.raises(lcg.UnsupportedVersionError, match=expected):
            call(blob)


def test_stream_slices_are_checked() -> None:
    """A slice size that is not a multiple of 32 is refused at encode; a forged slice directory
    (size, byte counts, escape counts) is refused at decode, checksums resealed."""
    with pytest.raises(lcg.InvalidArgumentError, match="multiple of 32"):
        lcg.encode(golden_state(), "balanced", slice_elements=48)
    blob = golden_container("balanced")
    _, _, off, _ = next(s for s in sections(blob) if s[0] == 3)  # the first tensor: 16 cells x 64 units
    (n_sink,) = struct.unpack_from("<I", blob, off)
    stream = off + 4 + 4 * n_sink + n_sink * 64 * 2 + 4  # after its exact rows and u32 stream_bytes
    assert struct.unpack_from("<I", blob, stream) == (GOLDEN_SLICE,)
    n_slices = -(-16 * 64 // GOLDEN_SLICE)
    directory = [struct.unpack_from("<II", blob, stream + 4 + 8 * i) for i in range(n_slices)]
    forged = {
        "slice size 0": (stream, 0),
        "slice size 33": (stream, 33),
        "one slice": (stream, 1 << 20),
        "a slice's bytes": (stream + 4, directory[0][0] + 2),
        "a slice's escapes": (stream + 4 + 4, directory[0][1] + 1),
    }
    for what, (at, value) in forged.items():
        bad = bytearray(blob)
        struct.pack_into("<I", bad, at, value)
        try:
            lcg.decode(reseal(bad))
        except lcg.CorruptDataError:
            continue
        pytest.fail(f"a forged slice directory ({what}) decoded")


@pytest.mark.parametrize("transform", [5, 1 | 1 << 8, 1 | 0 << 8])
def test_unknown_transforms_are_refused(transform: int) -> None:
    """A stats section's transform id that this library does not know (or an anchor/delta group of
    fewer than 2 tokens) is refused, never decoded as something else."""
    blob = bytearray(golden_container("balanced"))
    _, _, off, _ = next(s for s in sections(bytes(blob)) if s[0] == 5)
    struct.pack_into("<H", blob, off + 2, transform)
    with pytest.raises(lcg.CorruptDataError, match="transform"):
        lcg.decode(reseal(blob))


def test_q8_0_values_are_refused_for_another_type() -> None:
    """Coding 2 (a q8_0 tensor coded as its values) in the statistics of an f16 tensor is refused,
    never decoded as something else."""
    blob = bytearray(golden_container("balanced"))
    _, _, off, _ = next(s for s in sections(bytes(blob)) if s[0] == 5)
    assert blob[off] == 1  # u8 coding: lossy
    blob[off] = 2
    with pytest.raises(lcg.CorruptDataError, match="q8_0 values coded for a f16 tensor"):
        lcg.decode(reseal(blob))
    blob[off] = 3
    with pytest.raises(lcg.CorruptDataError, match="coding 3"):
        lcg.decode(reseal(blob))


def test_raw_bits_are_checked() -> None:
    """`high` sends two low bits of each q raw; a stats section that claims more than 4, or another
    count than its slices hold, is refused (checksums resealed), never decoded as something else."""
    blob = golden_container("high")
    _, _, off, _ = next(s for s in sections(blob) if s[0] == 5)  # u8 coding, u8 group, u16 transform
    assert blob[off + 4] == 2
    for raw_bits, match in [(5, "raw bits"), (0, None), (1, None), (4, None)]:
        bad = bytearray(blob)
        bad[off + 4] = raw_bits
        with pytest.raises(lcg.CorruptDataError, match=match):
            lcg.decode(reseal(bad))


def _struct(name: str, size: int, fill: int = 0) -> tuple[Any, Any]:
    """A caller's `name` of `size` bytes (another header's layout), every byte `fill`; returns the
    pointer and the memory it points into (keep it alive)."""
    memory = codec.ffi.new("uint8_t[]", [fill] * size)
    return codec.ffi.cast(f"{name} *", memory), memory


def test_parameter_structs_of_other_layouts() -> None:
    """lcg_encode_params as the header's growth rule says: a struct smaller than 0.5's (an older
    header), of size 0 or absurd is refused before anything past struct_size is read (ASan would
    see the read); a newer caller's larger struct is accepted when the fields this library does
    not know are 0 (the same container) and refused, naming the byte, when one is set; reserved
    fields must be 0; lcg_encode_params_init fills defaults and zeroes a larger tail."""
    ffi, lib = codec.ffi, codec.lib
    ours = ffi.sizeof("lcg_encode_params")
    state = golden_state()
    out, out_size = ffi.new("void **"), ffi.new("size_t *")

    def encode(params: Any) -> bytes:
        codec.check(lib.lcg_encode(codec._view(state), len(state), params, out, out_size))
        return codec._take(out, out_size)

    for size, match in [(ours - 16, "older than 0.5"), (0, "is 0"), (1 << 20, "not a size")]:
        params, _memory = _struct("lcg_encode_params", ours)
        params.struct_size = size
        with pytest.raises(lcg.InvalidArgumentError, match=match):
            codec.check(lib.lcg_encode(codec._view(state), len(state), params, out, out_size))
        with pytest.raises(lcg.InvalidArgumentError, match=match):
            codec.check(lib.lcg_encode_params_init(params, size))
    reference = lcg.encode(state, "balanced")
    larger, memory = _struct("lcg_encode_params", ours + 24, fill=0xA5)
    codec.check(lib.lcg_encode_params_init(larger, ours + 24))
    assert larger.struct_size == ours + 24 and larger.level == lib.LCG_LEVEL_BALANCED
    assert bytes(ffi.buffer(memory))[ours:] == bytes(24)
    assert encode(larger) == reference
    memory[ours + 5] = 1  # a newer caller asks for something
    with pytest.raises(lcg.InvalidArgumentError, match=f"byte {ours + 5} .*does not know"):
        encode(larger)
    params, _memory = _struct("lcg_encode_params", ours)
    codec.check(lib.lcg_encode_params_init(params, ours))
    assert encode(params) == reference
    params.reserved1 = 7
    with pytest.raises(lcg.InvalidArgumentError, match="reserved"):
        encode(params)


def test_info_structs_of_other_layouts() -> None:
    """lcg_info, whose size the caller passes (it was read from the struct the library is to
    fill: a 0.4 caller's stack garbage, and the library zeroed that many bytes past it): a newer
    caller's larger struct gets this library's fields and 0 in the rest; smaller than 0.5's, 0 or
    absurd sizes are refused and nothing is written."""
    ffi, lib = codec.ffi, codec.lib
    ours = ffi.sizeof("lcg_info")
    blob, state = golden_container("balanced"), golden_state()
    for call, expected in (
        (lambda i, n: lib.lcg_inspect(blob, len(blob), i, n), codec.inspect(blob)),
        (lambda i, n: lib.lcg_inspect_state(state, len(state), 0, i, n), codec.inspect_state(state)),
    ):
        larger, memory = _struct("lcg_info", ours + 32, fill=0xA5)
        codec.check(call(larger, ours + 32))
        assert bytes(ffi.buffer(memory))[ours:] == bytes(32)
        assert larger.n_cells == expected["cells"] and larger.n_tensors == expected["tensors"]
        for size, match in [(ours - 8, "older than 0.5"), (0, "is 0"), (1 << 20, "not a size")]:
            info, memory = _struct("lcg_info", ours, fill=0xA5)
            with pytest.raises(lcg.InvalidArgumentError, match=match):
                codec.check(call(info, size))
            assert bytes(ffi.buffer(memory)) == b"\xa5" * ours


def test_golden_bad_containers_fail() -> None:
    blob = (DATA / f"golden-v{GOLDEN_VERSION}-balanced.lcg").read_bytes()
    with pytest.raises(lcg.ChecksumError):
        lcg.decode(blob[:-1] + bytes([blob[-1] ^ 0x10]))
    with pytest.raises(lcg.TruncatedDataError):
        lcg.decode(blob[:-1])


def _memory(positions: list[int], seqs: int, k: np.ndarray) -> bytes:
    """One stream of f16 K rows `k` (and V) at `positions`, each cell in sequences 0..seqs-1."""
    out = struct.pack("<II", 1, len(positions))
    for p in positions:
        out += struct.pack("<iI", p, seqs) + b"".join(struct.pack("<i", s) for s in range(seqs))
    n_embd = k.shape[1]
    out += struct.pack("<II", 0, 1)
    out += struct.pack("<iQ", 1, n_embd * 2) + k.astype(np.float16).tobytes()
    return out + struct.pack("<iQ", 1, n_embd * 2) + np.zeros_like(k, np.float16).tobytes()


def test_rope_positions_come_from_the_layouts_cells() -> None:
    """A RoPE-coded K tensor takes each row's position from the state that the verbatim bytes
    describe: a forged verbatim section of 2 cells x 128 channels where the layout says 4 cells x 64
    (the same bytes) read positions past the 2 parsed ones (a heap read, bytes leaked into the
    rotation, no error). The same whole-state decode takes only the positions its cells use: a
    span from INT32_MIN to INT32_MAX took a minute and a GiB for a 1 KB container."""
    rng = np.random.default_rng(0)
    head_dim, base = 64, 10000.0
    half, theta = head_dim // 2, base ** (-2.0 * np.arange(head_dim // 2) / head_dim)
    c = rng.normal(0, 1, head_dim)

    def rotated(positions: list[int]) -> np.ndarray:
        k = np.empty((len(positions), head_dim))
        for r, p in enumerate(positions):
            k[r, :half] = c[:half] * np.cos(p * theta) - c[half:] * np.sin(p * theta)
            k[r, half:] = c[:half] * np.sin(p * theta) + c[half:] * np.cos(p * theta)
        return k

    rope = codec.Rope("halves", head_dim, head_dim, (base,))
    positions = [100, 101, 102, 103]
    state = seq_buffer(_memory(positions, 1, rotated(positions)))
    blob = bytearray(codec.encode(state, "balanced", threads=1, sink_tokens=0, rope=rope))
    (off, size) = next((o, s) for t, _, o, s in sections(bytes(blob)) if t == 2)  # the verbatim bytes
    other = seq_buffer(_memory([100, 101], 4, np.zeros((2, 2 * head_dim))))
    verbatim = other[:84] + other[84 + 512 : 84 + 512 + 12]  # all but the K and V rows
    assert len(verbatim) == size
    blob[off : off + size] = verbatim
    with pytest.raises(lcg.CorruptDataError, match="cell positions"):
        codec.decode(bytes(reseal(blob)), threads=1)

    far = [-(2**31), 2**31 - 1, 0, 1]
    state = seq_buffer(_memory(far, 1, rotated(far)))
    out = codec.decode(codec.encode(state, "balanced", threads=1, sink_tokens=0, rope=rope), threads=1)
    assert len(out) == len(state)


def test_statistics_with_a_step_or_mean_that_is_not_finite_are_refused() -> None:
    """An encoder writes finite steps and means only. A forged NaN or inf there made every value
    of its unit or group NaN, whose payload the decoders did not agree on (the AVX2 path kept it,
    the scalar and GPU code write one quiet NaN): found by fuzzing the device path against the
    CPU. Every 2-byte position of a statistics object set to NaN or inf, resealed: either refused
    as not finite (or otherwise corrupt), or a chunk decodes without a NaN."""
    rng = np.random.default_rng(3)
    state = seq_buffer(kv_cache_bytes(rng, n_layer=2, n_embd=24, cells_per_stream=(20,), v_trans=True))
    chunker = codec.Chunker(state, "balanced")
    stats = chunker.stats()
    skeleton = codec.encode_skeleton(state)
    sid = hashlib.sha256(stats).digest()
    reference = codec.skeleton_state(skeleton, 20)
    codec.decode_chunk(chunker.chunk(0, 20, sid), codec.Stats(stats, sid), reference)

    def nans(buf: bytes | bytearray) -> int:
        v = np.frombuffer(bytes(buf), np.uint16)
        return int((((v & 0x7C00) == 0x7C00) & ((v & 0x3FF) != 0)).sum())

    refused = 0
    for off in range(HEADER, len(stats) - 1):
        for value in (b"\x00\x7e", b"\x00\x7c"):  # NaN, inf
            mutant = bytearray(stats)
            mutant[off : off + 2] = value
            reseal(mutant)
            sid = hashlib.sha256(mutant).digest()
            try:
                opened = codec.Stats(bytes(mutant), sid)
            except lcg.CacheGenError as e:
                refused += "is not finite" in str(e)
                continue
            out = codec.skeleton_state(skeleton, 20)
            try:
                codec.decode_chunk(chunker.chunk(0, 20, sid), opened, out)
            except lcg.CacheGenError:
                continue
            assert nans(out) == nans(reference), (off, value)
    assert refused >= 2 * 4 * 24, refused  # at least every mean of the 4 tensors, as NaN and as inf


def test_a_state_buffer_cut_short_says_so() -> None:
    """A chunk decoded into a state buffer one byte short: the error names the shortfall and a
    buffer cut short (it named recurrent models only)."""
    state = seq_buffer(kv_cache_bytes(np.random.default_rng(2), n_embd=16, cells_per_stream=(40,)))
    chunker = codec.Chunker(state, "balanced")
    stats = chunker.stats()
    sid = hashlib.sha256(stats).digest()
    short = codec.skeleton_state(codec.encode_skeleton(state), 40)[:-1]
    with pytest.raises(lcg.UnsupportedFormatError, match=r"only \d+ left\): a buffer cut short"):
        codec.decode_chunk(chunker.chunk(0, 40, sid), codec.Stats(stats, sid), bytearray(short))


def test_cells_at_other_positions_are_refused_before_any_row_is_placed() -> None:
    """A chunk is placed by its cells' positions, which must be 0..n-1 once each. A state whose
    cells say otherwise (llama.cpp's own after removing a sequence's first tokens, or a forged
    skeleton from a store) made the position map write past its end: a heap overflow that
    crashed the loaders and llama-server's proxy. Refused, as is a skeleton taken for a whole
    container (its state of zero K/V came back without a word) and a read-only buffer to write."""
    rng = np.random.default_rng(5)
    state = seq_buffer(kv_cache_bytes(rng, n_layer=2, n_embd=32, cells_per_stream=(20,)))
    chunker = codec.Chunker(state, "balanced")
    stats = chunker.stats()
    sid = hashlib.sha256(stats).digest()
    opened, chunk = codec.Stats(stats, sid), chunker.chunk(0, 8, sid)
    cell5 = struct.pack("<iIi", 5, 1, 0) + struct.pack("<iIi", 6, 1, 0)  # cell 5 and 6's records

    def moved(data: bytes, pos: int) -> bytearray:
        out = bytearray(data)
        struct.pack_into("<i", out, data.index(cell5), pos)
        return out

    shifted = bytearray(state)  # positions 10..29: after llama_memory_seq_rm of the first 10
    at = state.index(struct.pack("<iIi", 0, 1, 0))
    for i in range(20):
        struct.pack_into("<i", shifted, at + 12 * i, i + 10)
    for bad in (moved(state, 50_000_000), moved(state, -1), shifted):
        with pytest.raises(lcg.UnsupportedFormatError, match="do not hold positions"):
            codec.decode_chunk(chunk, opened, bad)
        with pytest.raises(lcg.UnsupportedFormatError, match="do not hold positions"):
            codec.splice(bad, state, 0, 8)
    skeleton = codec.encode_skeleton(state)
    unparsable = bytearray(skeleton)  # cell 5 in 300 sequences: no state llama.cpp writes
    struct.pack_into("<I", unparsable, skeleton.index(cell5) + 4, 300)
    for forged in (bytes(reseal(moved(skeleton, 50_000_000))), bytes(reseal(unparsable))):
        for n_pos in (20, 10):
            with pytest.raises(lcg.CorruptDataError, match="skeleton whose state cannot be cut"):
                codec.skeleton_state(forged, n_pos)
    for call in (lcg.decode, lcg.decoded_size):
        with pytest.raises(lcg.InvalidArgumentError, match="holds no K/V"):
            call(skeleton)
    target = codec.skeleton_state(skeleton, 20)
    for read_only in (bytes(target), memoryview(bytes(target))):
        with pytest.raises(lcg.InvalidArgumentError, match="writable"):
            codec.decode_chunk(chunk, opened, read_only)
        with pytest.raises(lcg.InvalidArgumentError, match="writable"):
            lcg.decode_into(lcg.encode(state, "balanced"), read_only)
    codec.decode_chunk(chunk, opened, target)  # the checks above refuse nothing that is right
