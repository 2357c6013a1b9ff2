"""Markdown report and PNG plots from the measured results."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import rate_distortion as rd  # noqa: E402
import ttft  # noqa: E402
from common import CACHE_TYPES, LEVELS, Config, require  # noqa: E402
from speed import SCALING_LEVEL, ScalingRow, SpeedRow, loglog_slope  # noqa: E402

RD_PNG, TTFT_PNG, SCALING_PNG = "rate_distortion.png", "ttft.png", "scaling.png"
# (level, llama.cpp cache type whose KL it must not exceed, minimum size ratio vs the f16 state)
QUALITY_TARGETS = (("high", "q8_0", 3.0), ("balanced", "q5_1", 4.5), ("compact", "q4_0", 6.0))
LOSSLESS_MIN_RATIO = 1.2
# per core, one thread (issue 9): decode >= 2 GB/s of f16 output, encode >= 1 GB/s
MIN_DECODE_MBPS, MIN_ENCODE_MBPS = 2000.0, 1000.0


@dataclass
class Results:
    cfg: Config
    setup: list[tuple[str, str]]
    # level, reference cache type, error scale (the steps follow them), first_layer_scale, sinks
    presets: list[tuple[str, str | None, float | None, float, int]]
    points: list[rd.Point]
    speed: list[SpeedRow]
    speed_tokens: int
    ttft: ttft.Components
    scaling: list[ScalingRow]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(value: object) -> str:
        if value is None:
            return "—"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _curve_means(points: list[rd.Point], n_tokens: int) -> list[tuple[str, str, dict[str, float]]]:
    """(curve, method, mean over texts) in first-seen order."""
    seen: list[tuple[str, str]] = []
    for p in points:
        if p.n_tokens == n_tokens and (p.curve, p.method) not in seen:
            seen.append((p.curve, p.method))
    return [
        (
            curve,
            method,
            rd.mean_by(points, n_tokens, lambda p, c=curve, m=method: (p.curve, p.method) == (c, m)),
        )
        for curve, method in seen
    ]


def targets(r: Results) -> list[tuple[str, str, str, str]]:
    """(target, requirement, measured, PASS/FAIL), all from this run's measurements."""
    n = r.cfg.target_len

    def mean(curve: str, method: str) -> dict[str, float]:
        return rd.mean_by(r.points, n, lambda p: (p.curve, p.method) == (curve, method))

    rows = []
    for level, cache_type, min_ratio in QUALITY_TARGETS:
        ours, theirs = mean(rd.LEVEL_CURVE, level), mean(rd.CACHE_TYPE_CURVE, cache_type)
        ok = ours["kl"] <= theirs["kl"] and ours["ratio"] >= min_ratio
        rows.append(
            (
                f"`{level}` vs {cache_type}",
                f"KL ≤ {theirs['kl']:.4g} ({cache_type}) at ≥ {min_ratio}x",
                f"KL {ours['kl']:.4g} at {ours['ratio']:.2f}x",
                "PASS" if ok else "FAIL",
            )
        )
    lossless = mean(rd.LEVEL_CURVE, "lossless")
    rows.append(
        (
            "`lossless` ratio",
            f"≥ {LOSSLESS_MIN_RATIO}x",
            f"{lossless['ratio']:.2f}x",
            "PASS" if lossless["ratio"] >= LOSSLESS_MIN_RATIO else "FAIL",
        )
    )
    for row in r.speed:
        if row.method in LEVELS and row.threads == 1:
            enc, dec = row.encode_mbps or 0.0, row.decode_mbps
            ok = enc >= MIN_ENCODE_MBPS and dec >= MIN_DECODE_MBPS
            rows.append(
                (
                    f"`{row.method}` speed, 1 thread",
                    f"encode ≥ {MIN_ENCODE_MBPS:g} MB/s, decode ≥ {MIN_DECODE_MBPS:g} MB/s",
                    f"encode {enc:.0f} MB/s, decode {dec:.0f} MB/s",
                    "PASS" if ok else "FAIL",
                )
            )
    return rows


def plot_rate_distortion(r: Results, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 6))
    styles = ["-", "--", ":", "-."]
    noise_kl = [p.kl for p in r.points if p.curve == rd.NOISE_CURVE]
    floor = min([p.kl for p in r.points if p.kl > 0] + noise_kl) / 10
    colors: dict[str, str] = {}
    for i, n in enumerate(r.cfg.lengths):
        by_curve: dict[str, list[dict[str, float]]] = {}
        for curve, _method, m in _curve_means(r.points, n):
            if curve not in (rd.NOISE_CURVE, rd.F16_CURVE):
                by_curve.setdefault(curve, []).append(m)
        for curve, ms in by_curve.items():
            ms.sort(key=lambda m: m["bits_per_element"])
            # exact methods (KL 0) sit on the floor as markers: a line down to them would mean nothing
            lossy, exact = [m for m in ms if m["kl"] > 0], [m for m in ms if m["kl"] == 0]
            for subset, style, label in (
                (lossy, styles[i % len(styles)], f"{curve}, {n} tokens"),
                (exact, "none", None if lossy else f"{curve}, {n} tokens"),
            ):
                if subset:
                    line = ax.plot(
                        [m["bits_per_element"] for m in subset],
                        [max(m["kl"], floor) for m in subset],
                        ls=style,
                        marker="o",
                        color=colors.get(curve),
                        label=label,
                    )
                    colors[curve] = line[0].get_color()
    ax.axhline(
        float(np.mean(noise_kl)), color="grey", lw=0.8, label="flash attention on vs off (noise floor)"
    )
    ax.axhline(floor, color="black", lw=0.5, ls=":", label="KL = 0 (lossless) drawn here")
    ax.set_xlabel("bits per KV element (everything included; f16 = 16)")
    ax.set_ylabel("mean KL divergence vs the f16 state (log)")
    ax.set_yscale("log")
    ax.set_title("Rate-distortion, mean over texts")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft(c: ttft.Components, bandwidths: Sequence[float], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 6))
    grid = np.logspace(np.log10(min(bandwidths)), np.log10(max(bandwidths)), 200)
    colors: dict[str, str] = {}
    for name, fn in ttft.methods(c).items():
        base = name.removesuffix(", pipelined")
        line = ax.plot(
            grid, [fn(b) for b in grid], "--" if base != name else "-", color=colors.get(base), label=name
        )
        colors[base] = line[0].get_color()
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth (Gbps)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(
        f"TTFT, {c.n_tokens}-token context (dashed: decode pipelined over {c.chunks} chunks, modelled)"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scaling(rows: list[ScalingRow], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 5))
    tokens = [row.n_tokens for row in rows]
    ax.plot(tokens, [row.encode_s for row in rows], marker="o", label="encode")
    ax.plot(tokens, [row.decode_s for row in rows], marker="o", label="decode")
    ax.plot(
        tokens,
        [rows[-1].encode_s * n / tokens[-1] for n in tokens],
        ":",
        color="grey",
        label="linear through the longest encode",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("seconds")
    ax.set_title(f"Codec time vs context length (`{SCALING_LEVEL}`)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mb(n: int) -> float:
    return n / 1e6


def markdown(r: Results) -> str:
    cfg, c = r.cfg, r.ttft
    out = [
        f"# llama-cachegen benchmark{' (--quick: smoke test, not for conclusions)' if cfg.quick else ''}",
        "",
    ]
    out += ["## Setup", "", table(("item", "value"), r.setup), ""]
    out += [
        "Quality: the state is loaded into a fresh context and the next "
        f"{cfg.cont_len} tokens of the same text are teacher-forced; mean KL(reference ‖ test) of the "
        "next-token distributions, top-1 agreement and Δperplexity against the untouched f16 state "
        "(flash attention off). llama.cpp cache types need flash attention, so they are compared with an "
        "f16 cache computed with flash attention on; the f16 flash-on vs flash-off row is the noise floor. "
        "Sizes are bytes of the whole artefact (container, state or compressed state) and bits per KV "
        "element divide them by the number of K and V elements. The per-token min-max baseline counts "
        "its codes at their ideal order-0 entropy per (tensor, channel) — a lower bound for any real "
        "coder, without table costs — plus an f16 minimum and step per token and tensor. "
        "Shorter contexts are truncations of one prefill of the longest (identical K/V: attention is "
        "causal). "
        "Times are medians of repetitions, all measured in this run.",
        "",
    ]
    out += [
        "Level presets (from `inspect` of this run's containers: each tensor's step gives a squared "
        "error of `error scale` x the reference cache type's on that tensor):",
        "",
    ]
    out += [
        table(("level", "reference", "error scale", "first_layer_scale", "sink tokens"), r.presets),
        "",
    ]
    out += [f"## Targets ({cfg.target_len} tokens, mean over {len(cfg.texts)} text(s))", ""]
    out += [table(("target", "requirement", "measured", "result"), targets(r)), ""]

    out += ["## Rate-distortion (mean over texts)", "", f"![rate-distortion]({RD_PNG})", ""]
    for n in cfg.lengths:
        rows = [
            (curve, method, m["bits_per_element"], m["ratio"], m["kl"], m["top1"], m["dppl"])
            for curve, method, m in _curve_means(r.points, n)
        ]
        out += [f"### {n} tokens", ""]
        out += [
            table(("curve", "method", "bits/element", "x smaller than f16", "KL", "top-1", "Δppl"), rows),
            "",
        ]

    threads = max(cfg.codec_threads)
    out += [
        f"## Codec speed (f16 state of {r.speed_tokens} tokens, {_mb(r.speed[0].state_bytes):.1f} MB)",
        "",
        "MB/s of f16 state (input of encode, output of decode, into a reused buffer). zstd and lz4 run "
        "single-threaded. `(path)` rows: one thread on each decoder path (subprocesses).",
        "",
        table(
            ("method", "threads", "x smaller than f16", "encode MB/s", "decode MB/s"),
            [(s.method, s.threads, s.state_bytes / s.size, s.encode_mbps, s.decode_mbps) for s in r.speed],
        ),
        "",
    ]

    fns = ttft.methods(c)
    names = list(fns)
    out += [
        f"## Time to first token vs link bandwidth ({c.n_tokens}-token context)",
        "",
        f"![ttft]({TTFT_PNG})",
        "",
        f"Measured: prefill of the context + 1 token {c.prefill_s:.3f} s; restore (llama_state_seq_set_data "
        f"+ 1 token) {c.restore_s:.3f} s; decode per level at {threads} threads (codec speed table). "
        "Modelled: transfer = bytes / bandwidth; `pipelined` assumes the state is cut into "
        f"{c.chunks} equal chunks whose transfer and decode overlap, each costing 1/{c.chunks} of the "
        "measured whole (decode is linear in length, see Scaling), so TTFT = max(transfer, decode) + "
        f"min(transfer, decode) / {c.chunks} + restore. Modelled here; bench/streaming.py measures the "
        "real chunked pipeline end to end over a shaped link.",
        "",
        table(("Gbps", *names), [(b, *(fns[name](b) for name in names)) for b in cfg.bandwidths_gbps]),
        "",
        "Break-even bandwidths (Gbps; — = none between 0.001 and 1000 Gbps):",
        "",
        table(("method", "beats recompute above", "beats fetching the f16 state below"), ttft.break_evens(c)),
        "",
    ]

    slope_enc = loglog_slope([s.n_tokens for s in r.scaling], [s.encode_s for s in r.scaling])
    slope_dec = loglog_slope([s.n_tokens for s in r.scaling], [s.decode_s for s in r.scaling])
    out += [
        f"## Scaling with context length (`{SCALING_LEVEL}`, {threads} threads)",
        "",
        f"![scaling]({SCALING_PNG})",
        "",
        table(
            (
                "tokens",
                "state MB",
                "container MB",
                "x smaller",
                "encode ms",
                "decode ms",
                "encode µs/token",
                "decode µs/token",
            ),
            [
                (
                    s.n_tokens,
                    _mb(s.state_bytes),
                    _mb(s.size),
                    s.state_bytes / s.size,
                    1e3 * s.encode_s,
                    1e3 * s.decode_s,
                    1e6 * s.encode_s / s.n_tokens,
                    1e6 * s.decode_s / s.n_tokens,
                )
                for s in r.scaling
            ],
        ),
        "",
        f"Fitted time ∝ tokens^b: encode b = {slope_enc:.2f}, decode b = {slope_dec:.2f} (1 = linear).",
        "",
    ]

    out += ["## Every point", ""]
    out += [
        table(
            (
                "text",
                "tokens",
                "curve",
                "method",
                "bytes",
                "bits/element",
                "x smaller than f16",
                "KL",
                "top-1",
                "Δppl",
            ),
            [
                (
                    p.text,
                    p.n_tokens,
                    p.curve,
                    p.method,
                    p.size,
                    p.bits_per_element,
                    p.ratio,
                    p.kl,
                    p.top1,
                    p.dppl,
                )
                for p in r.points
            ],
        ),
        "",
    ]
    return "\n".join(out)


def write(r: Results) -> Path:
    """Writes report.md and the PNGs into cfg.out; returns the report's path."""
    for name in (*LEVELS, *CACHE_TYPES):
        require(any(p.method == name for p in r.points), f"no rate-distortion result for {name}")
    r.cfg.out.mkdir(parents=True, exist_ok=True)
    plot_rate_distortion(r, r.cfg.out / RD_PNG)
    plot_ttft(r.ttft, r.cfg.bandwidths_gbps, r.cfg.out / TTFT_PNG)
    plot_scaling(r.scaling, r.cfg.out / SCALING_PNG)
    path = r.cfg.out / "report.md"
    path.write_text(markdown(r), encoding="utf-8")
    return path
