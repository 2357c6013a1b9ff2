"""Where a llama.cpp cache type's KL comes from, and what the levels are measured against.

    python bench/reference_error.py [--model M.gguf] [--tokens 2048] [--cont 256] [--texts a,b]

A level promises at most the KL of a llama.cpp cache type (q8_0, q5_1, q4_0) and sets each
tensor's step so that its squared error is a multiple (`error_scale`) of that type's on the same
tensor. The promise is checked (`llama-cachegen eval`) against the real cache: llama.cpp prefills
and continues through it, so its error also lands on every token it computes after the prefix and
compounds through the layers. A level only perturbs the stored prefix. This script separates the
two for each type, teacher-forced KL over the continuation against the untouched f16 state:

- "prefix only": the f16 state with the type's error put on it here (llama.cpp's Hadamard
  rotation of quantized K/V rows, its 32-value blocks and f16 scales, in numpy, as the encoder
  measures the reference), loaded and continued in f16, flash attention off like the levels;
- "real cache": a context with that cache type and flash attention (which llama.cpp needs for a
  quantized V), against an f16 context with flash attention;
- the level at error_scale 1, i.e. the type's own squared error on every tensor, and the level.

The ratio real / prefix-only is the slack a level at error_scale > 1 spends; where it is near 1
(attention that copies from the prefix), only error_scale <= 1 keeps the promise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import llama_cachegen as lcg
import numpy as np
from common import CACHE_TYPES, BenchError, Config, scored_context
from kvstate import f16_kv, read_layout
from llama_cachegen import quality
from llama_cachegen.model import default_model_path, sample_text

LEVEL_OF = {"q8_0": "high", "q5_1": "balanced", "q4_0": "compact"}


def hadamard(x: np.ndarray, n: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard transform of each row's blocks of n values (its own inverse)."""
    rows, width = x.shape
    y = x.reshape(rows, width // n, n).copy()
    h = 1
    while h < n:
        y = y.reshape(rows, width // n, n // (2 * h), 2, h)
        a, b = y[:, :, :, 0, :].copy(), y[:, :, :, 1, :].copy()
        y[:, :, :, 0, :], y[:, :, :, 1, :] = a + b, a - b
        h *= 2
    return (y / np.sqrt(n)).reshape(rows, width)


def f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float64)


def block_round_trip(x: np.ndarray, cache_type: str) -> np.ndarray:
    """x through ggml's reference quantizer of `cache_type` (blocks of 32) and back."""
    b = x.reshape(-1, 32)
    with np.errstate(divide="ignore", invalid="ignore"):
        if cache_type == "q8_0":
            d = np.abs(b).max(1, keepdims=True) / 127
            q = np.round(np.nan_to_num(b / d))
            return (q * f16(d)).reshape(x.shape)
        if cache_type == "q5_1":
            lo, hi = b.min(1, keepdims=True), b.max(1, keepdims=True)
            d = (hi - lo) / 31
            q = np.minimum(31, np.floor(np.nan_to_num((b - lo) / d) + 0.5))
            return (q * f16(d) + f16(lo)).reshape(x.shape)
        peak = b[np.arange(len(b)), np.abs(b).argmax(1)][:, None]  # q4_0: signed largest magnitude
        d = peak / -8
        q = np.minimum(15, np.trunc(np.nan_to_num(b / d) + 8.5))
        return ((q - 8) * f16(d)).reshape(x.shape)


def with_cache_type_error(state: bytes, cache_type: str) -> bytes:
    """The state with each K/V tensor's rows rotated (K: blocks of up to 256 that divide the row,
    V: 64), quantized to `cache_type` and back, as llama.cpp stores a quantized cache; rows whose
    width is no multiple of 64 are not rotated. One KV cache (read_layout refuses a sliding-window
    model's two)."""
    n_k = len(read_layout(state).tensors) // 2  # K of each layer, then V
    kv = f16_kv(state)
    for i, tensor in enumerate(kv.tensors):
        x = tensor.astype(np.float64)
        width, is_v = x.shape[1], i >= n_k
        rot = 64 if width % 64 == 0 else 0
        while rot and not is_v and rot < 256 and width % (2 * rot) == 0:
            rot *= 2
        y = hadamard(x, rot) if rot else x
        y = block_round_trip(y, cache_type)
        tensor[...] = (hadamard(y, rot) if rot else y).astype(np.float16)
    return bytes(kv.raw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--cont", type=int, default=256)
    ap.add_argument(
        "--texts", default=None, help="bundled texts or files, comma-separated (default: the three)"
    )
    args = ap.parse_args()
    model = args.model or default_model_path()
    texts = args.texts.split(",") if args.texts else Config.make(False, model, Path(".")).texts
    n_ctx = args.tokens + args.cont + 8
    llm = quality.make_llama(model, n_ctx=n_ctx)
    fa = quality.make_llama(model, n_ctx=n_ctx, flash_attn=True)
    print(f"{model.name}, {args.tokens} tokens, KL over {args.cont} teacher-forced tokens\n")
    print(
        "| text | type | prefix only | real cache | real / prefix only | level, scale 1 | level | its ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for text in texts:
        body = Path(text).read_text() if Path(text).is_file() else sample_text(text)
        try:
            prefix, cont, state, ref = scored_context(llm, text, body, args.tokens, args.cont)
        except BenchError as exc:
            print(exc, file=sys.stderr)
            return 1
        fa_ref = quality.continuation_logits(fa, None, prefix, cont)

        def kl(
            restored: bytes, ref: np.ndarray = ref, prefix: list[int] = prefix, cont: list[int] = cont
        ) -> float:
            return quality.compare_logits(
                ref, quality.continuation_logits(llm, restored, prefix, cont), cont
            )["kl"]

        for cache_type in CACHE_TYPES:
            quantized = quality.make_llama(
                model, n_ctx=n_ctx, flash_attn=True, type_k=cache_type, type_v=cache_type
            )
            real = quality.compare_logits(
                fa_ref, quality.continuation_logits(quantized, None, prefix, cont), cont
            )
            quantized.close()
            sim = kl(with_cache_type_error(state, cache_type))
            level = LEVEL_OF[cache_type]
            at_one = kl(bytes(lcg.decode(lcg.encode(state, level, error_scale=1.0))))
            blob = lcg.encode(state, level)
            print(
                f"| {text} | {cache_type} | {sim:.4f} | {real['kl']:.4f} | {real['kl'] / sim:.1f} | "
                f"{at_one:.4f} | {level} {kl(bytes(lcg.decode(blob))):.4f} | {len(state) / len(blob):.2f}x |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
