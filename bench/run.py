"""llama-cachegen benchmark: rate-distortion, codec speed, time to first token, scaling.

    python bench/run.py [--quick] [--model PATH] [--out bench/results]

Writes report.md, results.json and PNG plots into --out. Every number comes from this run; a method
that cannot run stops the bench with a non-zero exit instead of being left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules, also under runpy

import llama_cachegen  # noqa: E402
import llama_cpp  # noqa: E402
import lz4  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import rate_distortion  # noqa: E402
import report  # noqa: E402
import speed  # noqa: E402
import ttft  # noqa: E402
import zstandard  # noqa: E402
from common import LEVELS, Config, log, require  # noqa: E402
from llama_cachegen import quality  # noqa: E402
from llama_cachegen.model import TEXTS, default_model_path, sample_text  # noqa: E402

OUTPUTS = ("report.md", "results.json", report.RD_PNG, report.TTFT_PNG, report.SCALING_PNG)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _load() -> str:
    """Other processes slow every timing here; the report shows how busy the machine was."""
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def _git_revision() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True, check=True
        ).stdout.strip()
        return rev + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def setup_table(cfg: Config, argv: list[str]) -> list[tuple[str, str]]:
    lib_version, format_version = llama_cachegen.version()
    return [
        ("command", f"`{shlex.join(['python', 'bench/run.py', *argv])}`"),
        ("date", time.strftime("%Y-%m-%d %H:%M:%S %Z")),
        ("CPU", f"{_cpu_model()}, {os.cpu_count()} logical cores"),
        ("OS", platform.platform()),
        ("load average at start (1/5/15 min)", _load()),
        ("llama.cpp threads", str(cfg.threads)),
        (
            "llama-cachegen",
            f"{llama_cachegen.__version__} (native {lib_version}, container format "
            f"{format_version}), git {_git_revision()}",
        ),
        ("llama-cpp-python", llama_cpp.__version__),
        ("python / numpy", f"{platform.python_version()} / {np.__version__}"),
        (
            "zstandard / lz4 / matplotlib",
            f"{zstandard.__version__} / {lz4.VERSION} / {matplotlib.__version__}",
        ),
        ("model", f"{cfg.model.name} ({cfg.model.stat().st_size / 1e6:.0f} MB)"),
        ("texts", ", ".join(cfg.texts)),
        ("contexts (tokens)", ", ".join(map(str, cfg.lengths))),
        ("timing repetitions", f"{cfg.reps} (median)"),
    ]


def run(cfg: Config, argv: list[str]) -> Path:
    require(cfg.model.is_file(), f"model not found: {cfg.model}")
    for name in OUTPUTS:  # a failed run must not leave an earlier run's report looking current
        (cfg.out / name).unlink(missing_ok=True)
    setup = setup_table(cfg, argv)

    vocab = quality.make_llama(cfg.model, n_ctx=64, logits_all=False, vocab_only=True)
    tokens = {text: vocab.tokenize(sample_text(text).encode(), add_bos=True) for text in cfg.texts}
    longest = max(cfg.scaling_lengths)
    long_tokens = vocab.tokenize("\n\n".join(sample_text(t) for t in TEXTS).encode(), add_bos=True)[:longest]
    require(len(long_tokens) == longest, f"the bundled texts hold fewer than {longest} tokens")
    del vocab

    points, states = rate_distortion.run(cfg, tokens)

    state = states[(cfg.texts[0], cfg.target_len)]
    speed_rows = speed.codec_speed(cfg, state) + speed.decode_paths(cfg, state)

    threads = max(cfg.codec_threads)
    levels = {
        s.method: (s.size, s.decode_s) for s in speed_rows if s.method in LEVELS and s.threads == threads
    }
    text = tokens[cfg.texts[0]]
    components = ttft.measure(cfg, text[: cfg.target_len], text[cfg.target_len], state, levels)

    log(f"scaling: prefill of {longest} tokens")
    llm = quality.make_llama(cfg.model, n_ctx=longest, n_threads=cfg.threads, logits_all=False)
    long_state = quality.state_of(llm, long_tokens)
    del llm
    scaling_rows = speed.scaling(cfg, long_state)

    presets = []
    for level in LEVELS:
        info = llama_cachegen.inspect(llama_cachegen.encode(state, level))
        presets.append(
            (level, info["reference"], info["error_scale"], info["first_layer_scale"], info["sink_tokens"])
        )
    setup.append(("load average at end (1/5/15 min)", _load()))
    results = report.Results(
        cfg, setup, presets, points, speed_rows, cfg.target_len, components, scaling_rows
    )
    path = report.write(results)
    raw = {
        "setup": dict(setup),
        "presets": presets,
        "points": [dataclasses.asdict(p) for p in points],
        "speed": [dataclasses.asdict(s) for s in speed_rows],
        "ttft": dataclasses.asdict(components),
        "scaling": [dataclasses.asdict(s) for s in scaling_rows],
    }
    (cfg.out / "results.json").write_text(json.dumps(raw, indent=1), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (seconds) for CI")
    parser.add_argument("--model", type=Path, help="GGUF to measure (default: the bundled SmolLM2-135M)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    cfg = Config.make(args.quick, args.model or default_model_path(), args.out)
    start = time.perf_counter()
    try:
        path = run(cfg, argv)
    except Exception:  # every failure is fatal: report it and exit non-zero
        traceback.print_exc()
        print("bench FAILED (see above)", file=sys.stderr)
        return 1
    log(f"wrote {path} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
