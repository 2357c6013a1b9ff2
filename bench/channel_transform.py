"""What a calibrated channel basis (PCA per K/V tensor, KVTC-style) would gain, before building it,
and how the error should be spread over channels: bits at equal squared error, and KL at equal size.

    python bench/channel_transform.py [--model M.gguf] [--tokens 2048] [--calibrate gpl-3.0.txt] [--block 64]

Each K/V tensor of a held-out text's state is coded in numpy as the codec codes it without its
refinements (no shrink, no raw bits; order-0 entropy of each group of 8 channels' symbols, as one
frequency table each; the first 4 rows exact):

- "per-group steps": one step per group of 8 channels, `rel` x the group's RMS deviation (the
  codec's rule until 2026-12);
- then the tensor in a basis (none: its channels, as the codec codes them today; calibrated: the
  principal axes fitted on the calibration text's state; self: fitted on the state it codes, the
  bound a per-state basis reaches before paying for it), a step per component of `c` x its
  deviation^gamma (gamma 0: one step for all, the codec's rule since 2026-12; 0.5: between), `c`
  chosen for the per-group coding's squared error ("= MSE") or for its size ("= bits").

The decoded states are loaded into llama.cpp and scored as the levels are (teacher-forced KL over
the continuation against the untouched state).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
from common import Config
from kvstate import f16_kv
from llama_cachegen import quality
from llama_cachegen.model import default_model_path, sample_text

GROUP = 8
SINKS = 4  # rows kept exact by the levels


def group_bits(q: np.ndarray) -> float:
    """Order-0 entropy in bits of each group of GROUP columns' symbols, summed (one table each)."""
    bits = 0.0
    for g in range(0, q.shape[1], GROUP):
        block = q[:, g : g + GROUP].ravel()
        counts = np.bincount(block - block.min())
        p = counts[counts > 0] / block.size
        bits -= float((p * np.log2(p)).sum()) * block.size
    return bits


Coded = tuple[np.ndarray, float, float]  # decoded rows, bits, squared error


class Tensor:
    """One K/V tensor's non-sink rows (float64) and what coding them needs."""

    def __init__(self, x: np.ndarray, basis: np.ndarray) -> None:
        self.x = x
        self.mean = x.mean(0)
        self.basis = basis
        self.y = (x - self.mean) @ basis
        self.y_sd = self.y.std(0) + 1e-12
        sd = x.std(0)
        group_var = np.add.reduceat(sd**2, np.arange(0, x.shape[1], GROUP)) / GROUP
        self.group_rms = np.repeat(np.sqrt(group_var), GROUP)[: x.shape[1]]

    def per_group(self, rel: float) -> Coded:
        step = rel * self.group_rms + 1e-12
        q = np.round((self.x - self.mean) / step).astype(np.int64)
        xhat = self.mean + q * step
        return xhat, group_bits(q), float(((xhat - self.x) ** 2).sum())

    def pca(self, c: float, gamma: float, decode: bool = True) -> Coded:
        """Decoded rows (with `decode`), bits, squared error (a rotation keeps it: measured on y)."""
        step = c * self.y_sd**gamma
        q = np.round(self.y / step).astype(np.int64)
        yhat = q * step
        xhat = self.mean + yhat @ self.basis.T if decode else yhat
        return xhat, group_bits(q), float(((yhat - self.y) ** 2).sum())


def fit_basis(x: np.ndarray, block: int = 0) -> np.ndarray:
    """Principal axes of x's rows, largest variance first; with `block`, of each block of that many
    channels on its own (a KV head: a basis of head_dim^2 per head instead of the tensor width^2)."""
    width = x.shape[1]
    block = block or width
    basis = np.zeros((width, width))
    for b in range(0, width, block):
        _, axes = np.linalg.eigh(np.cov((x[:, b : b + block] - x[:, b : b + block].mean(0)).T))
        basis[b : b + block, b : b + block] = axes[:, ::-1]
    return basis


def solve(
    f: Callable[[float], float], target: float, up: bool, lo: float = 1e-4, hi: float = 1e4, n: int = 24
) -> float:
    """c in [lo, hi] with f(c) ~ target, by bisection on log c (f monotonic)."""
    for _ in range(n):
        mid = np.sqrt(lo * hi)
        if (f(mid) < target) == up:
            lo = mid
        else:
            hi = mid
    return float(np.sqrt(lo * hi))


@dataclass
class Case:
    """A held-out text's state and the logits it gives."""

    llm: llama_cpp.Llama
    state: bytes
    prefix: list[int]
    cont: list[int]
    ref: np.ndarray

    def score(self, parts: list[Coded]) -> tuple[float, float, float]:
        """Bits per element, squared error and KL of the state with every tensor decoded."""
        out = f16_kv(self.state)
        for dst, (xhat, _, _) in zip(out.tensors, parts, strict=True):
            dst[SINKS:] = xhat.astype(np.float16)
        logits = quality.continuation_logits(self.llm, bytes(out.raw), self.prefix, self.cont)
        kl = quality.compare_logits(self.ref, logits, self.cont)["kl"]
        n_elements = sum(xhat.size for xhat, _, _ in parts)
        return sum(p[1] for p in parts) / n_elements, sum(p[2] for p in parts), kl


def in_basis(tensors: list[Tensor], per_group: list[Coded], gamma: float, how: str) -> list[Coded]:
    """Each tensor in its basis at the per-group coding's squared error, then (`= bits`) one factor
    on every step for its total size."""
    cs = [
        solve(lambda c, t=t: t.pca(c, gamma, False)[2], p[2], True)
        for t, p in zip(tensors, per_group, strict=True)
    ]
    scale = 1.0
    if how == "= bits":
        target = sum(p[1] for p in per_group)
        scale = solve(
            lambda s: sum(t.pca(c * s, gamma, False)[1] for t, c in zip(tensors, cs, strict=True)),
            target,
            False,
        )
    return [t.pca(c * scale, gamma) for t, c in zip(tensors, cs, strict=True)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--cont", type=int, default=128, help="continuation tokens scored for KL")
    ap.add_argument("--calibrate", default="gpl-3.0.txt")
    ap.add_argument("--block", type=int, default=0, help="channels per basis (0: the tensor's width)")
    ap.add_argument("--gammas", type=float, nargs="+", default=[0.0, 0.5])
    ap.add_argument("--rel", type=float, nargs="+", default=[0.4, 0.9], help="per-group steps, in deviations")
    args = ap.parse_args()
    model = args.model or default_model_path()
    texts = Config.make(False, model, Path(".")).texts
    llm = quality.make_llama(model, n_ctx=args.tokens + args.cont + 8, n_threads=2)

    def tokens_of(text: str) -> list[int]:
        return llm.tokenize(sample_text(text).encode(), add_bos=True)[: args.tokens + args.cont]

    calibration = f16_kv(quality.state_of(llm, tokens_of(args.calibrate)[: args.tokens])).tensors
    bases = [fit_basis(t[SINKS:].astype(np.float64), args.block) for t in calibration]
    print("| held-out text | rel | method | bits/element | squared error / per-group | KL |")
    print("|---|---|---|---|---|---|")
    for text in (t for t in texts if t != args.calibrate):
        toks = tokens_of(text)
        prefix, cont = toks[: args.tokens], toks[args.tokens :]
        state = quality.state_of(llm, prefix)
        case = Case(llm, state, prefix, cont, quality.continuation_logits(llm, state, prefix, cont))
        for fit in ("none", "calibrated", "self"):
            tensors = []
            for t, basis in zip(f16_kv(state).tensors, bases, strict=True):
                x = t[SINKS:].astype(np.float64)
                own = {"none": np.eye(x.shape[1]), "calibrated": basis, "self": fit_basis(x, args.block)}[fit]
                tensors.append(Tensor(x, own))
            for rel in args.rel:
                per_group = [t.per_group(rel) for t in tensors]
                bits, err, kl = case.score(per_group)
                if fit == "none":
                    print(f"| {text} | {rel:g} | per-group steps | {bits:.3f} | 1 | {kl:.4f} |", flush=True)
                for gamma in args.gammas:
                    for how in ("= MSE", "= bits"):
                        b, e, k = case.score(in_basis(tensors, per_group, gamma, how))
                        method = f"basis {fit}, gamma {gamma:g}, {how}"
                        print(
                            f"| {text} | {rel:g} | {method} | {b:.3f} | {e / err:.3f} | {k:.4f} |", flush=True
                        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
