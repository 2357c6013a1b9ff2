"""encode / decode / inspect: thin wrappers over the native codec."""

from __future__ import annotations

import ctypes
import functools
import operator
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._native import check, ffi, lib
from .errors import InvalidArgumentError, LimitExceededError

Buffer = bytes | bytearray | memoryview | Any  # anything exposing the buffer protocol

# Taken from the library's own enums so that the binding cannot drift from it.
LEVELS: dict[str, int] = {
    name: getattr(lib, f"LCG_LEVEL_{name.upper()}") for name in ("lossless", "high", "balanced", "compact")
}
LEVEL_NAMES: dict[int, str] = {v: k for k, v in LEVELS.items()}
LEVEL_ORDER: tuple[str, ...] = tuple(LEVELS)  # best first: lossless, high, balanced, compact
KINDS: dict[str, int] = {
    name: getattr(lib, f"LCG_KIND_{name.upper()}")
    for name in ("auto", "seq_buffer", "full_buffer", "seq_file", "session")
}
KIND_NAMES: dict[int, str] = {v: k for k, v in KINDS.items()}
TRANSFORMS: dict[str, int] = {
    name: getattr(lib, f"LCG_TRANSFORM_{name.upper().replace('-', '_')}") for name in ("none", "anchor-delta")
}
PARTS: dict[int, str] = {
    getattr(lib, f"LCG_PART_{name.upper()}"): name for name in ("whole", "skeleton", "stats", "chunk")
}
SECTION_NAMES: dict[int, str] = {
    getattr(lib, f"LCG_SECTION_{name.upper()}"): name
    for name in ("layout", "verbatim", "tensor", "user_meta", "stats", "stats_ref")
}
STATS_ID_BYTES = 32
ROPE_PAIRINGS: dict[str, int] = {
    name: getattr(lib, f"LCG_ROPE_{name.upper()}") for name in ("adjacent", "halves")
}


@dataclass(frozen=True)
class Rope:
    """A model's RoPE, for coding its keys rotated back by position (lossy levels, CPU decode).

    `pairing`: "adjacent" (channels 2i, 2i + 1 of a head: llama.cpp's NORM rope type) or "halves"
    (i, i + n_dims / 2: NEOX); `bases`: one or two candidate frequency bases (e.g. global and
    sliding-window layers), each K tensor taking the one that shrinks its channels' spread most, or
    none. `llama_cachegen.model_rope(llm)` reads it from a loaded model.
    """

    pairing: str
    head_dim: int
    n_dims: int
    bases: tuple[float, ...]
    freq_scale: float = 1.0


_REFERENCE_NAMES = {2: "q4_0", 7: "q5_1", 8: "q8_0"}  # ggml type ids (docs/llama-state.md)


def _level(level: str | int) -> int:
    if isinstance(level, str):
        if level not in LEVELS:
            raise InvalidArgumentError(f"unknown level {level!r}; expected one of {', '.join(LEVELS)}")
        return LEVELS[level]
    if not isinstance(level, int) or isinstance(level, bool) or level not in LEVEL_NAMES:
        raise InvalidArgumentError(
            f"unknown level {level!r}; expected one of {', '.join(LEVELS)} or 0..{len(LEVELS) - 1}"
        )
    return int(level)


def level_name(level: str | int) -> str:
    """The name of a level given by name or number (InvalidArgumentError when it is neither)."""
    return LEVEL_NAMES[_level(level)]


def _kind(kind: str) -> int:
    if kind not in KINDS:
        raise InvalidArgumentError(f"unknown state kind {kind!r}; expected one of {', '.join(KINDS)}")
    return KINDS[kind]


def _threads(threads: int | None) -> int:
    return 0 if threads is None else int(threads)


def _writable(data: Buffer, what: str) -> Any:
    """A pointer into a caller's buffer that a call writes: a read-only one (bytes, whose value
    and hash must not change) is refused."""
    try:
        return ffi.from_buffer(data, require_writable=True)
    except (TypeError, ValueError, BufferError) as exc:  # BufferError: read-only; ValueError: strided
        raise InvalidArgumentError(f"{what}: expected a writable buffer, got {type(data).__name__}") from exc


def _view(data: Buffer) -> Any:
    if isinstance(data, ffi.CData):  # already a view (internal reuse)
        return data
    try:
        return ffi.from_buffer(data)
    except (TypeError, ValueError) as exc:  # (ValueError: a non-contiguous buffer)
        what = type(data).__name__
        raise InvalidArgumentError(f"expected a contiguous bytes-like object, got {what}") from exc


def _params(
    level: str | int,
    threads: int | None,
    kind: str,
    k_step: float | None = None,
    v_step: float | None = None,
    first_layer_scale: float | None = None,
    sink_tokens: int | None = None,
    error_scale: float | None = None,
    slice_elements: int | None = None,
    transform: str = "none",
    anchor_tokens: int | None = None,
    rope: Rope | None = None,
    error_weights: Sequence[float] | None = None,
) -> tuple[Any, Any]:
    """The native parameters, and what they point to that must outlive them (error_weights)."""
    params = ffi.new("lcg_encode_params *")
    check(lib.lcg_encode_params_init(params, ffi.sizeof("lcg_encode_params")))
    params.level = _level(level)
    params.state_kind = _kind(kind)
    params.n_threads = _threads(threads)
    if k_step is not None:
        params.k_step = k_step
    if v_step is not None:
        params.v_step = v_step
    if first_layer_scale is not None:
        params.first_layer_scale = first_layer_scale
    if sink_tokens is not None:
        params.n_sink_tokens = sink_tokens
    if error_scale is not None:
        params.error_scale = error_scale
    if slice_elements is not None:
        if not 0 < slice_elements < 2**32:
            raise InvalidArgumentError(f"slice_elements {slice_elements}: expected a positive multiple of 32")
        params.slice_elements = slice_elements
    if transform not in TRANSFORMS:
        raise InvalidArgumentError(f"unknown transform {transform!r}; expected {' or '.join(TRANSFORMS)}")
    params.transform = TRANSFORMS[transform]
    if anchor_tokens is not None:
        if not 2 <= anchor_tokens <= 255:
            raise InvalidArgumentError(f"anchor_tokens {anchor_tokens}: expected 2..255")
        params.anchor_tokens = anchor_tokens
    if rope is not None:
        if rope.pairing not in ROPE_PAIRINGS or not 1 <= len(rope.bases) <= 2:
            raise InvalidArgumentError(
                f"rope pairing {rope.pairing!r} with {len(rope.bases)} bases: expected "
                f"{' or '.join(ROPE_PAIRINGS)} and one or two bases"
            )
        if not (0 < rope.head_dim < 2**16 and 0 < rope.n_dims < 2**16):
            raise InvalidArgumentError(
                f"rope head_dim {rope.head_dim}, n_dims {rope.n_dims}: expected 1..65535"
            )
        params.rope_pairing = ROPE_PAIRINGS[rope.pairing]
        params.rope_head_dim = rope.head_dim
        params.rope_n_dims = rope.n_dims
        for i, base in enumerate(rope.bases):
            params.rope_bases[i] = base
        params.rope_freq_scale = rope.freq_scale
    weights = ffi.NULL
    if error_weights is not None:
        weights = ffi.new("float[]", [float(w) for w in error_weights])
        params.error_weights = weights
        params.n_error_weights = len(error_weights)
    return params, weights


# A bytes object of n bytes, not yet written (CPython's own way to build bytes in place).
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_HUGE_PAGE = 1 << 21
_MADV_HUGEPAGE = 14  # Linux
_libc = ctypes.CDLL(None) if sys.platform == "linux" else None


def advise_huge_pages(address: int, size: int) -> None:
    """Asks Linux for transparent huge pages under the whole 2 MiB pages of [address, address +
    size), memory about to be written for the first time: a page fault per 2 MiB instead of one per
    4 KiB (600 MB: 1.27 s -> 0.12 s). Nothing elsewhere, or for less than two huge pages."""
    if _libc is None or size < 2 * _HUGE_PAGE:
        return
    first = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    length = (address + size - first) // _HUGE_PAGE * _HUGE_PAGE
    _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(length), _MADV_HUGEPAGE)


def _fresh_bytes(size: int) -> tuple[bytes, Any]:
    """A bytes object of `size` bytes to be filled before anyone else sees it, and a pointer to its
    bytes, advised for huge pages: filling 40 MB of fresh 4 KiB pages costs ~15 ms of page faults,
    a third of a lossless encode (a fault per 2 MiB: ~1 ms)."""
    blob = _new_bytes(None, size)
    dst = ffi.from_buffer(blob)
    advise_huge_pages(int(ffi.cast("uintptr_t", dst)), size)
    return blob, dst


def _alloc_bytes(ctx: Any, size: int) -> Any:
    """lcg_encode_params.out_alloc: the container goes straight into a new bytes object, kept in
    the list `ctx` is a handle to (with its pointer, alive until the encode returns)."""
    try:
        blob, dst = _fresh_bytes(size)
    except MemoryError:
        return ffi.NULL
    ffi.from_handle(ctx).extend((blob, dst))
    return dst


@functools.cache
def _alloc_bytes_callback() -> Any:
    """_alloc_bytes as a C function pointer, made on first use; None where libffi cannot make one
    (systems that refuse writable and executable memory): encode then copies the library's buffer."""
    try:
        return ffi.callback("void *(void *, size_t)", _alloc_bytes)
    except (MemoryError, OSError, RuntimeError):
        return None


def _take(out: Any, out_size: Any) -> bytes:
    """Copies a library-allocated buffer into bytes and frees it."""
    try:
        blob, dst = _fresh_bytes(out_size[0])
        ffi.memmove(dst, out[0], out_size[0])
        return blob
    finally:
        lib.lcg_free(out[0])


def encode(
    state: Buffer,
    level: str | int = "balanced",
    *,
    threads: int | None = None,
    kind: str = "auto",
    k_step: float | None = None,
    v_step: float | None = None,
    first_layer_scale: float | None = None,
    sink_tokens: int | None = None,
    error_scale: float | None = None,
    slice_elements: int | None = None,
    transform: str = "none",
    anchor_tokens: int | None = None,
    rope: Rope | None = None,
    error_weights: Sequence[float] | None = None,
    user_meta: Buffer = b"",
) -> bytes:
    """Compresses a llama.cpp state (any supported kind) into a llama-cachegen container.

    A lossy level sets each tensor's step so that its squared error is `error_scale` times the
    error of llama.cpp's reference cache type for the level (q8_0, q5_1, q4_0) on that tensor.
    `k_step`, `v_step` (fixed steps in the tensor's RMS channel deviation), `first_layer_scale`
    and `sink_tokens` override the level's preset; `slice_elements` (a multiple of 32, default
    65536) is how many symbols each independently decodable slice of a stream codes;
    `transform="anchor-delta"` codes each token of a group of `anchor_tokens` (default 10) as its
    difference from the group's first (CacheGen's grouping; CPU decode only); `rope` (a `Rope`,
    e.g. `model_rope(llm)`) codes keys rotated back by their position where that shrinks them (CPU
    decode only); `error_weights` (one per K/V tensor, in the state's order: per cache, K of each
    layer, then V) multiply each tensor's squared error; `user_meta` is stored verbatim
    (checksummed) in the container.
    """
    params, _weights = _params(
        level,
        threads,
        kind,
        k_step,
        v_step,
        first_layer_scale,
        sink_tokens,
        error_scale,
        slice_elements,
        transform,
        anchor_tokens,
        rope,
        error_weights,
    )
    meta = _view(user_meta)
    params.user_meta = meta
    params.user_meta_size = len(meta)
    src = _view(state)
    out = ffi.new("void **")
    out_size = ffi.new("size_t *")
    callback = _alloc_bytes_callback()
    if callback is None:
        check(lib.lcg_encode(src, len(src), params, out, out_size))
        return _take(out, out_size)
    made: list[Any] = []  # the container's bytes object (and its pointer), from _alloc_bytes
    handle = ffi.new_handle(made)
    params.out_alloc = callback
    params.out_alloc_ctx = handle
    check(lib.lcg_encode(src, len(src), params, out, out_size))
    return made[0]


def decoded_size(blob: Buffer) -> int:
    """Size in bytes of the state that `blob` decodes to (from its checked header)."""
    src = _view(blob)
    size = ffi.new("size_t *")
    check(lib.lcg_decoded_size(src, len(src), size))
    return int(size[0])


def decode(
    blob: Buffer, *, threads: int | None = None, device: str | None = None
) -> bytearray | DeviceBuffer:
    """Decompresses a container back into llama.cpp state bytes; verifies every checksum.

    Returns a bytearray (no extra copy; writable, so ctypes can wrap it without copying too).
    With `device="cuda"` the state is decoded on the current CUDA device into a DeviceBuffer (the
    same bytes; `threads` is not used); NoDeviceError when there is no device, driver or CUDA build.
    """
    if device is not None and device != "cpu":
        _device_name(device)
        src = _view(blob)
        if not cuda_available():  # NoDeviceError saying why, before anything else
            check(lib.lcg_decode_device(src, len(src), ffi.NULL, 0, ffi.NULL))
        out = DeviceBuffer(decoded_size(src))
        decode_into(src, out)
        return out
    src = _view(blob)
    dst = bytearray(decoded_size(src))
    decode_into(src, dst, threads=threads)
    return dst


def _check_room(src: Any, capacity: int) -> int:
    """The caller's buffer is the caller's to size: too small is their error, not the library's.
    Returns the size the state needs."""
    need = decoded_size(src)
    if capacity < need:
        raise InvalidArgumentError(f"the buffer holds {capacity} bytes, the state needs {need}")
    return need


def decode_into(blob: Buffer, dst: Buffer | DeviceBuffer, *, threads: int | None = None) -> int:
    """Decodes into a caller's writable buffer of at least `decoded_size(blob)` bytes; returns the
    bytes written. Reusing one buffer is the fast path: a fresh one costs its page faults (about
    as much as decoding, measured in bench/speed.py).

    A DeviceBuffer, or any object with `__cuda_array_interface__` (CuPy, PyTorch, Numba: writable,
    C-contiguous, unmasked, on the current device), is decoded into on the GPU, on the stream its
    interface names (so after the work queued there; without one, the legacy default stream)."""
    src = _view(blob)
    device = _device_target(dst)
    if device is not None:
        need = _check_room(src, device.size)
        check(lib.lcg_decode_device(src, len(src), device.ptr, device.size, device.stream))
        return need
    written = ffi.new("size_t *")
    out = _writable(dst, "decode_into")
    _check_room(src, len(out))
    check(lib.lcg_decode(src, len(src), _threads(threads), out, len(out), written))
    return int(written[0])


# ---- CUDA (docs/cuda.md) ------------------------------------------------------------------------


def cuda_available() -> bool:
    """Whether a CUDA device can decode: the library was built with its CUDA backend, and a driver
    and a device are present. False is not an error: the CPU path always works."""
    return int(lib.lcg_cuda_available()) > 0


def device_timing() -> tuple[float, float]:
    """Seconds the last device decode of this thread spent uploading its object and plan, and in
    its kernels (CUDA events; for benchmarks)."""
    upload, kernels = ffi.new("double *"), ffi.new("double *")
    lib.lcg_device_last_timing(upload, kernels)
    return float(upload[0]), float(kernels[0])


def _device_name(device: str) -> None:
    if device != "cuda":
        raise InvalidArgumentError(f"unknown device {device!r}; expected None, 'cpu' or 'cuda'")


class DeviceBuffer:
    """Bytes in CUDA device memory (the current device), allocated by the library, not zeroed, and
    freed when collected. `__cuda_array_interface__` lets CuPy, PyTorch or Numba use it without a
    copy (`torch.as_tensor(buf, device="cuda")`, `cupy.asarray(buf)`)."""

    __slots__ = ("_ptr", "_size")

    def __init__(self, size: int) -> None:
        try:
            n = operator.index(size)
        except TypeError as exc:
            raise InvalidArgumentError(f"a device buffer's size is a whole number, not {size!r}") from exc
        if not 0 <= n < 2**63:
            raise InvalidArgumentError(f"a device buffer of {n} bytes")
        ptr = ffi.new("void **")
        check(lib.lcg_device_alloc(n, ptr))
        self._ptr = ffi.gc(ptr[0], lib.lcg_device_free)
        self._size = n

    @property
    def size(self) -> int:
        return self._size

    @property
    def ptr(self) -> int:
        return int(ffi.cast("uintptr_t", self._ptr))

    def __len__(self) -> int:
        return self._size

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        data = (self.ptr if self._size else 0, False)  # (a size of 0 exports no pointer)
        return {"shape": (self._size,), "typestr": "|u1", "data": data, "version": 3, "strides": None}

    def to_host(self) -> bytearray:
        """A host copy of the bytes."""
        out = bytearray(self._size)
        if self._size:
            check(lib.lcg_device_copy(ffi.from_buffer(out), self._ptr, self._size, ffi.NULL))
        return out

    def copy_from(self, data: Buffer) -> None:
        """Overwrites the start of the buffer with host bytes."""
        src = _view(data)
        if len(src) > self._size:
            raise InvalidArgumentError(f"{len(src)} bytes do not fit a {self._size}-byte device buffer")
        if len(src):
            check(lib.lcg_device_copy(self._ptr, src, len(src), ffi.NULL))

    def copy_to(self, dst: DeviceBuffer) -> None:
        """Device to device copy of the whole buffer into `dst` (at least as large)."""
        if not isinstance(dst, DeviceBuffer):
            what = type(dst).__name__
            raise InvalidArgumentError(f"copy_to: expected a DeviceBuffer, got {what} (see to_host)")
        if dst.size < self._size:
            raise InvalidArgumentError(f"{self._size} bytes do not fit a {dst.size}-byte device buffer")
        if self._size:
            check(lib.lcg_device_copy(dst._ptr, self._ptr, self._size, ffi.NULL))


@dataclass(frozen=True)
class _DeviceTarget:
    ptr: Any  # void *
    size: int  # bytes
    stream: Any  # cudaStream_t (NULL: the legacy default stream)


def _device_target(buf: Any) -> _DeviceTarget | None:
    """Where a decode on the GPU writes: a DeviceBuffer, or an object whose
    `__cuda_array_interface__` (versions 0 to 3) describes writable, C-contiguous, unmasked device
    memory; None for host memory. Anything else is refused here, before a kernel could write
    through a pointer the caller did not mean."""
    if isinstance(buf, DeviceBuffer):
        return _DeviceTarget(ffi.cast("void *", buf.ptr), buf.size, ffi.NULL)
    iface = getattr(buf, "__cuda_array_interface__", None)
    if iface is None:
        return None
    try:
        version = operator.index(iface.get("version", 0))
        shape = tuple(operator.index(n) for n in iface["shape"])
        itemsize = np.dtype(iface["typestr"]).itemsize
        ptr, readonly = iface["data"]
        ptr = operator.index(ptr)
        strides = iface.get("strides")
        strides = None if strides is None else tuple(operator.index(n) for n in strides)
        stream = iface.get("stream")
        stream = None if stream is None else operator.index(stream)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        why = f"{type(exc).__name__}: {exc}"
        raise InvalidArgumentError(f"unreadable __cuda_array_interface__ ({why})") from exc
    if not 0 <= version <= 3:
        raise InvalidArgumentError(f"__cuda_array_interface__ version {version} (this library reads 0 to 3)")
    if any(n < 0 for n in shape):
        raise InvalidArgumentError(f"__cuda_array_interface__ shape {shape}")
    if readonly:
        raise InvalidArgumentError("the device array is read-only")
    if iface.get("mask") is not None:
        raise InvalidArgumentError("a masked device array cannot be decoded into")
    size = itemsize
    for n in shape:
        size *= n
    contiguous = [itemsize] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        contiguous[d] = contiguous[d + 1] * shape[d + 1]
    if strides is not None and size and strides != tuple(contiguous):
        raise InvalidArgumentError("a device array must be C-contiguous")
    if not 0 <= ptr < 2**64:
        raise InvalidArgumentError(f"__cuda_array_interface__ pointer {ptr:#x}")
    if stream is None:
        return _DeviceTarget(ffi.cast("void *", ptr), size, ffi.NULL)
    if not 0 < stream < 2**64:  # (0 is ambiguous: 1 names the legacy default stream, 2 per-thread)
        raise InvalidArgumentError(f"__cuda_array_interface__ stream {stream}")
    return _DeviceTarget(ffi.cast("void *", ptr), size, ffi.cast("void *", stream))


_CONTAINER_FIELDS = ("format_version", "part", "level")  # a raw state has none of these


def _info_dict(info: Any) -> dict[str, Any]:
    return {
        "format_version": info.format_version,
        "part": PARTS.get(info.part, str(info.part)),
        "level": LEVEL_NAMES.get(info.level, str(info.level)),
        "kind": KIND_NAMES.get(info.state_kind, str(info.state_kind)),
        "tensors": info.n_tensors,
        "cells": info.n_cells,
        "layers": info.n_layers,
        "tokens": info.n_tokens,
        "state_size": info.state_size,
        "kv_bytes": info.kv_bytes,
        "caches": info.n_caches,
        "chunkable": bool(info.chunkable),
        "positions": (int(info.pos_begin), int(info.pos_end)),
    }


def inspect(blob: Buffer) -> dict[str, Any]:
    """Describes a container object (whole, skeleton, stats or chunk): kind, layout, level and knobs,
    sizes per section, ratio."""
    src = _view(blob)
    info = ffi.new("lcg_info *")
    check(lib.lcg_inspect(src, len(src), info, ffi.sizeof(info[0])))
    result = _info_dict(info)
    result.update(
        container_size=info.container_size,
        ratio=info.state_size / info.container_size if info.container_size else 0.0,
        k_step=info.k_step if info.ref_type < 0 else None,  # fixed steps, when no reference sets them
        v_step=info.v_step if info.ref_type < 0 else None,
        first_layer_scale=info.first_layer_scale,
        sink_tokens=info.n_sink_tokens,
        reference=_REFERENCE_NAMES.get(info.ref_type),
        error_scale=info.error_scale if info.ref_type >= 0 else None,
        stats_id=bytes(ffi.buffer(info.stats_id, STATS_ID_BYTES)).hex()
        if info.part == lib.LCG_PART_CHUNK
        else None,
    )
    count = ffi.new("uint32_t *")
    table = ffi.new("lcg_section[]", info.n_sections)
    check(lib.lcg_inspect_sections(src, len(src), table, info.n_sections, count))
    sizes: dict[str, int] = {}
    for section in table:
        name = SECTION_NAMES.get(section.type, f"type{section.type}")
        sizes[name] = sizes.get(name, 0) + section.size
    result["sections"] = sizes
    return result


def inspect_state(state: Buffer, kind: str = "auto") -> dict[str, Any]:
    """Parses a llama.cpp state without encoding it; raises UnsupportedFormatError if unreadable.
    "tail": bytes follow its KV caches (a hybrid model's recurrent state, of the last position);
    "type_k", "type_v": the ggml type ids of its first K and V tensors (-1: none)."""
    src = _view(state)
    info = ffi.new("lcg_info *")
    check(lib.lcg_inspect_state(src, len(src), _kind(kind), info, ffi.sizeof(info[0])))
    fields = {k: v for k, v in _info_dict(info).items() if k not in _CONTAINER_FIELDS}
    return {**fields, "tail": bool(info.has_tail), "type_k": info.k_type, "type_v": info.v_type}


def user_meta(blob: Buffer) -> bytes:
    """The opaque bytes stored with `encode(..., user_meta=...)` (b"" when none), checksum verified."""
    src = _view(blob)
    ptr = ffi.new("void **")
    size = ffi.new("size_t *")
    check(lib.lcg_user_meta(src, len(src), ffi.cast("const void **", ptr), size))
    return bytes(ffi.buffer(ptr[0], size[0])) if size[0] else b""


def encode_skeleton(state: Buffer, *, kind: str = "auto") -> bytes:
    """The skeleton of a state: everything but its K/V payloads, and its layout (small)."""
    src = _view(state)
    out = ffi.new("void **")
    out_size = ffi.new("size_t *")
    check(lib.lcg_encode_skeleton(src, len(src), _kind(kind), out, out_size))
    return _take(out, out_size)


def empty_buffer(size: int) -> np.ndarray:
    """A writable buffer of `size` bytes, not zeroed, for a state about to be written whole. numpy
    advises huge pages for a large array: filling it costs a page fault per 2 MiB, where zeroing a
    bytearray costs one per 4 KiB (~18 ms for a 47 MB state, as long as decoding it)."""
    return np.empty(size, dtype=np.uint8)


def skeleton_state(
    skeleton: Buffer, n_pos: int, *, max_size: int | None = None, alloc: Callable[[int], Any] = bytearray
) -> Any:
    """The state of the skeleton's first `n_pos` positions with zero K/V, ready for `decode_chunk`,
    in `alloc(size)` (a bytearray by default; the loaders pass `empty_buffer`).

    `max_size` refuses (LimitExceededError) a skeleton whose whole state (what a prefix is cut
    from) would be larger, before anything is allocated.
    """
    src = _view(skeleton)
    if max_size is not None and (full := inspect(src)["state_size"]) > max_size:
        raise LimitExceededError(f"the skeleton's state needs {full} bytes (at most {max_size})")
    size = ffi.new("size_t *")
    check(lib.lcg_skeleton_state(src, len(src), n_pos, ffi.NULL, 0, size))
    if max_size is not None and size[0] > max_size:
        raise LimitExceededError(
            f"the skeleton's state of {n_pos} positions needs {size[0]} bytes (at most {max_size})"
        )
    dst = alloc(size[0])
    check(lib.lcg_skeleton_state(src, len(src), n_pos, ffi.from_buffer(dst), len(dst), size))
    return dst


class Chunker:
    """Chunk encoding of one state at one level: the state is parsed, its statistics computed and
    quantized once; `stats()` and `chunk(begin, end, stats_id)` then cut it at will.

    The state buffer must stay alive and unchanged while the chunker is used.
    """

    def __init__(
        self,
        state: Buffer,
        level: str | int = "balanced",
        *,
        threads: int | None = None,
        kind: str = "auto",
        **knobs: Any,
    ) -> None:
        self._state = _view(state)  # keeps the buffer alive
        params, _weights = _params(level, threads, kind, **knobs)  # the chunker copies the weights
        handle = ffi.new("lcg_chunker **")
        check(lib.lcg_chunker_init(self._state, len(self._state), params, handle))
        self._handle = ffi.gc(handle[0], lib.lcg_chunker_free)

    def stats(self) -> bytes:
        out = ffi.new("void **")
        out_size = ffi.new("size_t *")
        check(lib.lcg_chunker_stats(self._handle, out, out_size))
        return _take(out, out_size)

    def chunk(self, begin: int, end: int, stats_id: bytes, user_meta: Buffer = b"") -> bytes:
        if len(stats_id) != STATS_ID_BYTES:
            raise InvalidArgumentError(f"stats_id must be {STATS_ID_BYTES} bytes")
        meta = _view(user_meta)
        out = ffi.new("void **")
        out_size = ffi.new("size_t *")
        check(lib.lcg_chunker_encode(self._handle, begin, end, stats_id, meta, len(meta), out, out_size))
        return _take(out, out_size)


class Stats:
    """A statistics object opened for decoding chunks: checked once, its tables expanded once.

    `stats_id` is the caller's SHA-256 of `data`; chunks that name another id are refused.
    """

    def __init__(self, data: Buffer, stats_id: bytes, *, threads: int | None = None) -> None:
        if len(stats_id) != STATS_ID_BYTES:
            raise InvalidArgumentError(f"stats_id must be {STATS_ID_BYTES} bytes")
        src = _view(data)
        handle = ffi.new("lcg_stats **")
        check(lib.lcg_stats_open(src, len(src), stats_id, _threads(threads), handle))
        self._handle = ffi.gc(handle[0], lib.lcg_stats_free)
        self.id = bytes(stats_id)


def decode_chunk(
    chunk: Buffer,
    stats: Stats,
    state: bytearray,
    *,
    threads: int | None = None,
    device_state: DeviceBuffer | Any = None,
) -> None:
    """Decodes a chunk into its place in `state` (from `skeleton_state`); checksums, layout and the
    statistics id are verified first.

    With `device_state` (a DeviceBuffer or an object with `__cuda_array_interface__` holding a
    device copy of `state`), the chunk is decoded on the GPU into it and `state` is only read for
    its layout (cells, positions): its K/V bytes are left as they are."""
    c = _view(chunk)
    if device_state is not None:
        device = _device_state(device_state, state)
        host = _view(state)
        check(
            lib.lcg_decode_chunk_device(c, len(c), stats._handle, host, len(host), device.ptr, device.stream)
        )
        return
    dst = _writable(state, "decode_chunk")
    check(lib.lcg_decode_chunk(c, len(c), stats._handle, _threads(threads), dst, len(dst)))


def _device_state(device_state: DeviceBuffer | Any, state: Buffer) -> _DeviceTarget:
    device = _device_target(device_state)
    if device is None:
        raise InvalidArgumentError("device_state: expected a DeviceBuffer or __cuda_array_interface__")
    if device.size < len(state):
        raise InvalidArgumentError(f"device_state holds {device.size} bytes, the state {len(state)}")
    return device


def decode_chunks(
    chunks: Sequence[Buffer],
    stats: Stats,
    state: bytearray,
    *,
    threads: int | None = None,
    device_state: DeviceBuffer | Any = None,
) -> None:
    """Decodes several chunks of one statistics object into their places in `state`, as
    `decode_chunk` does each, but tensor by tensor across them: a tensor's decode tables are read
    into cache once for all the chunks (one by one, they are read again for every chunk). Every chunk
    is checked before any is written.

    With `device_state`, as `decode_chunk`'s, the chunks decode on the GPU in one upload and one
    kernel launch (a short chunk alone leaves most of the GPU idle); chunks may not share positions."""
    views = [_view(c) for c in chunks]
    pointers = ffi.new("void *[]", [ffi.cast("void *", v) for v in views])  # views kept alive above
    sizes = ffi.new("size_t[]", [len(v) for v in views])
    if device_state is not None:
        device = _device_state(device_state, state)
        host = _view(state)
        n = len(views)
        check(
            lib.lcg_decode_chunks_device(
                pointers, sizes, n, stats._handle, host, len(host), device.ptr, device.stream
            )
        )
        return
    dst = _writable(state, "decode_chunks")
    check(lib.lcg_decode_chunks(pointers, sizes, len(views), stats._handle, _threads(threads), dst, len(dst)))


def splice(state: Buffer, src: Buffer, begin: int, end: int) -> None:
    """Copies the K/V rows of positions [begin, end) of llama.cpp state `src` into `state`."""
    s, dst = _view(src), _writable(state, "splice")
    check(lib.lcg_splice(dst, len(dst), s, len(s), begin, end))


def version() -> tuple[int, int]:
    """(library version number, container format version) of the loaded native library."""
    return int(lib.lcg_version_number()), int(lib.lcg_format_version())
