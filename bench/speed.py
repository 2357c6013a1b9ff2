"""Codec throughput on one f16 state, and time and size against context length."""

from __future__ import annotations

import os

# numpy's OpenBLAS threads spin for a while after they start and took a core from 2-thread runs on a
# 2-core machine; nothing here uses BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

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
            dst = bytearray(len(state))  # reused: the loader's fast path (a fresh buffer adds page faults)
            dec = median_time(
                lambda t=threads, b=blob, d=dst: llama_cachegen.codec.decode_into(b, d, threads=t), cfg.reps
            )
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


# Decoder paths, chosen when the library loads (environment): AVX2 with the gather instruction (the
# default), AVX2 with scalar table loads, and the scalar reference.
PATHS = {
    "avx2 gather": {"LCG_GATHER": "1"},
    "avx2 scalar loads": {"LCG_SCALAR_LOADS": "1"},
    "scalar": {"LCG_NO_SIMD": "1"},
}
_PATH_SCRIPT = """
import statistics, sys, time, llama_cachegen as l
state = open(sys.argv[1], 'rb').read()
for level in sys.argv[3:]:
    blob = l.encode(state, level, threads=1)
    dst = bytearray(len(state))
    times = []
    for _ in range(int(sys.argv[2])):
        t = time.perf_counter()
        l.codec.decode_into(blob, dst, threads=1)
        times.append(time.perf_counter() - t)
    print(level, len(blob), statistics.median(times))
"""


def decode_paths(cfg: Config, state: bytes) -> list[SpeedRow]:
    """Single-thread decode time of every level on each decoder path (one subprocess per path)."""
    import os
    import subprocess
    import sys
    import tempfile

    rows = []
    with tempfile.NamedTemporaryFile(suffix=".state") as f:
        f.write(state)
        f.flush()
        for path, env in PATHS.items():
            log(f"speed: decoder path {path}")
            out = subprocess.run(
                [sys.executable, "-c", _PATH_SCRIPT, f.name, str(max(cfg.reps, 3)), *LEVELS],
                env=os.environ | env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            for line in out.splitlines():
                level, size, seconds = line.split()
                rows.append(SpeedRow(f"{level} ({path})", 1, len(state), int(size), None, float(seconds)))
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


def main() -> int:
    """The codec speed table alone: `python bench/speed.py [--tokens 2048] [--model M.gguf]` (the
    full bench, bench/run.py, prints the same table in its report)."""
    import argparse
    from pathlib import Path

    from llama_cachegen import quality
    from llama_cachegen.model import default_model_path, sample_text
    from report import table

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()
    cfg = Config.make(False, args.model or default_model_path(), Path("."))
    llm = quality.make_llama(cfg.model, n_ctx=args.tokens + 8, logits_all=False)
    tokens = llm.tokenize(sample_text(cfg.texts[0]).encode(), add_bos=True)[: args.tokens]
    state = quality.state_of(llm, tokens)
    del llm
    rows = codec_speed(cfg, state) + decode_paths(cfg, state)
    print(f"f16 state of {args.tokens} tokens ({cfg.texts[0]}), {len(state) / 1e6:.1f} MB")
    print(
        table(
            ["method", "threads", "ratio", "encode MB/s", "decode MB/s"],
            [(s.method, s.threads, s.state_bytes / s.size, s.encode_mbps, s.decode_mbps) for s in rows],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
