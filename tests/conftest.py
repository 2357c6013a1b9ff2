"""Shared fixtures: the real model, real text, real llama.cpp states, real store servers
(redis-server, `llama-cachegen serve`), and a synthetic state builder for the layouts SmolLM2
cannot produce (cell ext, interleaved SWA, hybrid tails, many streams)."""

from __future__ import annotations

import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from llama_cachegen import quality
from llama_cachegen.llama_format import IO_MAGIC
from llama_cachegen.model import default_model_path, sample_text
from llama_cachegen.server import free_port


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port}")


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not installed (apt-get install redis-server)")
    pytest.importorskip("redis", reason="the redis Python package is not installed")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_port(port, proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """`llama-cachegen serve` on a folder: (its URL, the folder)."""
    root = tmp_path_factory.mktemp("http-store")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cachegen", "serve", "--dir", str(root), "--port", str(port)]
    )
    try:
        wait_port(port, proc)
        yield f"http://127.0.0.1:{port}", root
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def gpl_tokens(model_path: Path) -> list[int]:
    llm = quality.make_llama(model_path, n_ctx=64, logits_all=False)
    return llm.tokenize(sample_text("gpl-3.0.txt").encode(), add_bos=True)


def smollm(n_ctx: int = 512, threads: int = 2, **kwargs: Any) -> Any:
    """A quiet llama_cachegen.Llama on the bundled SmolLM2, llama.cpp on `threads` threads."""
    from llama_cachegen.llama import Llama

    params = dict(n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    return Llama(str(default_model_path()), **(params | kwargs))


def greedy(llm: Any, prompt: str | Sequence[int], max_tokens: int = 8) -> str:
    """The greedy completion of `prompt` (text or token ids)."""
    prompt = prompt if isinstance(prompt, str) else list(prompt)
    return llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0)["choices"][0]["text"]


def chunk_objects(cache: Any) -> dict[str, bytes]:
    """Every chunk object of a CompressedStateCache's store, by key."""
    from llama_cachegen.chunks import PREFIX

    return {i.key: cache.store.get(i.key) for i in cache.store.list(f"{PREFIX}chunks/")}


# A writer that dies in the middle of writing `key` to the file store at argv[1]: argv[3] bytes
# written, the temporary left behind.
DEAD_WRITER = """
import os, sys
from llama_cachegen.stores.file import FileStore
FileStore(sys.argv[1]).begin_write(sys.argv[2]).write(b"x" * int(sys.argv[3]))
os._exit(0)
"""


def multi_seq_llama(model_path: Path, n_seq_max: int, unified: bool, **kwargs: Any) -> Any:
    """A context with several sequences: one shared stream (unified) or one stream per sequence."""
    from llama_cpp import _internals

    llm = quality.make_llama(model_path, **kwargs)
    llm.context_params.n_seq_max = n_seq_max
    llm.context_params.kv_unified = unified
    llm._ctx.close()
    llm._ctx = _internals.LlamaContext(model=llm._model, params=llm.context_params, verbose=False)
    return llm


def copy_seq(llm: Any, src: int, dst: int) -> None:
    import llama_cpp

    llama_cpp.llama_memory_seq_cp(llama_cpp.llama_get_memory(llm._ctx.ctx), src, dst, -1, -1)


# ---- synthetic llama.cpp states (docs/llama-state.md) -----------------------------------------


def kv_cache_bytes(
    rng: np.random.Generator,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    cells_per_stream: Sequence[int] = (8,),
    v_trans: bool = False,
    ext: bool = False,
    with_v: bool = True,
    dtype: str = "f16",
    seqs_per_cell: int = 1,
) -> bytes:
    """One llama_kv_cache::state_write section with random K/V values (q8_0: quantized as ggml's
    reference quantizer does, 34-byte blocks of 32 values; n_embd a multiple of 32, V not
    transposed)."""
    type_id, np_type = {"f16": (1, np.float16), "f32": (0, np.float32), "q8_0": (8, np.float32)}[dtype]
    assert dtype != "q8_0" or not v_trans, "llama.cpp never transposes a quantized V"

    def rows(values: np.ndarray) -> bytes:  # a K (or untransposed V) tensor: its type, row size and rows
        data = q8_0_blocks(values) if dtype == "q8_0" else values.astype(np_type)
        return struct.pack("<iQ", type_id, data.shape[1] * data.itemsize) + data.tobytes()

    out = bytearray(struct.pack("<I", len(cells_per_stream)))
    for n_cells in cells_per_stream:
        out += struct.pack("<I", n_cells)
        if n_cells == 0:
            continue
        for pos in range(n_cells):
            out += struct.pack("<iI", pos, seqs_per_cell)
            if ext:
                out += struct.pack("<iii", pos, 0, pos + 7)
            out += b"".join(struct.pack("<i", s) for s in range(seqs_per_cell))
        out += struct.pack("<II", int(v_trans), n_layer)
        for _ in range(n_layer):
            out += rows(rng.normal(0, 1, (n_cells, n_embd)))
        if with_v:
            for _ in range(n_layer):
                v = rng.normal(0, 0.5, (n_cells, n_embd))
                if v_trans:
                    item = np.dtype(np_type).itemsize
                    out += struct.pack("<iII", type_id, item, n_embd) + v.T.astype(np_type).tobytes()
                else:
                    out += rows(v)
    return bytes(out)


def q8_0_blocks(values: np.ndarray) -> np.ndarray:
    """Rows of float values (width a multiple of 32) as q8_0 blocks, uint8 (rows, width / 32 * 34):
    quantize_row_q8_0_ref (d = max|x| / 127 stored as f16, q = round(x / d), halves away from 0)."""
    x = values.astype(np.float32).reshape(len(values), -1, 32)
    d = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    r = x * inv
    t = np.trunc(r)
    q = (t + np.sign(r) * (np.abs(r - t) >= 0.5)).astype(np.int8)  # roundf: r - t is exact
    blocks = np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=-1)
    return blocks.reshape(len(values), -1)


def q8_0_values(blocks: np.ndarray) -> np.ndarray:
    """q8_0 blocks (rows, n * 34) back to their float32 values (rows, n * 32)."""
    b = blocks.reshape(len(blocks), -1, 34)
    d = b[..., :2].copy().view(np.float16).astype(np.float32)
    return (d * b[..., 2:].view(np.int8).astype(np.float32)).reshape(len(blocks), -1)


def seq_buffer(memory: bytes, seq_id: int = 0) -> bytes:
    return struct.pack("<Ii", IO_MAGIC, seq_id) + memory


def full_buffer(memory: bytes, arch: str = "llama") -> bytes:
    return struct.pack("<I", len(arch)) + arch.encode() + memory


def seq_file(memory: bytes, tokens: Sequence[int], version: int = 3) -> bytes:
    head = struct.pack("<III", 0x67677371, version, len(tokens))
    return head + struct.pack(f"<{len(tokens)}i", *tokens) + memory


def session_file(memory: bytes, tokens: Sequence[int], arch: str = "llama", version: int = 10) -> bytes:
    head = struct.pack("<III", 0x6767736E, version, len(tokens))
    return head + struct.pack(f"<{len(tokens)}i", *tokens) + full_buffer(memory, arch)
