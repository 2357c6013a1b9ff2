"""What context modelling could gain over the codec's order-0 tables, before any table cost.

    python bench/context_entropy.py [--model M.gguf] [--tokens 2048] [--rel 0.25,0.5,0.9]

Each K/V tensor of a real state, less its channel means, quantized with one step (rel x the
tensor's RMS channel deviation, as the lossy levels do; rel 0.5 is about `balanced`), the first 4
rows (attention sinks, kept exact by the codec) left out. Plug-in entropy in bits per value of the
symbols with one distribution per group of 32 channels (what the codec's tables model), and
conditioned besides on a context a decoder would have: the magnitude bucket of the same channel's
symbol one token before (temporal), of the mean magnitude of the 8 channels before it in the same
row (spatial), of the row's RMS (a per-token scale, sent as side information: an oracle here), or
one distribution per channel. Plug-in entropies of many contexts flatter them: every gain here is
an upper bound.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from common import Config
from kvstate import f16_kv
from llama_cachegen import quality
from llama_cachegen.model import default_model_path, sample_text

SINKS = 4
GROUP = 32


def entropy_bits(symbols: np.ndarray, context: np.ndarray) -> float:
    """Total plug-in conditional entropy H(symbols | context) in bits (both int arrays, same shape)."""
    s = symbols.ravel() - symbols.min()
    c = context.ravel().astype(np.int64)
    _, joint = np.unique(c * (int(s.max()) + 1) + s, return_counts=True)
    _, marginal = np.unique(c, return_counts=True)
    n = s.size
    return float(-(joint * np.log2(joint / n)).sum() + (marginal * np.log2(marginal / n)).sum())


def bucket(magnitude: np.ndarray) -> np.ndarray:
    return np.minimum(np.floor(np.log2(1.0 + magnitude)), 6).astype(np.int64)


def contexts(q: np.ndarray, x: np.ndarray, sd: float) -> dict[str, np.ndarray]:
    """Each context of the docstring for the symbols q (rows x channels) of values x."""
    n_rows, n_ch = q.shape
    group = np.broadcast_to((np.arange(n_ch) // GROUP)[None, :], q.shape)
    mag = np.abs(q)
    before = np.vstack([np.zeros((1, n_ch), np.int64), mag[:-1]])
    run = np.concatenate([np.zeros((n_rows, 1)), np.cumsum(mag, axis=1)], axis=1)
    first = np.maximum(np.arange(n_ch) - 8, 0)
    width = np.maximum(np.arange(n_ch) - first, 1)
    neighbours = (run[:, np.arange(n_ch)] - run[:, first]) / width
    rms = np.sqrt((x**2).mean(axis=1, keepdims=True)) / sd
    scale = np.clip(np.rint(2 * np.log2(np.maximum(rms, 1e-9))), -6, 6).astype(np.int64) + 6
    return {
        "order-0 per group (the codec)": group,
        "+ same channel, token before": group * 8 + bucket(before),
        "+ 8 channels before, same row": group * 8 + bucket(np.rint(neighbours)),
        "+ row RMS (oracle)": group * 16 + np.broadcast_to(scale, q.shape),
        "per channel": np.broadcast_to(np.arange(n_ch)[None, :], q.shape),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rel", default="0.25,0.5,0.9", help="steps in the tensor's RMS channel deviation")
    args = ap.parse_args()
    model = args.model or default_model_path()
    llm = quality.make_llama(model, n_ctx=args.tokens + 8)
    texts = Config.make(False, model, Path(".")).texts
    states = [quality.state_of(llm, llm.tokenize(sample_text(t).encode())[: args.tokens]) for t in texts]
    print(f"{model.name}, {args.tokens} tokens of {', '.join(texts)}: bits per value (share of order-0)\n")
    rels = [float(r) for r in args.rel.split(",")]
    totals: dict[float, dict[str, float]] = {rel: {} for rel in rels}
    for state in states:
        for tensor in f16_kv(state).tensors:
            x = tensor.astype(np.float64)[SINKS:]
            x = x - x.mean(axis=0)
            sd = float(np.sqrt((x**2).mean()))
            if sd == 0.0:
                continue
            for rel in rels:
                q = np.rint(x / (rel * sd)).astype(np.int64)
                for name, context in contexts(q, x, sd).items():
                    totals[rel][name] = totals[rel].get(name, 0.0) + entropy_bits(q, context)
    n_values = sum(t[SINKS:].size for s in states for t in f16_kv(s).tensors)
    names = list(totals[rels[0]])
    print("| context | " + " | ".join(f"rel {rel:g}" for rel in rels) + " |")
    print("|---|" + "---|" * len(rels))
    for name in names:
        cells = [
            f"{totals[r][name] / n_values:.3f} ({totals[r][name] / totals[r][names[0]]:.3f})" for r in rels
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
