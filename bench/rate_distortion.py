"""Size vs quality of every method on the same states, texts and continuations."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import llama_cachegen
import llama_cpp
import numpy as np
from baselines import lz4_compress, lz4_decompress, per_token_quantize, zstd_compress, zstd_decompress
from common import CACHE_TYPES, LEVELS, Config, log, require
from kvstate import f16_kv, truncate_seq_state
from llama_cachegen import quality

# curve names of the plot; a point's method names the curve's member
LEVEL_CURVE = "llama-cachegen levels"
SWEEP_CURVE = "llama-cachegen step sweep"
CACHE_TYPE_CURVE = "llama.cpp cache type"
PER_TOKEN_CURVE = "per-token min-max (LMCache CacheGen), ideal entropy"
ZSTD_CURVE = "zstd -3 on the f16 state"
LZ4_CURVE = "lz4 on the f16 state"
F16_CURVE = "f16 state"
NOISE_CURVE = "flash attention on vs off (noise floor)"


@dataclass
class Point:
    text: str
    n_tokens: int
    curve: str
    method: str
    size: int  # bytes, everything included
    bits_per_element: float
    ratio: float  # f16 state size / size
    kl: float
    top1: float
    dppl: float


@dataclass
class Case:
    text: str
    prefix: list[int]
    cont: list[int]

    @property
    def key(self) -> tuple[str, int]:
        return self.text, len(self.prefix)


def _quality(llm: llama_cpp.Llama, case: Case, ref: np.ndarray, state: bytes) -> dict[str, float]:
    logits = quality.continuation_logits(llm, state, case.prefix, case.cont)
    return quality.compare_logits(ref.astype(np.float64), logits, case.cont)


class _States:
    """One prefill of the longest context per text; shorter contexts are its truncations."""

    def __init__(self, cfg: Config, tokens: dict[str, list[int]]) -> None:
        self.longest = max(cfg.lengths)
        for text in cfg.texts:
            have = len(tokens[text])
            require(
                have >= self.longest + cfg.cont_len, f"{text}: {have} tokens, too short for the longest case"
            )
        self.cfg, self.tokens = cfg, tokens
        self.n_ctx = self.longest + cfg.cont_len + 8

    def cases(self, llm: llama_cpp.Llama, label: str) -> Iterator[tuple[Case, bytes]]:
        for text in self.cfg.texts:
            log(f"rate-distortion: {text}, {label}")
            full = quality.state_of(llm, self.tokens[text][: self.longest])
            for n in self.cfg.lengths:
                case = Case(text, self.tokens[text][:n], self.tokens[text][n : n + self.cfg.cont_len])
                yield case, (full if n == self.longest else truncate_seq_state(full, n))


def run(cfg: Config, tokens: dict[str, list[int]]) -> tuple[list[Point], dict[tuple[str, int], bytes]]:
    """Returns every point and the f16 (flash attention off) states, keyed by (text, tokens)."""
    source = _States(cfg, tokens)
    points: list[Point] = []
    states: dict[tuple[str, int], bytes] = {}
    elements: dict[tuple[str, int], int] = {}

    def add(case: Case, curve: str, method: str, size: int, q: dict[str, float]) -> None:
        key = case.key
        points.append(
            Point(
                *key,
                curve,
                method,
                size,
                8 * size / elements[key],
                len(states[key]) / size,
                q["kl"],
                q["top1"],
                q["dppl"],
            )
        )

    refs: dict[tuple[str, int], np.ndarray] = {}
    llm = quality.make_llama(cfg.model, n_ctx=source.n_ctx, n_threads=cfg.threads)
    for case, state in source.cases(llm, "f16 cache, llama-cachegen and baselines on its state"):
        states[case.key] = state
        elements[case.key] = f16_kv(state).n_elements
        # float32 holds llama.cpp's logits exactly, in half the memory of the float64 copy
        ref = refs[case.key] = quality.continuation_logits(llm, state, case.prefix, case.cont).astype(
            np.float32
        )
        # reloading the untouched state must reproduce the reference exactly: checks the measurement
        f16 = _quality(llm, case, ref, state)
        require(f16["kl"] == 0.0, f"reloading the f16 state changed the logits (KL {f16['kl']})")
        add(case, F16_CURVE, "f16", len(state), f16)
        for level in LEVELS:
            blob = llama_cachegen.encode(state, level)
            restored = llama_cachegen.decode(blob)
            require(level != "lossless" or restored == state, "level lossless did not round-trip exactly")
            add(case, LEVEL_CURVE, level, len(blob), _quality(llm, case, ref, restored))
        for step in cfg.steps:
            blob = llama_cachegen.encode(state, "balanced", k_step=step, v_step=step)
            q = _quality(llm, case, ref, llama_cachegen.decode(blob))
            add(case, SWEEP_CURVE, f"balanced, k_step=v_step={step:g}", len(blob), q)
        for bits in (8, 4):
            restored, size = per_token_quantize(state, bits)
            add(case, PER_TOKEN_CURVE, f"{bits}-bit", size, _quality(llm, case, ref, restored))
        for curve, compress, decompress in (
            (ZSTD_CURVE, zstd_compress, zstd_decompress),
            (LZ4_CURVE, lz4_compress, lz4_decompress),
        ):
            blob = compress(state)
            require(decompress(blob) == state, f"{curve} did not round-trip")
            add(case, curve, curve.split()[0], len(blob), f16)  # byte-identical: the f16 reload's quality
    del llm

    # llama.cpp quantizes V only with flash attention on, so the cache types are compared with an f16
    # cache computed the same way; that cache against the flash-attention-off one is the noise floor
    fa_refs: dict[tuple[str, int], np.ndarray] = {}
    llm = quality.make_llama(cfg.model, n_ctx=source.n_ctx, n_threads=cfg.threads, flash_attn=True)
    for case, state in source.cases(llm, "f16 cache with flash attention"):
        fa_refs[case.key] = quality.continuation_logits(llm, state, case.prefix, case.cont).astype(np.float32)
        q = quality.compare_logits(
            refs[case.key].astype(np.float64), fa_refs[case.key].astype(np.float64), case.cont
        )
        add(case, NOISE_CURVE, "f16, flash attention", len(state), q)
    del llm
    for name in CACHE_TYPES:
        ggml_type = getattr(llama_cpp, f"GGML_TYPE_{name.upper()}")
        llm = quality.make_llama(
            cfg.model,
            n_ctx=source.n_ctx,
            n_threads=cfg.threads,
            flash_attn=True,
            type_k=ggml_type,
            type_v=ggml_type,
        )
        for case, state in source.cases(llm, f"cache type {name}"):
            add(case, CACHE_TYPE_CURVE, name, len(state), _quality(llm, case, fa_refs[case.key], state))
        del llm
    return points, states


def mean_by(points: list[Point], n_tokens: int, select: Callable[[Point], bool]) -> dict[str, float]:
    """Mean over texts of size and quality of the points at `n_tokens` that `select` keeps."""
    chosen = [p for p in points if p.n_tokens == n_tokens and select(p)]
    require(bool(chosen), f"no rate-distortion point at {n_tokens} tokens")
    return {
        name: float(np.mean([getattr(p, name) for p in chosen]))
        for name in ("size", "bits_per_element", "ratio", "kl", "top1", "dppl")
    }
