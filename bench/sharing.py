"""Time to first token on llama-server B for a prefix that llama-server A has already processed.

    python bench/sharing.py [--quick] [--reps 3] [--chunk-tokens 256] [--out bench/results]

Real processes on 127.0.0.1: two llama-servers (-t 1, one slot), a sharing proxy before A that
uploads every prompt it sees (`--levels lossless balanced`) into a directory store, and three
proxies before B: `--load-level lossless`, `--load-level balanced` and adaptive (`--slo`, generous).
The shared prefixes are the bundled texts concatenated, cut at 1K, 2K and 4K tokens (each a prefix
of the next: A processes the 4K one once, growing through 1K and 2K so that its slot is saved at
each length for the raw copy). Each request on B is that prefix plus a new question, answered with
one token; TTFT is the client's wall time of that request (median of --reps), with B's slot
emptied before each one:

- cold: straight to B, nothing restored: the whole prompt is prefilled;
- proxy <level>: through a proxy before B: store lookup, fetch, decode, slot file, restore, then
  only the question evaluated;
- raw slot copy: A's own slot file of the prefix (saved on A, copied into B's --slot-save-path,
  `action=restore` on B), then the request straight to B. The copy is a local file copy here.

Bytes moved: K/V bytes read from the store (the proxy's stats) or the slot file's size.
Writes sharing.md and sharing.json into --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import log, require
from llama_cachegen.model import default_model_path, sample_text
from llama_cachegen.proxy import RESTORED_HEADER, STATS_PATH
from llama_cachegen.server import Processes, http_status, llama_server_path, post_json

TEXTS = ("gpl-3.0.txt", "gfdl-1.3.txt", "difflib.py.txt")
Q_A = "\n\nQuestion: Who publishes this text?\nAnswer:"
Q_B = " In one sentence, the text above says that"  # differs from Q_A at its first token
SLO_S = 60.0  # generous: the adaptive loader may take the best level


def _stats(proxy: str) -> dict[str, Any]:
    return json.loads(http_status(proxy + STATS_PATH)[1])


def _wait_idle(proxy: str, timeout: float = 300.0) -> dict[str, Any]:
    """Waits until the proxy has no save or upload pending."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.3)
        stats = _stats(proxy)
        if not stats["pending_uploads"]:
            # a save may still be starting: two quiet polls in a row
            time.sleep(0.3)
            again = _stats(proxy)
            if not again["pending_uploads"] and again["uploads"] == stats["uploads"]:
                return again
    raise TimeoutError(f"{proxy}: uploads not done: {_stats(proxy)}")


def _complete(url: str, prompt: list[int], **extra: Any) -> tuple[dict[str, Any], dict[str, str], float]:
    body = {"prompt": prompt, "n_predict": 1, "temperature": 0.0, "cache_prompt": True, **extra}
    start = time.perf_counter()
    out, headers = post_json(url + "/completion", body)
    return out, headers, time.perf_counter() - start


@dataclass
class Row:
    tokens: int  # shared prefix
    method: str
    ttft_s: float  # median
    ttft_all: list[float]
    bytes_moved: int  # per request
    restored: int  # prompt tokens restored (proxy header; the raw copy: the slot's)
    evaluated: int  # prompt tokens B computed (its timings)
    first_token: str


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="1K-token prefix only, one repetition (smoke run)"
    )
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each restore (cold runs once)")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    lengths = (1024,) if args.quick else (1024, 2048, 4096)
    reps = 1 if args.quick else args.reps
    start = time.perf_counter()
    binary = llama_server_path(build=True)
    n_ctx = max(lengths) + 512
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = str(root / "store")
        procs = Processes(root)
        try:
            log("starting two llama-servers and four proxies")
            a_server, a_slots = procs.llama_server("a", binary, n_ctx)
            b_server, b_slots = procs.llama_server("b", binary, n_ctx)
            c = args.chunk_tokens
            settings = ("--chunk-tokens", str(c), "--threads", "2")
            levels = ("--levels", "lossless", "balanced")
            a_proxy = procs.proxy("a", a_server, a_slots, store, *settings, *levels)
            options = {"lossless": ("--load-level", "lossless"), "balanced": ("--load-level", "balanced"),
                       "adaptive": ("--slo", str(SLO_S))}  # fmt: skip
            b_proxies = {
                f"proxy {name}": procs.proxy(f"b-{name}", b_server, b_slots, store, *settings, *extra)
                for name, extra in options.items()
            }
            text = "\n\n".join(sample_text(name) for name in TEXTS)
            tokens = post_json(a_server + "/tokenize", {"content": text, "add_special": True})[0]["tokens"]
            require(
                len(tokens) >= max(lengths), f"the texts give {len(tokens)} tokens, fewer than {max(lengths)}"
            )
            q_a = post_json(a_server + "/tokenize", {"content": Q_A, "add_special": False})[0]["tokens"]
            q_b = post_json(a_server + "/tokenize", {"content": Q_B, "add_special": False})[0]["tokens"]
            require(q_a[0] != q_b[0], "the two questions must differ at their first token")
            raw: dict[int, Path] = {}
            for n in lengths:  # A: grows its slot through every length; uploads; its raw slot files
                out, _, seconds = _complete(a_proxy, tokens[:n] + q_a)
                log(f"A: {n} + {len(q_a)} tokens, evaluated {out['timings']['prompt_n']} in {seconds:.1f} s")
                up = _wait_idle(a_proxy)
                log(f"A: {up['bytes_written'] / 1e6:.1f} MB in {up['objects_written']} objects uploaded")
                name = f"raw-{n}.bin"
                post_json(a_server + "/slots/0?action=save", {"filename": name})
                raw[n] = a_slots / name

            def empty_b() -> None:
                post_json(b_server + "/slots/0?action=erase", {})

            for n in lengths:
                prompt = tokens[:n] + q_b
                log(f"B: {n}-token prefix: cold")
                empty_b()
                out, _, seconds = _complete(b_server, prompt)
                require(
                    out["timings"]["prompt_n"] == len(prompt), f"cold run reused a cache: {out['timings']}"
                )
                cold_token = out["content"]
                rows.append(Row(n, "cold prefill", seconds, [seconds], 0, 0, len(prompt), cold_token))
                for method, proxy in b_proxies.items():
                    times, moved, restored, evaluated, first = [], 0, 0, 0, ""
                    for _ in range(reps):
                        _complete(proxy, tokens[:8], n_predict=1)  # the proxy's slot now holds no prefix
                        empty_b()
                        before = _stats(proxy)["bytes_read"]
                        out, headers, seconds = _complete(proxy, prompt)
                        times.append(seconds)
                        moved = _stats(proxy)["bytes_read"] - before
                        restored = int(headers[RESTORED_HEADER])
                        evaluated, first = out["timings"]["prompt_n"], out["content"]
                        require(restored == n, f"{method}: restored {restored} of {n} tokens")
                    _wait_idle(proxy)
                    rows.append(
                        Row(n, method, statistics.median(times), times, moved, restored, evaluated, first)
                    )
                    log(f"B: {method}: {statistics.median(times):.2f} s, {moved / 1e6:.2f} MB")
                times = []
                for i in range(reps):
                    empty_b()
                    t0 = time.perf_counter()
                    copy = f"copy-{n}-{i}.bin"
                    shutil.copyfile(raw[n], b_slots / copy)
                    post_json(b_server + "/slots/0?action=restore", {"filename": copy})
                    out, _, _ = _complete(b_server, prompt, id_slot=0)
                    times.append(time.perf_counter() - t0)
                    (b_slots / copy).unlink()
                require(out["timings"]["prompt_n"] == len(q_b), f"raw copy: {out['timings']}")
                size = raw[n].stat().st_size
                rows.append(
                    Row(
                        n,
                        "raw slot-file copy",
                        statistics.median(times),
                        times,
                        size,
                        n,
                        len(q_b),
                        out["content"],
                    )
                )
                log(f"B: raw copy: {statistics.median(times):.2f} s, {size / 1e6:.2f} MB")
        finally:
            procs.close()

    model = default_model_path().name
    lines = [
        f"# Sharing a prefix across llama-servers: TTFT on B ({model}, llama-server -t 1, "
        f"C = {args.chunk_tokens}, directory store on one host)",
        "",
        "| prefix tokens | method | TTFT s | vs cold | MB moved | kB/token | restored | evaluated "
        "| first token |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    cold = {r.tokens: r.ttft_s for r in rows if r.method == "cold prefill"}
    for r in rows:
        lines.append(
            f"| {r.tokens} | {r.method} | {r.ttft_s:.2f} | {cold[r.tokens] / r.ttft_s:.1f}x | "
            f"{r.bytes_moved / 1e6:.2f} | {r.bytes_moved / r.tokens / 1e3:.1f} | {r.restored} | "
            f"{r.evaluated} | "
            f"{json.dumps(r.first_token)} |"
        )
    lines += [
        "",
        f"TTFT: client wall time of a one-token completion (prefix + {len(q_b)}-token question), median of "
        f"{reps} (cold: one run). MB moved: K/V read from the store per request, or the slot file copied. "
        f"Adaptive: `--slo {SLO_S:g}`.",
    ]
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sharing.md").write_text(text)
    (args.out / "sharing.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(text)
    log(f"done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
