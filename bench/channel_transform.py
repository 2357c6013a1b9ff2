"""What a calibrated channel basis (PCA per K/V tensor, KVTC-style) would gain, before building it.

    python bench/channel_transform.py [--model M.gguf] [--tokens 2048] [--calibrate gpl-3.0.txt]

For each K/V tensor of a held-out text's state: the order-0 entropy of the symbols of plain coding
(one step per group of 8 channels, `--rel` x the group's RMS deviation, as the fixed-step levels)
against the same tensor rotated into the principal axes fitted on the calibration text's state
(one step for every component, chosen for the same squared error: a rotation keeps it). The ratio
of total bits is the coding gain at equal MSE; "self" fits the basis on the state it codes (the
bound a per-state basis would reach, before paying for the basis). Equal MSE is not equal KL: the
error moves between channels.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from common import Config
from kvstate import read_layout
from llama_cachegen import quality
from llama_cachegen.model import default_model_path, sample_text

GROUP = 8
SINKS = 4  # rows kept exact by the levels


def tensors(state: bytes) -> list[np.ndarray]:
    """Each K/V tensor as cells x channels, float64."""
    lay = read_layout(state)
    out = []
    for t in lay.tensors:
        a = np.frombuffer(state, np.float16, count=t.size // 2, offset=t.offset).astype(np.float64)
        out.append(a.reshape(-1, lay.n_cells).T if t.transposed else a.reshape(lay.n_cells, -1))
    return out


def entropy_bits(q: np.ndarray) -> float:
    """Order-0 entropy of q's values, in bits, times its length."""
    _, counts = np.unique(q, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum() * q.size)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--calibrate", default="gpl-3.0.txt")
    ap.add_argument("--rel", type=float, default=0.40, help="step in group deviations (balanced's fixed one)")
    args = ap.parse_args()
    model = args.model or default_model_path()
    texts = Config.make(False, model, Path(".")).texts
    llm = quality.make_llama(model, n_ctx=args.tokens + 8, n_threads=2)

    def state(text: str) -> list[np.ndarray]:
        tokens = llm.tokenize(sample_text(text).encode(), add_bos=True)[: args.tokens]
        return tensors(quality.state_of(llm, tokens))

    calibration = state(args.calibrate)
    print("| held-out text | plain bits/element | PCA (calibrated) / plain | PCA (self) / plain |")
    print("|---|---|---|---|")
    for text in (t for t in texts if t != args.calibrate):
        plain = calibrated = self_fit = 0.0
        elements = 0
        for cal, x in zip(calibration, state(text), strict=True):
            cal, x = cal[SINKS:], x[SINKS:]
            mean, sd = x.mean(0), x.std(0)
            group_rms = np.sqrt(np.add.reduceat(sd**2, np.arange(0, x.shape[1], GROUP)) / GROUP)
            steps = np.repeat(args.rel * group_rms + 1e-12, GROUP)[: x.shape[1]]
            plain += sum(entropy_bits(np.round((x[:, j] - mean[j]) / steps[j])) for j in range(x.shape[1]))
            step = np.sqrt(np.mean(steps**2))  # the same squared error, one step for all components
            for fit, acc in ((cal, "cal"), (x, "self")):
                _, basis = np.linalg.eigh(np.cov((fit - fit.mean(0)).T))
                y = (x - mean) @ basis
                bits = sum(entropy_bits(np.round(y[:, j] / step)) for j in range(y.shape[1]))
                if acc == "cal":
                    calibrated += bits
                else:
                    self_fit += bits
            elements += x.size
        print(f"| {text} | {plain / elements:.3f} | {calibrated / plain:.3f} | {self_fit / plain:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
