"""Codec throughput on one f16 state, and time and size against context length."""

from __future__ import annotations

from dataclasses import dataclass

import llama_cachegen
import numpy as np
from baselines import lz4_compress, lz4_decompress, zstd_compress, zstd_decompress
from common import LEVELS, Config, log, median_time, require
from kvstate import truncate_seq_state


@dataclass
class SpeedRow:
    method: str
    threads: int | None  # None: the method has no thread setting
    state_bytes: int
    size: int
    encode_s: float | None  # None: not measured (memcpy has no encode side)
    decode_s: float

    @property
    def encode_mbps(self) -> float | None:
        return None if self.encode_s is None else self.state_bytes / self.encode_s / 1e6

    @property
    def decode_mbps(self) -> float:
        return self.state_bytes / self.decode_s / 1e6


def codec_speed(cfg: Config, state: bytes) -> list[SpeedRow]:
    """Encode/decode times (median of cfg.reps) of every level and of the generic baselines."""
    rows = []
    for level in LEVELS:
        for threads in cfg.codec_threads:
            log(f"speed: {level}, {threads} thread(s)")
            blob = llama_cachegen.encode(state, level, threads=threads)
            enc = median_time(
                lambda lv=level, t=threads: llama_cachegen.encode(state, lv, threads=t), cfg.reps
            )
            dec = median_time(lambda t=threads, b=blob: llama_cachegen.decode(b, threads=t), cfg.reps)
            rows.append(SpeedRow(level, threads, len(state), len(blob), enc, dec))
    for name, compress, decompress in (
        ("zstd -3", zstd_compress, zstd_decompress),
        ("lz4", lz4_compress, lz4_decompress),
    ):
        log(f"speed: {name}")
        blob = compress(state)
        enc = median_time(lambda c=compress: c(state), cfg.reps)
        dec = median_time(lambda d=decompress, b=blob: d(b), cfg.reps)
        rows.append(SpeedRow(name, None, len(state), len(blob), enc, dec))
    src = np.frombuffer(state, dtype=np.uint8)
    dst = np.empty_like(src)  # preallocated, so that this times the copy and not the allocation
    rows.append(
        SpeedRow(
            "memcpy (ceiling)",
            None,
            len(state),
            len(state),
            None,
            median_time(lambda: np.copyto(dst, src), cfg.reps),
        )
    )
    return rows


@dataclass
class ScalingRow:
    n_tokens: int
    state_bytes: int
    size: int
    encode_s: float
    decode_s: float


SCALING_LEVEL = "balanced"


def scaling(cfg: Config, longest_state: bytes) -> list[ScalingRow]:
    """Encode/decode time and size at SCALING_LEVEL for prefixes of one long prefill."""
    threads = max(cfg.codec_threads)
    rows = []
    for n in cfg.scaling_lengths:
        log(f"scaling: {n} tokens")
        state = truncate_seq_state(longest_state, n)
        blob = llama_cachegen.encode(state, SCALING_LEVEL, threads=threads)
        require(
            llama_cachegen.inspect(blob)["cells"] == n, f"container of {n} tokens reports another cell count"
        )
        enc = median_time(lambda s=state: llama_cachegen.encode(s, SCALING_LEVEL, threads=threads), cfg.reps)
        dec = median_time(lambda b=blob: llama_cachegen.decode(b, threads=threads), cfg.reps)
        rows.append(ScalingRow(n, len(state), len(blob), enc, dec))
    return rows


def loglog_slope(xs: list[float], ys: list[float]) -> float:
    """Exponent b of the fit y = a * x^b: 1 means linear."""
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])
