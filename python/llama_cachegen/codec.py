"""encode / decode / inspect: thin wrappers over the native codec."""

from __future__ import annotations

from typing import Any

from ._native import check, ffi, lib
from .errors import InvalidArgumentError

Buffer = bytes | bytearray | memoryview | Any  # anything exposing the buffer protocol

LEVELS: dict[str, int] = {"lossless": 0, "high": 1, "balanced": 2, "compact": 3}
LEVEL_NAMES: dict[int, str] = {v: k for k, v in LEVELS.items()}
KINDS: dict[str, int] = {"auto": 0, "seq_buffer": 1, "full_buffer": 2, "seq_file": 3, "session": 4}
KIND_NAMES: dict[int, str] = {v: k for k, v in KINDS.items()}
SECTION_NAMES: dict[int, str] = {1: "layout", 2: "verbatim", 3: "tensor", 4: "user_meta"}


def _level(level: str | int) -> int:
    if isinstance(level, str):
        if level not in LEVELS:
            raise InvalidArgumentError(f"unknown level {level!r}; expected one of {', '.join(LEVELS)}")
        return LEVELS[level]
    if level not in LEVEL_NAMES:
        raise InvalidArgumentError(f"unknown level {level!r}; expected 0..{len(LEVELS) - 1}")
    return int(level)


def _kind(kind: str) -> int:
    if kind not in KINDS:
        raise InvalidArgumentError(f"unknown state kind {kind!r}; expected one of {', '.join(KINDS)}")
    return KINDS[kind]


def _threads(threads: int | None) -> int:
    return 0 if threads is None else int(threads)


def _view(data: Buffer) -> Any:
    if isinstance(data, ffi.CData):  # already a view (internal reuse)
        return data
    try:
        return ffi.from_buffer(data)
    except TypeError as exc:
        raise InvalidArgumentError(f"expected a bytes-like object, got {type(data).__name__}") from exc


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
    user_meta: Buffer = b"",
) -> bytes:
    """Compresses a llama.cpp state (any supported kind) into a llama-cachegen container.

    `k_step`, `v_step` (in channel standard deviations), `first_layer_scale` and `sink_tokens`
    override the level's preset; `user_meta` is stored verbatim (checksummed) in the container.
    """
    params = ffi.new("lcg_encode_params *", lib.lcg_encode_default_params())
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
    meta = _view(user_meta)
    params.user_meta = meta
    params.user_meta_size = len(meta)
    src = _view(state)
    out = ffi.new("void **")
    out_size = ffi.new("size_t *")
    check(lib.lcg_encode(src, len(src), params, out, out_size))
    try:
        return bytes(ffi.buffer(out[0], out_size[0]))
    finally:
        lib.lcg_free(out[0])


def decoded_size(blob: Buffer) -> int:
    """Size in bytes of the state that `blob` decodes to (from its checked header)."""
    src = _view(blob)
    size = ffi.new("size_t *")
    check(lib.lcg_decoded_size(src, len(src), size))
    return int(size[0])


def decode(blob: Buffer, *, threads: int | None = None) -> bytearray:
    """Decompresses a container back into llama.cpp state bytes; verifies every checksum.

    Returns a bytearray (no extra copy; writable, so ctypes can wrap it without copying too).
    """
    src = _view(blob)
    size = decoded_size(src)
    dst = bytearray(size)
    written = ffi.new("size_t *")
    check(lib.lcg_decode(src, len(src), _threads(threads), ffi.from_buffer(dst), size, written))
    return dst


def _info_dict(info: Any) -> dict[str, Any]:
    return {
        "format_version": info.format_version,
        "level": LEVEL_NAMES.get(info.level, str(info.level)),
        "kind": KIND_NAMES.get(info.state_kind, str(info.state_kind)),
        "tensors": info.n_tensors,
        "cells": info.n_cells,
        "layers": info.n_layers,
        "tokens": info.n_tokens,
        "state_size": info.state_size,
        "kv_bytes": info.kv_bytes,
    }


def inspect(blob: Buffer) -> dict[str, Any]:
    """Describes a container: kind, layout, level and knobs, sizes per section, ratio."""
    src = _view(blob)
    info = ffi.new("lcg_info *")
    check(lib.lcg_inspect(src, len(src), info))
    result = _info_dict(info)
    result.update(
        container_size=info.container_size,
        ratio=info.state_size / info.container_size if info.container_size else 0.0,
        k_step=info.k_step,
        v_step=info.v_step,
        first_layer_scale=info.first_layer_scale,
        sink_tokens=info.n_sink_tokens,
    )
    sizes: dict[str, int] = {}
    section = ffi.new("lcg_section *")
    for index in range(info.n_sections):
        check(lib.lcg_inspect_section(src, len(src), index, section))
        name = SECTION_NAMES.get(section.type, f"type{section.type}")
        sizes[name] = sizes.get(name, 0) + section.size
    result["sections"] = sizes
    return result


def inspect_state(state: Buffer, kind: str = "auto") -> dict[str, Any]:
    """Parses a llama.cpp state without encoding it; raises UnsupportedFormatError if unreadable."""
    src = _view(state)
    info = ffi.new("lcg_info *")
    check(lib.lcg_inspect_state(src, len(src), _kind(kind), info))
    return _info_dict(info)


def user_meta(blob: Buffer) -> bytes:
    """The opaque bytes stored with `encode(..., user_meta=...)` (b"" when none), checksum verified."""
    src = _view(blob)
    ptr = ffi.new("void **")
    size = ffi.new("size_t *")
    check(lib.lcg_user_meta(src, len(src), ffi.cast("const void **", ptr), size))
    return bytes(ffi.buffer(ptr[0], size[0])) if size[0] else b""


def version() -> tuple[int, int]:
    """(library version number, container format version) of the loaded native library."""
    return int(lib.lcg_version_number()), int(lib.lcg_format_version())
