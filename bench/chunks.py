"""Chunked storage (format v3): size and speed against chunk size, and bytes saved by prefix sharing.

    python bench/chunks.py [--tokens 2048] [--reps 3] [--threads 1] [--out bench/results]

Table 1: one real state cut into chunks of 64 ... 1024 tokens and encoded whole, per level: bytes
(statistics + chunks, without and with the chunk headers that carry keys and token ids), overhead
against the whole container, encode and decode throughput (MB/s of state, median of --reps).
Table 2: contexts sharing a document prefix saved into one store with `save_chunked` against one
whole container each. Writes chunks.md into --out.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules, also under runpy

import numpy as np  # noqa: E402
from common import LEVELS, log, median_time, require  # noqa: E402
from llama_cachegen import chunks, codec, quality  # noqa: E402
from llama_cachegen.llama import capture_state, restore_state  # noqa: E402
from llama_cachegen.model import TEXTS, default_model_path, sample_text  # noqa: E402
from report import table  # noqa: E402

CHUNK_SIZES = (64, 128, 256, 512, 1024)
SHARING_LEVEL = "balanced"
SHARED_TOKENS = 1000  # the document every context starts with (not a multiple of any chunk size)
SUFFIX_TOKENS = 200  # each context's own question / continuation
N_CONTEXTS = 4


def _chunked(state: bytes, level: str, c: int, threads: int) -> tuple[list[bytes], int]:
    """The statistics and chunk objects of `state` at chunk size `c` (as `save_chunked` makes them,
    without headers), and the bytes the chunk headers of a real save would add."""
    chunker = codec.Chunker(state, level, threads=threads)
    stats = chunker.stats()
    stats_id = hashlib.sha256(stats).digest()
    n = codec.inspect_state(state)["positions"][1]
    ranges = chunks.chunk_ranges(n, c)
    meta = chunks.ChunkMeta("0" * 64, "0" * 64, level, 0, c, c, "0" * 16, "0" * 64, "0" * 64, np.zeros(c))
    return [stats, *(chunker.chunk(b, e, stats_id) for b, e in ranges)], len(meta.pack()) * len(ranges)


def _decode_chunked(objects: list[bytes], state: np.ndarray, threads: int, together: bool) -> np.ndarray:
    """Opens the statistics and decodes the chunks into `state` (a skeleton state, reused as a load
    reuses its buffer): in one `decode_chunks` call, as a load does with the chunks that have
    arrived, or one `decode_chunk` call each."""
    stats = codec.Stats(objects[0], hashlib.sha256(objects[0]).digest())
    if together:
        codec.decode_chunks(objects[1:], stats, state, threads=threads)
    else:
        for chunk in objects[1:]:
            codec.decode_chunk(chunk, stats, state, threads=threads)
    return state


def size_and_speed(state: bytes, reps: int, threads: int) -> list[tuple[object, ...]]:
    n = codec.inspect_state(state)["positions"][1]
    # Decodes write into buffers made once (fresh ones would add ~18 ms of page faults per call to
    # every row alike): the whole container's, and a skeleton state for the chunks.
    buffer = codec.empty_buffer(len(state))
    rebuilt = codec.skeleton_state(codec.encode_skeleton(state), n, alloc=codec.empty_buffer)
    mbps = len(state) / 1e6
    rows: list[tuple[object, ...]] = []
    for level in LEVELS:
        log(f"chunks: {level}, whole")
        whole = codec.encode(state, level, threads=threads)
        enc = median_time(lambda lv=level: codec.encode(state, lv, threads=threads), reps)
        dec = median_time(lambda w=whole: codec.decode_into(w, buffer, threads=threads), reps)
        require(level != "lossless" or codec.decode(whole) == state, "the whole lossless container differs")
        rows.append((level, "whole", 1, len(whole) / 1e6, 0.0, 0.0, mbps / enc, mbps / dec, None))
        for c in CHUNK_SIZES:
            log(f"chunks: {level}, C = {c}")
            objects, headers = _chunked(state, level, c, threads)
            size = sum(map(len, objects))
            decoded = _decode_chunked(objects, rebuilt, threads, True).tobytes()
            require(
                level != "lossless" or decoded == state, f"lossless chunks of {c} do not rebuild the state"
            )
            each_decoded = _decode_chunked(objects, rebuilt, threads, False).tobytes()
            require(decoded == each_decoded, "decode_chunks differs from decode_chunk")
            enc = median_time(lambda lv=level, c=c: _chunked(state, lv, c, threads), reps)
            dec = median_time(lambda o=objects: _decode_chunked(o, rebuilt, threads, True), reps)
            each = median_time(lambda o=objects: _decode_chunked(o, rebuilt, threads, False), reps)
            overhead = 100 * (size / len(whole) - 1)
            with_headers = 100 * ((size + headers) / len(whole) - 1)
            rows.append(
                (
                    level,
                    c,
                    len(objects),
                    size / 1e6,
                    overhead,
                    with_headers,
                    mbps / enc,
                    mbps / dec,
                    mbps / each,
                )
            )
    return rows


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def sharing(model: Path, threads: int) -> tuple[list[tuple[object, ...]], int]:
    """N_CONTEXTS contexts = one shared document + their own suffix, saved into one store per chunk
    size, against one whole container per context. Returns the rows and the whole bytes."""
    vocab = quality.make_llama(model, n_ctx=64, logits_all=False, vocab_only=True)
    document = vocab.tokenize(sample_text(TEXTS[0]).encode(), add_bos=True)[:SHARED_TOKENS]
    other = vocab.tokenize(sample_text(TEXTS[2]).encode(), add_bos=False)
    require(len(document) == SHARED_TOKENS, f"{TEXTS[0]} holds fewer than {SHARED_TOKENS} tokens")
    require(len(other) >= N_CONTEXTS * SUFFIX_TOKENS, f"{TEXTS[2]} is too short for the suffixes")
    del vocab
    llm = quality.make_llama(model, n_ctx=SHARED_TOKENS + SUFFIX_TOKENS, n_threads=threads, logits_all=False)
    log(f"sharing: prefill of the {SHARED_TOKENS}-token document")
    prefix_state = quality.state_of(llm, document)
    contexts = []
    for k in range(N_CONTEXTS):
        suffix = other[k * SUFFIX_TOKENS : (k + 1) * SUFFIX_TOKENS]
        quality.load_seq_state(llm, prefix_state, 0)
        llm.input_ids[:SHARED_TOKENS] = document
        llm.n_tokens = SHARED_TOKENS
        llm.eval(suffix)
        contexts.append((capture_state(llm, None), document + suffix))
    whole = sum(len(codec.encode(state, SHARING_LEVEL, kind="full_buffer")) for state, _ in contexts)
    rows: list[tuple[object, ...]] = []
    for c in CHUNK_SIZES:
        log(f"sharing: C = {c}")
        with tempfile.TemporaryDirectory() as tmp:
            written = present = 0
            for k, (state, tokens) in enumerate(contexts):
                require(restore_state(llm, state, None), "llama.cpp refused a context's state")
                llm.input_ids[: len(tokens)] = tokens
                llm.n_tokens = len(tokens)
                report = chunks.save_chunked(
                    llm, Path(tmp) / f"ctx{k}", levels=(SHARING_LEVEL,), chunk_tokens=c
                )
                written += report.objects_written
                present += report.objects_present
            stored = _dir_bytes(Path(tmp))
        shared_chunks = SHARED_TOKENS // c
        rows.append((c, shared_chunks, written, present, stored / 1e6, 100 * (1 - stored / whole)))
    return rows, whole


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="context length of the measured state")
    parser.add_argument("--reps", type=int, default=3, help="timing repetitions (median)")
    parser.add_argument("--threads", type=int, default=1, help="codec threads")
    parser.add_argument("--model", type=Path, help="GGUF (default: the bundled SmolLM2-135M)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    model = args.model or default_model_path()
    start = time.perf_counter()

    vocab = quality.make_llama(model, n_ctx=64, logits_all=False, vocab_only=True)
    tokens = vocab.tokenize("\n\n".join(sample_text(t) for t in TEXTS).encode(), add_bos=True)[: args.tokens]
    require(len(tokens) == args.tokens, f"the bundled texts hold fewer than {args.tokens} tokens")
    del vocab
    log(f"prefill of {args.tokens} tokens")
    llm = quality.make_llama(model, n_ctx=args.tokens, n_threads=2, logits_all=False)
    state = quality.state_of(llm, tokens)
    del llm
    rows = size_and_speed(state, args.reps, args.threads)
    share_rows, whole = sharing(model, 2)

    lines = [
        f"# Chunked storage: {args.tokens}-token state of {model.name} ({len(state) / 1e6:.1f} MB f16), "
        f"{args.threads} codec thread(s), median of {args.reps}",
        "",
        "Objects: the level's statistics object + one object per chunk. Overhead against the whole "
        "container of the same level; 'with headers' adds each chunk's key/token header (~300 bytes + "
        "4 bytes per token) that a real save stores. The skeleton (non-K/V bytes, once per save, "
        f"{len(codec.encode_skeleton(state)) / 1e3:.1f} KB here) is left out on both sides.",
        "",
        table(
            (
                "level",
                "chunk tokens",
                "objects",
                "MB",
                "overhead %",
                "with headers %",
                "encode MB/s",
                "decode MB/s",
                "decode MB/s, a call per chunk",
            ),
            rows,
        ),
        "",
        f"## Prefix sharing: {N_CONTEXTS} contexts = one {SHARED_TOKENS}-token document + "
        f"{SUFFIX_TOKENS} tokens each, {SHARING_LEVEL}",
        "",
        f"Against one whole {SHARING_LEVEL} container per context ({whole / 1e6:.2f} MB in all). "
        "The store holds everything a load needs: manifests, skeletons, statistics, chunks.",
        "",
        table(
            ("chunk tokens", "shared chunks", "objects written", "objects reused", "MB stored", "saved %"),
            share_rows,
        ),
    ]
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chunks.md").write_text(text)
    print(text)
    log(f"done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
