"""Reads and slices the KV tensors inside a llama.cpp sequence state buffer, with numpy.

Only what the bench needs: one non-empty stream per KV cache, without cell extension (layout in
docs/llama-state.md); `f16_kv` reads every cache of a state (two for sliding-window models). The
library has its own parser; this one exists so that the baselines do not depend on the code they
are compared with (it shares llama.cpp's constants only).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from llama_cachegen.llama_format import GGML_TYPES, IO_MAGIC


@dataclass
class Tensor:
    """One layer's K or V: `header` bytes, then `data` at `offset` in the state."""

    header: bytes
    ggml_type: int
    offset: int
    size: int
    row_bytes: int  # bytes per cell (per channel run of cells when transposed)
    transposed: bool  # V stored as n_embd runs of cell_count elements


@dataclass
class Layout:
    head: bytes  # io_magic, seq_id, n_stream and the cell counts of the streams before the used one
    n_cells: int
    cells: list[bytes]  # per-cell metadata records
    v_trans: bool
    tensors: list[Tensor]  # K of every layer, then V of every layer


def _read(state: bytes, pos: int, fmt: str) -> tuple[tuple[int, ...], int]:
    size = struct.calcsize("<" + fmt)
    if pos + size > len(state):
        raise ValueError("truncated state")
    return struct.unpack_from("<" + fmt, state, pos), pos + size


def _read_cache(state: bytes, pos: int) -> tuple[Layout, int]:
    """One KV cache's part of a state from `pos` (its stream count on): its layout and where it ends."""
    head_start = pos
    (n_stream,), pos = _read(state, pos, "I")
    n_cells = 0
    for _ in range(n_stream):  # streams of other sequences are empty
        head_end = pos
        (n_cells,), pos = _read(state, pos, "I")
        if n_cells:
            break
    if not n_cells:
        raise ValueError("the state holds no cells")
    cells = []
    for _ in range(n_cells):
        start = pos
        (_pos, n_seq), pos = _read(state, pos, "iI")
        pos += 4 * n_seq
        cells.append(state[start:pos])
    (v_trans, n_layer), pos = _read(state, pos, "II")
    tensors = []
    for index in range(2 * n_layer):
        start = pos
        if v_trans and index >= n_layer:
            (ggml_type, elem_bytes, n_embd), pos = _read(state, pos, "iII")
            row_bytes, size = n_cells * elem_bytes, n_cells * elem_bytes * n_embd
        else:
            (ggml_type, row_bytes), pos = _read(state, pos, "iQ")
            size = n_cells * row_bytes
        transposed = bool(v_trans) and index >= n_layer
        tensors.append(Tensor(state[start:pos], ggml_type, pos, size, row_bytes, transposed))
        pos += size
    if pos > len(state):
        raise ValueError("truncated state")
    return Layout(state[head_start:head_end], n_cells, cells, bool(v_trans), tensors), pos


def _check_magic(state: bytes) -> int:
    (magic, _seq_id), pos = _read(state, 0, "Ii")
    if magic != IO_MAGIC:
        raise ValueError(f"not a sequence state buffer (magic {magic:#x})")
    return pos


def read_layout(state: bytes) -> Layout:
    """Parses a `llama_state_seq_get_data` buffer of one KV cache; raises ValueError on anything it
    does not support. `head` includes the magic and sequence id."""
    layout, pos = _read_cache(state, _check_magic(state))
    if pos != len(state):
        raise ValueError(
            f"{len(state) - pos} bytes left after the KV cache (not a plain single-stream cache)"
        )
    return Layout(state[:8] + layout.head, layout.n_cells, layout.cells, layout.v_trans, layout.tensors)


@dataclass
class F16KV:
    """A writable copy of an f16 state; `tensors[i]` is a (cells, n_embd) float16 view into `raw`."""

    raw: bytearray
    tensors: list[np.ndarray]

    @property
    def n_elements(self) -> int:
        return sum(t.size for t in self.tensors)


def f16_kv(state: bytes) -> F16KV:
    """The f16 K/V tensors of every KV cache in the state (a model with sliding-window layers has
    two, one after the other), each cache's K of every layer, then V."""
    raw = bytearray(state)
    tensors = []
    pos = _check_magic(state)
    while pos < len(state):
        layout, pos = _read_cache(state, pos)
        for t in layout.tensors:
            if t.ggml_type != GGML_TYPES["f16"]:
                raise ValueError(f"tensor of ggml type {t.ggml_type}; only f16 is supported here")
            data = np.frombuffer(raw, dtype=np.float16, count=t.size // 2, offset=t.offset)
            width = t.size // 2 // layout.n_cells
            tensors.append(data.reshape(width, layout.n_cells).T if t.transposed else data.reshape(-1, width))
    return F16KV(raw, tensors)


def truncate_seq_state(state: bytes, n_cells: int) -> bytes:
    """The state of the first `n_cells` cells, by slicing: with causal attention these are exactly the
    K/V a prefill of only the first `n_cells` tokens computes. Any cache type."""
    layout = read_layout(state)
    if not 0 < n_cells <= layout.n_cells:
        raise ValueError(f"cannot keep {n_cells} of {layout.n_cells} cells")
    out = bytearray(layout.head)
    out += struct.pack("<I", n_cells)
    out += b"".join(layout.cells[:n_cells])
    out += struct.pack("<II", int(layout.v_trans), len(layout.tensors) // 2)
    for t in layout.tensors:
        out += t.header
        if t.transposed:
            elem = t.row_bytes // layout.n_cells
            runs = np.frombuffer(state, np.uint8, t.size, t.offset).reshape(-1, t.row_bytes)
            out += runs[:, : n_cells * elem].tobytes()
        else:
            out += state[t.offset : t.offset + n_cells * t.row_bytes]
    return bytes(out)
