"""Configuration, timing and failure helpers shared by the bench sections."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LEVELS = ("lossless", "high", "balanced", "compact")
CACHE_TYPES = ("q8_0", "q5_1", "q4_0")


class BenchError(RuntimeError):
    """A method could not run or produced something wrong; the bench stops instead of omitting it."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise BenchError(message)


@dataclass(frozen=True)
class Config:
    quick: bool
    model: Path
    out: Path
    threads: int  # llama.cpp threads
    texts: tuple[str, ...]
    lengths: tuple[int, ...]  # rate-distortion context lengths (tokens)
    cont_len: int  # teacher-forced continuation scored for quality
    target_len: int  # context length the codec targets are defined at
    steps: tuple[float, ...]  # expert sweep of k_step = v_step at the balanced preset
    codec_threads: tuple[int, ...]
    reps: int  # repetitions per timing; the median is reported
    scaling_lengths: tuple[int, ...]
    bandwidths_gbps: tuple[float, ...]
    chunks: int  # chunk count of the modelled transfer/decode pipeline

    @staticmethod
    def make(quick: bool, model: Path, out: Path) -> Config:
        common: dict[str, Any] = dict(
            model=model,
            out=out,
            threads=2,
            codec_threads=(1, 2),
            bandwidths_gbps=(0.1, 0.5, 1.0, 3.0, 10.0, 25.0),
            chunks=8,
        )
        if quick:
            return Config(
                quick=True,
                texts=("gpl-3.0.txt",),
                lengths=(96,),
                cont_len=32,
                target_len=96,
                steps=(0.2,),
                reps=2,
                scaling_lengths=(64, 128, 256),
                **common,
            )
        return Config(
            quick=False,
            texts=("gpl-3.0.txt", "gfdl-1.3.txt", "difflib.py.txt"),
            lengths=(1024, 2048, 4096),
            cont_len=256,
            target_len=2048,
            steps=(0.05, 0.3, 1.5),
            reps=5,
            scaling_lengths=(512, 1024, 2048, 4096, 8192),
            **common,
        )


def median_time(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of `reps` calls of `fn`, in seconds."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def scored_context(
    llm: Any, name: str, body: str, n_tokens: int, n_cont: int
) -> tuple[list[int], list[int], bytes, Any]:
    """The first n_tokens of `body` (the text `name`), the n_cont after them that quality is scored
    on, the state of the first ones in `llm` and the continuation's logits after it (the reference
    a reconstructed state is compared with). BenchError when the text is too short."""
    from llama_cachegen import quality

    tokens = llm.tokenize(body.encode())
    prefix, cont = tokens[:n_tokens], tokens[n_tokens : n_tokens + n_cont]
    require(len(cont) == n_cont, f"{name}: {len(tokens)} tokens, too short")
    state = quality.state_of(llm, prefix)
    return prefix, cont, state, quality.continuation_logits(llm, state, prefix, cont)
