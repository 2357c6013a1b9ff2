"""How the error should be spread over a tensor's rows (tokens), before building it: one step for
every row (the codec's rule) against a step per row in proportion to the row's spread, at equal
size, scored by KL.

    python bench/row_steps.py [--model M.gguf] [--tokens 2048] [--texts gpl-3.0.txt FILE ...]
                              [--rel 0.35 0.75] [--alphas 0.5 1]

llama.cpp's cache types quantize each row's 32-value blocks with the block's own scale: their error
in a row follows the row's size. The codec's levels take one step per tensor, so a row of small
values (a token whose key attention must still tell apart from its neighbours, as where a model
copies) gets the same absolute error as a large one. Each K/V tensor of the state is coded in numpy
as the codec codes it without its refinements (no shrink, no raw bits; order-0 entropy of each
group of 8 channels' symbols, one frequency table each; the first 4 rows exact):

- "one step": rel x the tensor's RMS deviation for every row;
- "row^a": row r's step is c x the tensor's deviation x (row r's RMS deviation / the mean)^a, plus
  8 bits per row for its scale, c chosen (bisection) so that the total size equals "one step"'s.

The decoded states are loaded into llama.cpp and scored as the levels are (teacher-forced KL over
the continuation against the untouched state).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from channel_transform import SINKS, Case, Coded, group_bits, solve
from kvstate import f16_kv
from llama_cachegen import quality
from llama_cachegen.model import TEXTS, default_model_path, sample_text

SCALE_BITS = 8  # a row's step scale, as a log-scale byte


class Rows:
    """One K/V tensor's non-sink rows (float64), about their channel means."""

    def __init__(self, x: np.ndarray) -> None:
        self.x = x
        self.mean = x.mean(0)
        self.dev = x - self.mean
        self.sd = float(self.dev.std()) + 1e-12
        rms = np.sqrt((self.dev**2).mean(1)) + 1e-12
        self.row_rel = rms / rms.mean()

    def code(self, c: float, alpha: float) -> Coded:
        """alpha 0: one step; else a step per row in proportion to its deviation^alpha."""
        step = c * self.sd * (self.row_rel[:, None] ** alpha if alpha else np.ones((len(self.x), 1)))
        q = np.round(self.dev / step).astype(np.int64)
        xhat = self.mean + q * step
        side = SCALE_BITS * len(self.x) if alpha else 0
        return xhat, group_bits(q) + side, float(((xhat - self.x) ** 2).sum())


def total_bits(tensors: list[Rows], c: float, alpha: float) -> float:
    return sum(t.code(c, alpha)[1] for t in tensors)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--cont", type=int, default=256, help="continuation tokens scored for KL")
    ap.add_argument("--texts", nargs="+", default=list(TEXTS), help="bundled texts or files")
    ap.add_argument("--rel", type=float, nargs="+", default=[0.35, 0.75], help="one step, in deviations")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.5, 1.0])
    args = ap.parse_args()
    model = args.model or default_model_path()
    llm = quality.make_llama(model, n_ctx=args.tokens + args.cont + 8, n_threads=2)
    print(f"{model.name}, {args.tokens} tokens, KL over {args.cont}")
    rows = " | ".join(f"KL, row^{a:g}" for a in args.alphas)
    print(f"| text | bits/element | KL, one step | {rows} |")
    print("|---|---|---|" + "---|" * len(args.alphas))
    for text in args.texts:
        body = sample_text(text) if text in TEXTS else Path(text).read_text(encoding="utf-8")
        toks = llm.tokenize(body.encode(), add_bos=True)[: args.tokens + args.cont]
        if len(toks) < args.tokens + args.cont:
            raise SystemExit(f"{text}: {len(toks)} tokens, fewer than --tokens + --cont")
        prefix, cont = toks[: args.tokens], toks[args.tokens :]
        state = quality.state_of(llm, prefix)
        case = Case(llm, state, prefix, cont, quality.continuation_logits(llm, state, prefix, cont))
        tensors = [Rows(t[SINKS:].astype(np.float64)) for t in f16_kv(state).tensors]
        n_elements = sum(t.x.size for t in tensors)
        for rel in args.rel:
            one = [t.code(rel, 0.0) for t in tensors]
            size = sum(p[1] for p in one)
            kls = [case.score(one)[2]]
            for alpha in args.alphas:
                c = solve(lambda c, a=alpha, ts=tensors: total_bits(ts, c, a), size, False, rel / 8, rel * 8)
                kls.append(case.score([t.code(c, alpha) for t in tensors])[2])
            cells = " | ".join(f"{k:.4f}" for k in kls)
            print(f"| {Path(text).name} | {size / n_elements:.2f} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
