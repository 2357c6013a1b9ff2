"""Time to first token against link bandwidth: recompute vs fetching the state, raw or compressed.

Measured: the prefill, the restore (llama_state_seq_set_data + evaluating one token), and each
level's whole-state decode. Modelled: the transfer (bytes / bandwidth) and the chunked pipeline
(C equal chunks, each taking 1/C of the measured transfer and decode, so the pipeline costs
max(transfer, decode) + min(transfer, decode) / C); bench/streaming.py measures the real one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from common import Config, log, median_time, require
from llama_cachegen import quality

RECOMPUTE = "recompute (prefill)"
RAW = "fetch f16 state"


@dataclass
class Components:
    n_tokens: int
    prefill_s: float  # context + 1 token from an empty cache: the recompute path's first token
    restore_s: float  # set_data of the context's state + 1 token
    raw_bytes: int
    levels: dict[str, tuple[int, float]]  # level -> (container bytes, decode seconds)
    chunks: int


def measure(
    cfg: Config, prefix: list[int], next_token: int, state: bytes, levels: dict[str, tuple[int, float]]
) -> Components:
    n_ctx = len(prefix) + 8
    log(f"ttft: prefill of {len(prefix) + 1} tokens")
    # only the last token's logits, as a server computes them: logits for every token would slow it
    llm = quality.make_llama(cfg.model, n_ctx=n_ctx, n_threads=cfg.threads, logits_all=False)

    def prefill() -> None:
        quality.clear_context(llm)
        llm.eval([*prefix, next_token])

    prefill_s = median_time(prefill, max(2, cfg.reps // 2))  # seconds each: fewer repetitions
    del llm
    log("ttft: restore")
    llm = quality.make_llama(cfg.model, n_ctx=n_ctx, n_threads=cfg.threads)
    restore_s = median_time(lambda: quality.continuation_logits(llm, state, prefix, [next_token]), cfg.reps)
    return Components(len(prefix), prefill_s, restore_s, len(state), levels, cfg.chunks)


def _transfer(size: int, gbps: float) -> float:
    return size * 8 / (gbps * 1e9)


def methods(c: Components) -> dict[str, Callable[[float], float]]:
    """TTFT in seconds as a function of bandwidth in Gbps, per method."""
    out: dict[str, Callable[[float], float]] = {
        RECOMPUTE: lambda gbps: c.prefill_s,
        RAW: lambda gbps: _transfer(c.raw_bytes, gbps) + c.restore_s,
    }
    for level, (size, dec) in c.levels.items():
        out[f"fetch {level}"] = lambda gbps, s=size, d=dec: _transfer(s, gbps) + d + c.restore_s
        out[f"fetch {level}, pipelined"] = lambda gbps, s=size, d=dec: (
            max(_transfer(s, gbps), d) + min(_transfer(s, gbps), d) / c.chunks + c.restore_s
        )
    return out


_GRID = np.logspace(-3, 3, 4001)  # Gbps; break-evens outside it are reported as none


def crossover(f: Callable[[float], float], g: Callable[[float], float]) -> float | None:
    """Lowest bandwidth on _GRID where f - g changes sign (linear interpolation), or None."""
    diff = np.array([f(b) - g(b) for b in _GRID])
    signs = np.sign(diff)
    idx = np.nonzero(signs[:-1] * signs[1:] < 0)[0]
    if not idx.size:
        return None
    i = int(idx[0])
    t = diff[i] / (diff[i] - diff[i + 1])
    return float(np.exp(np.log(_GRID[i]) + t * (np.log(_GRID[i + 1]) - np.log(_GRID[i]))))


def break_evens(c: Components) -> list[tuple[str, float | None, float | None]]:
    """(method, bandwidth above which it beats recompute, bandwidth below which it beats raw f16)."""
    fns = methods(c)
    require(c.prefill_s > 0 and c.restore_s > 0, "non-positive TTFT component")
    return [
        (name, crossover(fn, fns[RECOMPUTE]), None if name == RAW else crossover(fn, fns[RAW]))
        for name, fn in fns.items()
        if name != RECOMPUTE
    ]
