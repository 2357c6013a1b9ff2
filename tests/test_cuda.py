"""The CUDA backend (docs/cuda.md): decoding on a device gives the CPU decoder's bytes.

Three ways these checks run:
- without a device (every machine; LCG_NO_CUDA forces it): cuda_available() is False, device calls
  raise NoDeviceError, the CPU path works, and the library has no link to libcuda / libcudart;
- on the CPU emulator of the backend (libllama_cachegen_cuda_emu.so, in a subprocess): the host's
  plans and the kernels' per-lane code (kernels.h) against the CPU decoder, for every level and
  layout, chunks, golden containers and corrupt streams;
- on a real GPU when cuda_available() (skipped otherwise, saying so): the same checks in-process.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import llama_cachegen as lcg
import numpy as np
import pytest
from conftest import full_buffer, kv_cache_bytes, seq_buffer, seq_file, session_file
from llama_cachegen import codec
from llama_cachegen._native import ffi, lib
from test_bad_input import DATA, GOLDEN_VERSION, reseal, sections
from test_lanes import SLICES, _cases, _state

LEVELS = ("lossless", "high", "balanced", "compact")
PACKAGE = Path(lcg.__file__).parent
EMULATOR = PACKAGE / "libllama_cachegen_cuda_emu.so"
TESTS = Path(__file__).parent


# ---- without a device ---------------------------------------------------------------------------

_NO_DEVICE = """
import llama_cachegen as lcg
from llama_cachegen import codec
from llama_cachegen._native import ffi, lib
from test_lanes import _state

state = _state(37, 24, True, "outliers")
blob = lcg.encode(state, "balanced")
assert not lcg.cuda_available()
assert lcg.decode(blob) == lcg.decode(lcg.encode(state, "balanced"))  # the CPU path works
for call in (lambda: lcg.decode(blob, device="cuda"), lambda: lcg.DeviceBuffer(16)):
    try:
        call()
        raise SystemExit("no NoDeviceError")
    except lcg.NoDeviceError as e:
        assert e.status_name == "LCG_ERR_NO_DEVICE" and "{why}" in str(e), str(e)
status = lib.lcg_decode_device(blob, len(blob), ffi.NULL, 0, ffi.NULL)
assert status == lib.LCG_ERR_NO_DEVICE == -12, status
print("ok")
"""


@pytest.mark.parametrize(
    "env,why",
    [
        ({"LCG_NO_CUDA": "1"}, "LCG_NO_CUDA is set"),
        ({"LCG_CUDA_LIBRARY": "/nonexistent.so"}, "no CUDA backend"),
    ],
)
def test_without_a_device_calls_raise_no_device_error(env: dict[str, str], why: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _NO_DEVICE.replace("{why}", why)],
        cwd=TESTS,
        env=os.environ | env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_this_machine_reports_what_it_has() -> None:
    """cuda_available() is a bool that never raises; without a device, decode(device="cuda") says why."""
    available = lcg.cuda_available()
    assert isinstance(available, bool)
    blob = lcg.encode(_state(5, 1, False, "normal"), "high")
    if not available:
        with pytest.raises(lcg.NoDeviceError, match="no CUDA device"):
            lcg.decode(blob, device="cuda")
    with pytest.raises(lcg.InvalidArgumentError, match="unknown device"):
        lcg.decode(blob, device="tpu")
    assert lcg.errors.STATUS_EXCEPTIONS[-12] is lcg.NoDeviceError
    assert ffi.string(lib.lcg_status_name(-12)).decode() == "LCG_ERR_NO_DEVICE"


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf is not installed")
def test_the_library_does_not_link_cuda() -> None:
    """Loads on machines without CUDA: the backend is dlopened, and it links the CUDA runtime statically."""
    for name in ("libllama_cachegen.so", "libllama_cachegen_cuda.so"):
        path = PACKAGE / name
        if not path.exists():
            continue  # a build without CUDA
        elf = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True)
        needed = elf.stdout
        assert "libcuda" not in needed and "libcudart" not in needed, (name, needed)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_the_half_conversion_check(tmp_path: Path) -> None:
    """tests/cuda/half_conversions.cu compares the kernels' one-instruction f16/bf16 conversion with
    the CPU's integer code over every f32: built wherever nvcc is, run where a GPU is."""
    exe = tmp_path / "half_conversions"
    root = TESTS.parent
    build = [
        "nvcc", "-arch=sm_80", "--fmad=false", "-std=c++17", f"-I{root / 'native/include'}",
        f"-I{root / 'native/src'}", str(TESTS / "cuda/half_conversions.cu"), "-o", str(exe),
    ]  # fmt: skip
    subprocess.run(build, check=True, capture_output=True)
    if os.environ.get("LCG_CUDA_LIBRARY") or not lcg.cuda_available():
        pytest.skip("built; running it needs a CUDA device")
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0 and "0 of 2^32" in out.stdout, out.stdout + out.stderr


# ---- the checks, on the emulator or a GPU --------------------------------------------------------


def _bf16_state(cells: int, channels: int, v_trans: bool) -> bytes:
    """A one-layer K/V state of bf16 values (type 30), which the conftest builder does not make."""
    rng = np.random.default_rng(7)
    out = bytearray(struct.pack("<II", 1, cells))
    for pos in range(cells):
        out += struct.pack("<iIi", pos, 1, 0)
    out += struct.pack("<II", int(v_trans), 1)

    def bf16(a: np.ndarray) -> bytes:
        return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()

    k, v = rng.normal(0, 1, (cells, channels)), rng.normal(0, 0.5, (cells, channels))
    out += struct.pack("<iQ", 30, 2 * channels) + bf16(k)
    if v_trans:
        out += struct.pack("<iII", 30, 2, channels) + bf16(v.T.copy())
    else:
        out += struct.pack("<iQ", 30, 2 * channels) + bf16(v)
    return seq_buffer(bytes(out))


def _layouts() -> dict[str, bytes]:
    """Every shape of test_lanes, and the other types, kinds and layouts (odd offsets, streams, ext)."""
    rng = np.random.default_rng(11)
    cases = dict(_cases())
    cases["f32"] = seq_buffer(kv_cache_bytes(rng, cells_per_stream=(40,), dtype="f32"))
    cases["f32-T"] = seq_buffer(kv_cache_bytes(rng, cells_per_stream=(33,), v_trans=True, dtype="f32"))
    cases["bf16"] = _bf16_state(45, 64, False)
    cases["bf16-T"] = _bf16_state(45, 64, True)
    # an arch name of odd length: every tensor starts at an odd offset
    cases["full-odd"] = full_buffer(kv_cache_bytes(rng, cells_per_stream=(20,), v_trans=True), arch="abc")
    cases["streams-ext"] = seq_buffer(kv_cache_bytes(rng, cells_per_stream=(12, 0, 7), ext=True))
    cases["seq-file"] = seq_file(kv_cache_bytes(rng, cells_per_stream=(16,)), list(range(16)))
    cases["session"] = session_file(kv_cache_bytes(rng, cells_per_stream=(9,), v_trans=True), list(range(9)))
    return cases


@pytest.mark.parametrize("level", LEVELS[1:])
def test_anchor_delta_on_every_layout(level: str) -> None:
    """Anchor/delta encodes and decodes every layout and type (the CPU path): same state shape,
    and the lossless parts (cells, headers, exact rows) as plain coding gives them."""
    for name, state in _layouts().items():
        knobs = {"transform": "anchor-delta", "anchor_tokens": 3}
        out = lcg.decode(lcg.encode(state, level, **knobs))
        assert len(out) == len(state) and codec.encode_skeleton(out) == codec.encode_skeleton(state), name
        assert lcg.decode(lcg.encode(state, level, threads=2, **knobs)) == out, name


def check_decode_matches_cpu() -> None:
    for name, state in _layouts().items():
        for level in LEVELS:
            for slices in SLICES:
                blob = lcg.encode(state, level, threads=1, slice_elements=slices)
                dev = lcg.decode(blob, device="cuda")
                assert isinstance(dev, lcg.DeviceBuffer) and len(dev) == len(state)
                assert dev.to_host() == lcg.decode(blob), (name, level, slices)
    # into a larger buffer the caller owns: only the state's bytes are written
    blob = lcg.encode(_state(64, 40, False, "outliers"), "compact")
    size = lcg.decoded_size(blob)
    buf = lcg.DeviceBuffer(size + 100)
    buf.copy_from(b"\xab" * (size + 100))
    assert lcg.decode_into(blob, buf) == size
    assert buf.to_host() == lcg.decode(blob) + b"\xab" * 100


def check_chunks_match_cpu() -> None:
    for cells, channels, v_trans in [(300, 64, True), (300, 64, False), (37, 24, True), (5, 1, False)]:
        state = _state(cells, channels, v_trans, "outliers")
        skeleton = codec.encode_skeleton(state)
        for level in LEVELS:
            chunker = codec.Chunker(state, level, slice_elements=64)
            stats = chunker.stats()
            stats_id = hashlib.sha256(stats).digest()
            opened = codec.Stats(stats, stats_id)
            for chunk in (7, 100):
                host = codec.skeleton_state(skeleton, cells)
                dev = lcg.DeviceBuffer(len(host))
                dev.copy_from(host)
                bounds = list(range(0, cells, chunk)) + [cells]
                blobs = [chunker.chunk(b, e, stats_id) for b, e in zip(bounds, bounds[1:], strict=False)]
                for blob in blobs:
                    codec.decode_chunk(blob, opened, host)
                    codec.decode_chunk(blob, opened, codec.skeleton_state(skeleton, cells), device_state=dev)
                assert dev.to_host() == host, (cells, channels, v_trans, level, chunk)
                # all in one launch, in any order
                together = lcg.DeviceBuffer(len(host))
                together.copy_from(codec.skeleton_state(skeleton, cells))
                codec.decode_chunks(
                    blobs[::-1], opened, codec.skeleton_state(skeleton, cells), device_state=together
                )
                assert together.to_host() == host, (cells, channels, v_trans, level, chunk)
    # chunks sharing a position would race in one launch: refused before anything runs
    with pytest.raises(lcg.InvalidArgumentError, match="share positions"):
        codec.decode_chunks([blobs[0], blobs[0]], opened, host, device_state=together)
    overlapping = chunker.chunk(0, 2, stats_id)
    with pytest.raises(lcg.InvalidArgumentError, match="chunks 0 and 1 share positions"):
        codec.decode_chunks([blobs[0], overlapping], opened, host, device_state=together)
    before = together.to_host()
    codec.decode_chunks([], opened, host, device_state=together)  # nothing, as on the CPU
    assert together.to_host() == before
    with pytest.raises(lcg.InvalidArgumentError, match="the object is not a chunk"):
        codec.decode_chunks([blobs[0], stats], opened, host, device_state=together)


def check_golden_containers() -> None:
    for level in ("lossless", "balanced"):
        blob = (DATA / f"golden-v{GOLDEN_VERSION}-{level}.lcg").read_bytes()
        state = (DATA / f"golden-v{GOLDEN_VERSION}-{level}.state").read_bytes()
        assert lcg.decode(blob, device="cuda").to_host() == state


def check_bad_input_never_faults() -> None:
    """Resealed mutations of tensor sections (streams, escapes, exact rows): the device fails
    exactly when the CPU does, with a CacheGenError, and otherwise gives the CPU's bytes."""
    rng = np.random.default_rng(5)
    blobs = [
        lcg.encode(_state(cells, channels, tr, "outliers"), level, threads=1, slice_elements=slices)
        for cells, channels, tr in [(37, 24, True), (64, 40, False)]
        for level in LEVELS
        for slices in (None, 96)
    ]
    outcomes = {"ok": 0, "error": 0}
    for blob in blobs:
        tensor_sections = [(off, size) for typ, _, off, size in sections(blob) if typ == 3]
        for _ in range(60):
            mutant = bytearray(blob)
            off, size = tensor_sections[rng.integers(len(tensor_sections))]
            for _ in range(int(rng.integers(1, 4))):
                mutant[off + int(rng.integers(size))] ^= int(rng.integers(1, 256))
            reseal(mutant)
            try:
                expected = lcg.decode(mutant)
            except lcg.CacheGenError as e:
                with pytest.raises(lcg.CacheGenError) as got:
                    lcg.decode(mutant, device="cuda")
                assert type(got.value) is type(e), (got.value, e)  # not NoDeviceError
                outcomes["error"] += 1
                continue
            assert lcg.decode(mutant, device="cuda").to_host() == expected
            outcomes["ok"] += 1
    assert outcomes["error"] > 50, outcomes
    # anchor/delta decodes on the CPU only: refused, clearly
    blob = lcg.encode(_state(37, 24, True, "normal"), "balanced", transform="anchor-delta")
    with pytest.raises(lcg.UnsupportedFormatError, match="anchor/delta"):
        lcg.decode(blob, device="cuda")
    # so do the values of a q8_0 cache coded lossily
    blob = lcg.encode(
        seq_buffer(kv_cache_bytes(np.random.default_rng(1), n_embd=64, cells_per_stream=(64,), dtype="q8_0")),
        "balanced",
    )
    with pytest.raises(lcg.UnsupportedFormatError, match="q8_0"):
        lcg.decode(blob, device="cuda")
    # a destination too small is refused before anything runs
    small = lcg.DeviceBuffer(10)
    status = lib.lcg_decode_device(blobs[0], len(blobs[0]), ffi.cast("void *", small.ptr), 10, ffi.NULL)
    assert status == lib.LCG_ERR_DST_TOO_SMALL


def _chunk_parts(state: bytes) -> tuple[bytearray, codec.Stats, bytes]:
    """The skeleton's state of a 37-position state, its balanced statistics, and its one chunk."""
    chunker = codec.Chunker(state, "balanced")
    stats = chunker.stats()
    sid = hashlib.sha256(stats).digest()
    host = codec.skeleton_state(codec.encode_skeleton(state), 37)
    return host, codec.Stats(stats, sid), chunker.chunk(0, 37, sid)


class _Foreign:
    """Device memory as another library shows it: `__cuda_array_interface__` over a DeviceBuffer."""

    def __init__(self, buf: lcg.DeviceBuffer, **fields: Any) -> None:
        self.buf = buf
        self.__cuda_array_interface__ = buf.__cuda_array_interface__ | fields


def check_device_targets_are_checked() -> None:
    """What decode_into and decode_chunk write through is checked first: a foreign array's
    interface (read-only, masked, strided, unreadable, a pointer or stream out of range), a
    DeviceBuffer's size; a well-formed one of another element type or with a stream decodes."""
    state = _state(37, 24, True, "outliers")
    blob = lcg.encode(state, "balanced")
    expected = lcg.decode(blob)
    size = len(expected)
    buf = lcg.DeviceBuffer(size)
    bad = [
        {"data": (buf.ptr, True)},
        {"mask": object()},
        {"version": 4},
        {"shape": (-1, -size)},
        {"typestr": "xyz"},
        {"shape": None},
        {"data": None},
        {"strides": (2,)},
        {"data": (-1, False)},
        {"data": (2**64 + buf.ptr, False)},
        {"stream": 0},
        {"stream": -5},
    ]
    for fields in bad:
        with pytest.raises(lcg.InvalidArgumentError):
            lcg.decode_into(blob, _Foreign(buf, **fields))
    assert buf.to_host() != expected  # nothing was written
    good = [
        {"strides": (1,)},  # C-contiguous, said explicitly
        {"typestr": "<f2", "shape": (size // 2 + 1,)},  # a size in elements of 2 bytes
        {"stream": 1},  # the legacy default stream
        {"stream": 2},  # the per-thread default stream
        {"version": 2},
    ]
    for fields in good:
        buf.copy_from(bytes(size))
        assert lcg.decode_into(blob, _Foreign(buf, **fields)) == size
        assert buf.to_host() == expected, fields
    with pytest.raises(AttributeError):
        buf.size = 10 * size  # (it bounds every copy)
    for n in (-1, 2**64, 1.5, "10"):
        with pytest.raises(lcg.InvalidArgumentError):
            lcg.DeviceBuffer(n)  # type: ignore[arg-type]
    assert lcg.DeviceBuffer(0).__cuda_array_interface__["data"] == (0, False)
    with pytest.raises(lcg.InvalidArgumentError, match="DeviceBuffer"):
        buf.copy_to(bytearray(size))  # type: ignore[arg-type]
    with pytest.raises(lcg.InvalidArgumentError, match="contiguous"):
        buf.copy_from(np.zeros(2 * size, np.uint8)[::2])
    # decode_chunk's device_state: the same checks
    host, opened, chunk = _chunk_parts(state)
    with pytest.raises(lcg.InvalidArgumentError):
        codec.decode_chunk(chunk, opened, host, device_state=_Foreign(buf, data=(buf.ptr, True)))
    dev = lcg.DeviceBuffer(len(host))
    dev.copy_from(host)
    codec.decode_chunk(chunk, opened, host, device_state=_Foreign(dev, stream=2))
    codec.decode_chunk(chunk, opened, host)
    assert dev.to_host() == host


class _HostArray:
    """Pageable host memory that claims to be device memory (a wrong pointer, as a bug in another
    library would hand one over)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.__cuda_array_interface__ = {
            "shape": array.shape,
            "typestr": "|u1",
            "data": (array.ctypes.data, False),
            "version": 3,
        }


def check_host_memory_is_refused() -> None:
    """A kernel writing through host memory faults on a GPU and leaves the process's CUDA context
    unusable: the backend refuses a destination that is not device memory, writes nothing, and
    the next decode works."""
    state = _state(37, 24, True, "outliers")
    blob = lcg.encode(state, "balanced")
    expected = lcg.decode(blob)
    host = np.zeros(len(expected), np.uint8)
    with pytest.raises(lcg.InvalidArgumentError, match="not device memory"):
        lcg.decode_into(blob, _HostArray(host))
    skeleton_state, opened, chunk = _chunk_parts(state)
    target = np.frombuffer(bytes(skeleton_state), np.uint8).copy()
    with pytest.raises(lcg.InvalidArgumentError, match="not device memory"):
        codec.decode_chunk(chunk, opened, skeleton_state, device_state=_HostArray(target))
    assert not host.any() and target.tobytes() == bytes(skeleton_state)  # nothing written
    out = lcg.DeviceBuffer(len(expected))
    assert lcg.decode_into(blob, out) == len(expected)
    assert out.to_host() == expected


CHECKS = [
    check_decode_matches_cpu,
    check_device_targets_are_checked,
    check_host_memory_is_refused,
    check_chunks_match_cpu,
    check_golden_containers,
    check_bad_input_never_faults,
]


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_emulated_backend(check: str) -> None:
    """The checks on the CPU emulator of the CUDA backend, in a subprocess (a process loads one backend)."""
    if not EMULATOR.exists():
        pytest.skip("libllama_cachegen_cuda_emu.so not built (LCG_CUDA_EMULATOR=OFF)")
    out = subprocess.run(
        [sys.executable, "-c", f"import test_cuda; test_cuda.{check}(); print('ok')"],
        cwd=TESTS,
        env=os.environ | {"LCG_CUDA_LIBRARY": str(EMULATOR)},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_gpu(check) -> None:  # noqa: ANN001
    if os.environ.get("LCG_CUDA_LIBRARY") or not lcg.cuda_available():
        pytest.skip("no CUDA device here (llama_cachegen.cuda_available() is False): the GPU checks need one")
    check()
