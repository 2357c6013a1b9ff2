"""llama-cachegen's CompressedStateCache against llama-cpp-python's own LlamaDiskCache.

    python bench/prompt_cache.py [--tokens 1024] [--out bench/results]

Both caches hold the state of one real prompt; the table gives bytes on disk, the time to store
the state into an empty cache (cache[key] = state), to store it again (the chunk cache writes
nothing: its chunks are there), and to get it back for a longer prompt (longest-prefix lookup plus
Llama.load_state), median of --repeat runs, whether an entry survives a hit (to serve the next
process) and whether an unrelated prompt misses. Writes prompt_cache.md into --out.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cachegen import CompressedStateCache
from llama_cachegen.model import default_model_path, sample_text
from llama_cpp.llama_cache import LlamaDiskCache


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(
    name: str, make_cache: Callable[[Path], Any], llm: Any, prompt: list[int], repeat: int
) -> list[str]:
    state = llm.save_state()
    save_times, again_times = [], []
    for _ in range(repeat):  # into an empty cache each time: a second save of a prompt writes nothing
        with tempfile.TemporaryDirectory() as tmp:
            cache = make_cache(Path(tmp))
            for times in (save_times, again_times):
                start = time.perf_counter()
                cache[prompt] = state
                times.append(time.perf_counter() - start)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cache = make_cache(folder)
        cache[prompt] = state
        size = _dir_bytes(folder)
        longer = prompt + [prompt[-1]] * 8
        load_times = []
        for _ in range(repeat):
            cache[prompt] = state  # LlamaDiskCache hands an entry out only once: a hit pops it
            start = time.perf_counter()
            llm.load_state(cache[longer])
            load_times.append(time.perf_counter() - start)
        load_s = statistics.median(load_times)
        hits_after_hit = longer in cache
        unrelated = list(reversed(prompt))
        return [
            name,
            f"{size / 1e6:.2f}",
            f"{statistics.median(save_times) * 1e3:.0f}",
            f"{statistics.median(again_times) * 1e3:.0f}",
            f"{load_s * 1e3:.0f}",
            "yes" if hits_after_hit else "no (a hit removes the entry)",
            "no" if unrelated in cache else "yes",
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)

    llm = llama_cpp.Llama(
        model_path=str(default_model_path()), n_ctx=args.tokens + 64, n_threads=2, verbose=False
    )
    prompt = llm.tokenize(sample_text().encode(), add_bos=True)[: args.tokens]
    llm.eval(prompt)
    rows = [measure("LlamaDiskCache", lambda d: LlamaDiskCache(str(d)), llm, prompt, args.repeat)]
    for level in ("lossless", "balanced", "compact"):

        def make(folder: Path, level: str = level) -> CompressedStateCache:
            return CompressedStateCache(f"file://{folder}", level=level, model=llm)

        rows.append(measure(f"CompressedStateCache, {level}", make, llm, prompt, args.repeat))
    header = [
        "cache",
        "MB on disk",
        "save ms",
        "same prompt again ms",
        "load ms",
        "kept after a hit",
        "unrelated prompt missed",
    ]
    lines = [
        f"# Prompt cache: {args.tokens}-token prompt, SmolLM2-135M, 2 threads (median of {args.repeat})",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prompt_cache.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
