"""What spreading a level's error over the K/V tensors by their measured sensitivity gains (a
per-model calibration: issue 12). The levels give each tensor a squared error proportional to the
reference cache type's on it; a tensor whose error the logits feel less can take more
(`encode(..., error_weights=)`), one the logits feel more, less.

    python bench/layer_sensitivity.py [--model M.gguf] [--tokens 1024] [--calibrate gpl-3.0.txt]

1. Calibration text, at `--level`: every tensor coded at `--boosts` times the level's error
   (error_scale), and each tensor alone put into the exact state; the KL rise between the two
   boosts over the error added is the tensor's sensitivity s (KL per unit of squared error: the
   difference cancels the model's noise floor).
2. KL ~ sum of s x error and bits ~ -0.5 log2(error) per element give, at equal KL, each tensor an
   error per element in proportion to 1/s: weights (that error over the level's) kept within
   `--max-ratio` either way (where the line was measured) and scaled to the level's predicted KL.
3. Held-out texts, each level: the codec as it is, with the weights, and with the weights at the
   error_scale (by bisection) that gives the level's own KL; sizes are the codec's containers, KL
   teacher-forced over the continuation against the untouched state.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import llama_cachegen as lcg
import numpy as np
from channel_transform import Case, solve
from common import Config, log
from kvstate import f16_kv
from llama_cachegen import quality
from llama_cachegen.model import default_model_path, sample_text


def tensor_errors(state: bytes, decoded: bytes) -> np.ndarray:
    """Squared error per element of each K/V tensor."""
    return np.array(
        [
            float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
            for a, b in zip(f16_kv(state).tensors, f16_kv(decoded).tensors, strict=True)
        ]
    )


def kl_of(case: Case, state: bytes) -> float:
    logits = quality.continuation_logits(case.llm, state, case.prefix, case.cont)
    return quality.compare_logits(case.ref, logits, case.cont)["kl"]


def coded(case: Case, level: str, **knobs: object) -> tuple[int, float]:
    """Container bytes and KL of the case's state at `level`."""
    blob = lcg.encode(case.state, level, **knobs)
    return len(blob), kl_of(case, bytes(lcg.decode(blob)))


def sensitivities(case: Case, level: str, boosts: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Each tensor's KL per unit of squared error (summed over its elements), perturbed alone, and
    the level's error per element on it."""
    blob = lcg.encode(case.state, level)
    scale = lcg.inspect(blob)["error_scale"]
    level_error = tensor_errors(case.state, bytes(lcg.decode(blob)))
    sizes = np.array([t.size for t in f16_kv(case.state).tensors], dtype=np.float64)
    kls, added = [], []
    for b in boosts:
        decoded = bytes(lcg.decode(lcg.encode(case.state, level, error_scale=scale * b)))
        added.append(tensor_errors(case.state, decoded) * sizes)
        row = []
        for i, t in enumerate(f16_kv(decoded).tensors):
            one = f16_kv(case.state)
            one.tensors[i][:] = t
            row.append(kl_of(case, bytes(one.raw)))
        kls.append(np.array(row))
    s = (kls[1] - kls[0]) / np.maximum(added[1] - added[0], 1e-30)
    floor = 0.01 * float(np.median(s[s > 0])) if (s > 0).any() else 1e-30
    return np.maximum(s, floor), level_error  # a tensor the logits did not feel: a bounded error


def weights_for(s: np.ndarray, errors: np.ndarray, sizes: np.ndarray, max_ratio: float) -> np.ndarray:
    """Error weights (over the level's errors) in proportion to 1/(s x error), within max_ratio
    either way, at the level's predicted KL (sum of s x sizes x errors)."""
    target = float((s * sizes * errors).sum())

    def weights(lam: float) -> np.ndarray:
        return np.clip(lam / (s * errors), 1 / max_ratio, max_ratio)

    lo, hi = float((s * errors).min()) / max_ratio, float((s * errors).max()) * max_ratio
    lam = solve(lambda x: float((s * sizes * errors * weights(x)).sum()), target, True, lo, hi, 60)
    return weights(lam)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--cont", type=int, default=128, help="continuation tokens scored for KL")
    ap.add_argument("--calibrate", default="gpl-3.0.txt")
    ap.add_argument("--level", default="balanced", help="the level whose errors the sensitivities perturb")
    ap.add_argument("--levels", nargs="+", default=["high", "balanced", "compact"])
    ap.add_argument("--boosts", type=float, nargs=2, default=[2.0, 8.0])
    ap.add_argument("--max-ratio", type=float, default=8.0)
    args = ap.parse_args()
    model = args.model or default_model_path()
    texts = Config.make(False, model, Path(".")).texts
    llm = quality.make_llama(model, n_ctx=args.tokens + args.cont + 8, n_threads=2)

    def case_of(text: str) -> Case:
        toks = llm.tokenize(sample_text(text).encode(), add_bos=True)[: args.tokens + args.cont]
        prefix, cont = toks[: args.tokens], toks[args.tokens :]
        state = quality.state_of(llm, prefix)
        return Case(llm, state, prefix, cont, quality.continuation_logits(llm, state, prefix, cont))

    calibration = case_of(args.calibrate)
    log(f"sensitivity of each tensor on {args.calibrate} at {args.level}, boosts {args.boosts}")
    s, errors = sensitivities(calibration, args.level, args.boosts)
    sizes = np.array([t.size for t in f16_kv(calibration.state).tensors], dtype=np.float64)
    w = weights_for(s, errors, sizes, args.max_ratio)
    n = len(w) // 2
    log(f"weights, K by layer: {np.array2string(w[:n], precision=2, max_line_width=200)}")
    log(f"weights, V by layer: {np.array2string(w[n:], precision=2, max_line_width=200)}")
    print("| held-out text | level | coding | ratio | KL |")
    print("|---|---|---|---|---|")
    for text in (t for t in texts if t != args.calibrate):
        case = case_of(text)
        raw = len(case.state)
        for level in args.levels:
            scale = lcg.inspect(lcg.encode(case.state, level))["error_scale"]
            size, kl = coded(case, level)
            print(f"| {text} | {level} | the level | {raw / size:.3f} | {kl:.4f} |", flush=True)
            size1, kl1 = coded(case, level, error_weights=w)
            print(f"| {text} | {level} | weights | {raw / size1:.3f} | {kl1:.4f} |", flush=True)

            def kl_at(c: float, case: Case = case, level: str = level, scale: float = scale) -> float:
                return coded(case, level, error_weights=w, error_scale=scale * c)[1]

            c = solve(kl_at, kl, True, 1 / 4, 4, 6)
            size2, kl2 = coded(case, level, error_weights=w, error_scale=scale * c)
            coding = f"weights, error_scale x{c:.2f}"
            print(f"| {text} | {level} | {coding} | {raw / size2:.3f} | {kl2:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
