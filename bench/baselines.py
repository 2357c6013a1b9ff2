"""What a llama.cpp user could do instead of llama-cachegen, applied to the same f16 state bytes."""

from __future__ import annotations

import math

import lz4.frame
import numpy as np
import zstandard
from kvstate import f16_kv

ZSTD_LEVEL = 3


def zstd_compress(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)


def zstd_decompress(blob: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(blob)


def lz4_compress(data: bytes) -> bytes:
    return lz4.frame.compress(data)


def lz4_decompress(blob: bytes) -> bytes:
    return lz4.frame.decompress(blob)


def _entropy_bits(codes: np.ndarray, n_symbols: int) -> float:
    """Ideal order-0 entropy of `codes` (cells, channels), one distribution per channel, in bits."""
    n_cells, n_channels = codes.shape
    keys = codes + np.arange(n_channels, dtype=np.int64) * n_symbols
    counts = np.bincount(keys.ravel(), minlength=n_channels * n_symbols).astype(np.float64)
    nonzero = counts[counts > 0]
    # sum over channels of -sum(c * log2(c / n_cells))
    return float(-(nonzero * np.log2(nonzero / n_cells)).sum())


def per_token_quantize(state: bytes, bits: int) -> tuple[bytes, int]:
    """LMCache's CacheGen baseline: each token's K (and V) row of a layer quantized min-max to `bits`.

    Returns the reconstructed state and its size in bytes: the non-KV bytes of the state verbatim,
    an f16 min and step per (tensor, token), and the codes at their ideal order-0 entropy per
    (tensor, channel). The entropy is a lower bound for a real coder and costs no frequency tables,
    so this size flatters the baseline.
    """
    kv = f16_kv(state)
    top = (1 << bits) - 1
    size_bits = 8.0 * (len(state) - 2 * kv.n_elements)
    for tensor in kv.tensors:
        x = tensor.astype(np.float32)
        lo = x.min(axis=1, keepdims=True).astype(np.float16).astype(np.float32)
        step = ((x.max(axis=1, keepdims=True) - lo) / top).astype(np.float16).astype(np.float32)
        step[step == 0] = 1.0
        codes = np.clip(np.rint((x - lo) / step), 0, top).astype(np.int64)
        tensor[...] = (codes * step + lo).astype(np.float16)
        size_bits += _entropy_bits(codes, top + 1) + 32.0 * tensor.shape[0]
    return bytes(kv.raw), math.ceil(size_bits / 8)
