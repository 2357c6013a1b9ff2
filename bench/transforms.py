"""Transforms at equal quality: plain per-token coding against CacheGen's anchor/delta grouping.

    python bench/transforms.py [--model M.gguf] [--tokens 2048] [--cont 128] [--groups 4,10,16]

For each bundled text and lossy level: container size (ratio to the f16 state) and teacher-forced
KL / top-1 of the continuation after the decoded state, for transform "none" and "anchor-delta"
with each group size. Anchor/delta codes each delta against its anchor as decoded, at the same
step, so the two meet the same error budget: the size difference at (near) equal KL is what the
transform gains or costs on this model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import llama_cachegen as lcg
import numpy as np
from common import BenchError, Config, scored_context
from llama_cachegen import quality
from llama_cachegen.model import default_model_path, sample_text

LOSSY = ("high", "balanced", "compact")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--cont", type=int, default=128)
    ap.add_argument("--groups", default="4,10,16", help="anchor/delta group sizes (tokens)")
    args = ap.parse_args()
    model = args.model or default_model_path()
    groups = [int(g) for g in args.groups.split(",")]
    texts = Config.make(False, model, Path(".")).texts
    llm = quality.make_llama(model, n_ctx=args.tokens + args.cont + 8, n_threads=2)
    rows = []
    for text in texts:
        try:
            prefix, cont, state, ref = scored_context(llm, text, sample_text(text), args.tokens, args.cont)
        except BenchError as exc:
            print(exc, file=sys.stderr)
            return 1
        for level in LOSSY:
            for transform, n in [("none", None)] + [("anchor-delta", g) for g in groups]:
                blob = lcg.encode(state, level, transform=transform, anchor_tokens=n)
                logits = quality.continuation_logits(llm, bytes(lcg.decode(blob)), prefix, cont)
                q = quality.compare_logits(ref, logits, cont)
                name = transform if n is None else f"{transform} N={n}"
                rows.append((text, level, name, len(state) / len(blob), q["kl"], q["top1"]))
                print(
                    f"{text:<16} {level:<9} {name:<18} ratio {rows[-1][3]:5.2f}  KL {q['kl']:.4f}  "
                    f"top-1 {q['top1']:.3f}",
                    flush=True,
                )
    print(f"\nMean over {len(texts)} texts, {args.tokens} tokens, {args.cont}-token continuation:")
    print("| level | transform | ratio | KL | top-1 |\n|---|---|---|---|---|")
    for level in LOSSY:
        for name in dict.fromkeys(r[2] for r in rows):
            sel = [r for r in rows if r[1] == level and r[2] == name]
            ratio, kl, top1 = (float(np.mean([r[i] for r in sel])) for i in (3, 4, 5))
            print(f"| {level} | {name} | {ratio:.2f} | {kl:.4f} | {top1:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
