"""`llama-cachegen`: demo, compress, decompress, inspect, eval, serve, save, load, llama-server, proxy."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import codec
from .envelope import is_manifest
from .errors import (
    AuthenticationError,
    CacheGenError,
    CorruptDataError,
    InvalidArgumentError,
    ModelMismatchError,
    NotAContainerError,
)
from .llama_format import GGML_TYPES
from .stores import read_url, redact, write_url

DEMO_QUESTION = "\n\nQuestion: What is the name of the license above?\nAnswer:"
# each lossy level promises at most the KL of this llama.cpp cache type (README, "Levels")
LEVEL_PROMISES = {"high": "q8_0", "balanced": "q5_1", "compact": "q4_0"}


def _progress(message: str) -> None:
    print(f"llama-cachegen: {message}", file=sys.stderr, flush=True)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _text(name_or_path: str) -> str:
    from .model import TEXTS, sample_text

    if name_or_path in TEXTS:
        return sample_text(name_or_path)
    try:
        if name_or_path == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        return Path(name_or_path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(
            f"{name_or_path} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None


def _model(path: str | None) -> str:
    from .model import default_model_path

    return str(path or default_model_path())


def _open_model(make: Callable[..., Any], path: str, **kwargs: Any) -> Any:
    """make(path, **kwargs): a llama-cpp-python model; InvalidArgumentError when llama.cpp cannot
    load the file (llama-cpp-python says so with a ValueError)."""
    try:
        return make(path, **kwargs)
    except ValueError as exc:
        raise InvalidArgumentError(f"cannot load the model {path}: {exc}") from None


def _open_llama(path: str, n_ctx: int, threads: int, **kwargs: Any) -> Any:
    """A quiet llama_cachegen.Llama whose prefill runs on `threads` too (llama-cpp-python's
    n_threads_batch defaults to every core: `--threads 1` still prefilled, calibrated and computed
    text chunks on all of them)."""
    from .llama import Llama

    return _open_model(
        Llama, path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False, **kwargs
    )


# --- demo -----------------------------------------------------------------------------------


def _prefill(llm: Any, tokens: list[int]) -> float:
    """Evaluates `tokens` batch by batch with a progress line; returns seconds."""
    start = time.perf_counter()
    for i in range(0, len(tokens), llm.n_batch):
        llm.eval(tokens[i : i + llm.n_batch])
        print(
            f"\r  prefill {min(i + llm.n_batch, len(tokens))}/{len(tokens)} tokens",
            end="",
            file=sys.stderr,
            flush=True,
        )
    print(file=sys.stderr)
    return time.perf_counter() - start


def _answer(llm: Any, prompt: list[int], max_tokens: int) -> tuple[str, int]:
    """Greedy answer and how many prompt tokens llama.cpp evaluated for it."""
    import llama_cpp

    llama_cpp.llama_perf_context_reset(llm.ctx)
    out = llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0)
    return out["choices"][0]["text"], int(llama_cpp.llama_perf_context(llm.ctx).n_p_eval)


def _speedup(prefill_s: float, load_s: float) -> str:
    if load_s < prefill_s:
        return f"{prefill_s / max(load_s, 1e-9):.0f}x faster"
    return f"{load_s / max(prefill_s, 1e-9):.1f}x the prefill's time"


def _demo_worker(args: argparse.Namespace) -> int:
    from .llama import load_compressed_state, save_compressed_state

    llm = _open_llama(args.model, args.n_ctx, args.threads)
    question = llm.tokenize(DEMO_QUESTION.encode(), add_bos=False)
    result: dict[str, Any] = {}
    if args.role == "prefill":
        tokens = llm.tokenize(_text(args.text).encode())[: args.tokens]
        if len(tokens) + len(question) >= args.n_ctx:
            raise InvalidArgumentError(
                f"{len(tokens)} context tokens and the {len(question)}-token question do not fit "
                f"--n-ctx {args.n_ctx}: give a larger --n-ctx or fewer --tokens"
            )
        result["prefill_s"] = _prefill(llm, tokens)
        start = time.perf_counter()
        blob = save_compressed_state(llm, level=args.level, threads=args.threads)
        result["encode_s"] = time.perf_counter() - start
        write_url(args.object, blob)
        info = codec.inspect(blob)
        result.update(tokens=len(tokens), state_bytes=info["state_size"], compressed_bytes=len(blob))
    else:
        report = load_compressed_state(llm, args.object, threads=args.threads)
        result.update(
            load_s=(report.read_ms + report.decode_ms + report.restore_ms) / 1e3,
            decode_ms=report.decode_ms,
            tokens=report.tokens,
        )
        tokens = llm.input_ids[: llm.n_tokens].tolist()
    result["answer"], result["evaluated"] = _answer(llm, tokens + question, args.max_tokens)
    print(json.dumps(result))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .model import cache_dir

    model = _model(args.model)
    store = args.store or (cache_dir() / "demo-store").as_uri()
    obj = f"{store.rstrip('/')}/demo-{args.level}.lcg"
    common = [
        "--model",
        model,
        "--text",
        args.text,
        "--tokens",
        str(args.tokens),
        "--n-ctx",
        str(args.n_ctx),
        "--level",
        args.level,
        "--threads",
        str(args.threads),
        "--object",
        obj,
        "--max-tokens",
        str(args.max_tokens),
    ]
    runs = {}
    for step, role, what in (
        (1, "prefill", f"prefill {args.tokens} tokens of {args.text}, save compressed"),
        (2, "load", "load the compressed state, answer"),
    ):
        _progress(f"[{step}/2] process {step}: {what}")
        proc = subprocess.run(
            [sys.executable, "-m", "llama_cachegen", "_demo-worker", "--role", role, *common],
            stdout=subprocess.PIPE,
            text=True,
            check=False,
        )
        if proc.returncode:
            _progress(f"process {step} failed (exit {proc.returncode})")
            return 1
        runs[role] = json.loads(proc.stdout.strip().splitlines()[-1])
    first, second = runs["prefill"], runs["load"]
    match = first["answer"] == second["answer"]
    summary = {
        "tokens": first["tokens"],
        "state_bytes": first["state_bytes"],
        "compressed_bytes": first["compressed_bytes"],
        "ratio": first["state_bytes"] / first["compressed_bytes"],
        "prefill_s": first["prefill_s"],
        "load_s": second["load_s"],
        "answer_uncompressed": first["answer"],
        "answer_restored": second["answer"],
        "answer_matches": match,
        "tokens_evaluated_after_load": second["evaluated"],
        "level": args.level,
        "object": obj,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    rows = [
        ("tokens", str(first["tokens"])),
        ("f16 state", _size(first["state_bytes"])),
        (f"compressed ({args.level})", _size(first["compressed_bytes"])),
        ("ratio", f"{summary['ratio']:.2f}x"),
        ("prefill (process 1)", f"{first['prefill_s']:.2f} s"),
        ("load (process 2)", f"{second['load_s']:.3f} s  ({_speedup(first['prefill_s'], second['load_s'])})"),
        ("tokens evaluated after load", f"{second['evaluated']} (the question only)"),
        ("answer matches uncompressed", "yes" if match else "no"),
    ]
    print(_table(rows))
    print(
        f"\nuncompressed answer: {first['answer'].strip()!r}"
        f"\nrestored answer:     {second['answer'].strip()!r}"
    )
    if not match and args.level != "lossless":
        promise = LEVEL_PROMISES.get(args.level)
        print(
            f"\n{args.level} is lossy: it keeps the next-token distributions at least as close as "
            f"llama.cpp's {promise} cache does (KL), not every greedy token; --level lossless restores "
            "the context exactly, and `llama-cachegen eval` measures the KL of each level on this model."
            if promise
            else f"\n{args.level} is lossy: --level lossless restores the context exactly."
        )
    return 0


# --- compress / decompress / inspect ---------------------------------------------------------


def _same_object(a: str, b: str) -> bool:
    """True when two paths or URLs name one object (for local files: the same file on disk)."""
    from .stores import is_local, split_url
    from .stores.file import path_of

    if is_local(a) != is_local(b):
        return False
    if not is_local(a):
        return split_url(a) == split_url(b)
    pa, pb = path_of(a), path_of(b)
    if pa.exists() and pb.exists():
        return os.path.samefile(pa, pb)
    return pa.resolve() == pb.resolve()


def _check_output(args: argparse.Namespace) -> None:
    if not args.force and _same_object(str(args.input), str(args.output)):
        raise InvalidArgumentError(
            f"{args.output} is the input too: give another output, or --force to replace the input"
        )


def _read_state(url: str) -> bytes:
    """An object that may be a llama.cpp state (a slot or session file): llama.cpp tags none, so
    with LLAMA_CACHEGEN_KEY set an untagged one is read as it is (it was refused: no slot file
    could be compressed); a container or manifest must still carry its tag."""
    try:
        return read_url(url)
    except AuthenticationError:
        data = read_url(url, auth_key="")
        try:
            codec.inspect(data)
        except NotAContainerError:
            if not is_manifest(data):
                return data
        raise


def _compress(args: argparse.Namespace) -> int:
    _check_output(args)
    data = _read_state(args.input)
    start = time.perf_counter()
    blob = codec.encode(data, args.level, kind=args.kind, threads=args.threads)
    seconds = time.perf_counter() - start
    write_url(args.output, blob)
    result = {
        "input": str(args.input),
        "output": str(args.output),
        "state_bytes": len(data),
        "compressed_bytes": len(blob),
        "ratio": len(data) / len(blob),
        "level": args.level,
        "seconds": seconds,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{redact(args.input)} -> {redact(args.output)}: {_size(len(data))} -> {_size(len(blob))} "
            f"({result['ratio']:.2f}x, {args.level}) in {seconds:.2f} s"
        )
    return 0


def _not_a_container(name: str, data: bytes, exc: NotAContainerError, doing: str) -> NotAContainerError:
    """The error for `data` that is not a container (nor, `load`, a manifest): what it is instead,
    when it is a manifest or a llama.cpp state, else `exc`."""
    if is_manifest(data):
        return NotAContainerError(
            f"{name} is a chunked context's manifest, not a container: its K/V is in chunks in its "
            f"store, restored into a model by `llama-cachegen load {name} --model GGUF` "
            "(or llama_cachegen.load_chunked)"
        )
    try:
        kind = codec.inspect_state(data)["kind"]
    except CacheGenError:
        return exc
    return NotAContainerError(
        f"{name} is a llama.cpp state ({kind}), not a container: there is nothing to {doing} "
        "(`llama-cachegen compress` makes a container of it)"
    )


def _decompress(args: argparse.Namespace) -> int:
    _check_output(args)
    blob = read_url(args.input)
    start = time.perf_counter()
    try:
        part = codec.inspect(blob)["part"]
    except NotAContainerError as exc:
        raise _not_a_container(str(args.input), blob, exc, "decompress") from None
    if part != "whole":  # a skeleton would decode to its state with every K/V byte zero
        raise InvalidArgumentError(
            f"{args.input} is a chunked context's {part} object, not a whole container: its context "
            "loads through its manifest (`llama-cachegen load MANIFEST --model GGUF`)"
        )
    data = codec.decode(blob, threads=args.threads)
    seconds = time.perf_counter() - start
    write_url(args.output, data, auth_key="")  # for llama.cpp, which reads no tag
    result = {
        "input": str(args.input),
        "output": str(args.output),
        "compressed_bytes": len(blob),
        "state_bytes": len(data),
        "seconds": seconds,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        sizes = f"{_size(len(blob))} -> {_size(len(data))}"
        print(f"{redact(args.input)} -> {redact(args.output)}: {sizes} in {seconds:.2f} s")
    return 0


def _envelope(blob: bytes) -> dict[str, Any] | None:
    """The llama-cpp-python envelope of a container, when it has one and llama_cpp is installed."""
    try:
        from .llama import StateMeta
    except ImportError:
        return None
    try:
        meta = StateMeta.unpack(codec.user_meta(blob))
    except CacheGenError:
        return None
    info = {
        "scope": meta.scope,
        "seq_id": meta.seq_id,
        "n_ctx": meta.n_ctx,
        "tokens": int(meta.tokens.size),
        "last_logits": meta.logits is not None,
        "fingerprint": meta.fingerprint,
    }
    if meta.lossy is not None:  # the level says how it was stored, not what the saver held
        info["saved from"] = _lossy_record(meta.lossy)
    return info


def _lossy_record(lossy: tuple[int, str]) -> str:
    return f"K/V decoded from {lossy[1]} from position {lossy[0]} on: no level restores more than that"


def _manifest_info(data: bytes) -> dict[str, Any]:
    """What a chunked context's manifest says: chunks, levels and sizes, chunks shared with earlier saves."""
    from .chunks import Manifest

    m = Manifest.unpack(data)
    info: dict[str, Any] = {
        "type": "llama-cachegen manifest",
        "tokens": int(m.meta.tokens.size),
        "scope": m.meta.scope,
        "chunk_tokens": m.chunk_tokens,
        "levels": list(m.levels),
        "fingerprint": m.meta.fingerprint,
    }
    if m.meta.lossy is not None:  # the levels say how it was stored, not what the saver held
        info["saved from"] = _lossy_record(m.meta.lossy)
    if m.chunk_tokens is None:
        info["wholes"] = {level: {"id": i, "bytes": size} for level, (i, size) in m.wholes.items()}
        return info
    info["chunks"] = len(m.chunks)
    info["skeleton"] = m.skeleton
    info["stats"] = m.stats
    info["bytes written by this save"] = {
        level: sum(c.sizes.get(level) or 0 for c in m.chunks) for level in m.levels
    }
    info["chunks stored by earlier saves"] = {
        level: sum(1 for c in m.chunks if level in c.sizes and c.sizes[level] is None) for level in m.levels
    }
    return info


def _checksums(data: bytes, part: str) -> str:
    """Checks every checksum of a container (codec.inspect checks those of its header and layout only)
    by opening what it holds: "ok", "FAILED (the library's message)", or why a chunk is not checked."""
    if part == "chunk":
        return "not checked (a chunk is checked when decoded with its statistics)"
    try:
        if part == "stats":
            codec.Stats(data, hashlib.sha256(data).digest())
        else:
            codec.decode(data)
    except CorruptDataError as exc:
        return f"FAILED ({exc})"
    return "ok"


def _inspect(args: argparse.Namespace) -> int:
    data = _read_state(args.file)
    try:
        if is_manifest(data):
            info: dict[str, Any] = _manifest_info(data)
        else:
            info = {"type": "llama-cachegen container", **codec.inspect(data)}
            if info["part"] in ("chunk", "stats"):  # a state's figures: 0 here, which reads as a fact
                for key in ("tokens", "state_size", "ratio", "chunkable"):
                    info[key] = None
            envelope = _envelope(data)
            if envelope is not None:
                info["llama_cpp_python"] = envelope
            info["checksums"] = _checksums(data, info["part"])
    except NotAContainerError:
        info = {"type": "llama.cpp state", **codec.inspect_state(data, args.kind)}
    status = 1 if info.get("checksums", "").startswith("FAILED") else 0
    if args.json:
        print(json.dumps(info, indent=2))
        return status
    print(f"{args.file}: {info.pop('type')}")
    for key, value in info.items():
        if value is None:  # a field this object does not have (a chunk's stats id, fixed steps)
            continue
        if isinstance(value, dict):
            print(f"  {key}:")
            for k, v in value.items():
                print(f"    {k}: {v}")
        elif isinstance(value, float):
            print(f"  {key}: {value:.4g}")
        else:
            print(f"  {key}: {value}")
    return status


# --- eval ------------------------------------------------------------------------------------


FLOOR_METHOD = "llama.cpp f16, flash attention (noise floor)"
# a level and its reference both below this multiple of the floor: the text cannot tell them apart
FLOOR_MARGIN = 1.5
BROKEN_REFERENCE_KL = 0.25  # a reference cache type past this mean KL has lost the model's way
# KL per token below this is float rounding: a model of f32 weights has a floor near 1e-16, where
# "within 1.5x the floor" never holds, and verdicts between 1e-10 and 1e-9 would mean nothing
NEGLIGIBLE_KL = 1e-6


def _eval(args: argparse.Namespace) -> int:
    from .llama import require_kv_cache
    from .quality import compare_logits, continuation_logits, make_llama, state_of

    model = _model(args.model)
    text = _text(args.text).encode()
    if args.tokens + args.cont > len(text) + 1:  # a token spans a byte at least (BOS aside)
        raise CacheGenError(f"{args.text} has {len(text)} bytes, fewer than --tokens + --cont tokens need")
    n_ctx = args.tokens + args.cont + 64
    _progress(f"loading {model}")
    llm = _open_model(make_llama, model, n_ctx=n_ctx, n_threads=args.threads)
    require_kv_cache(llm)
    all_tokens = llm.tokenize(text)
    if len(all_tokens) < args.tokens + args.cont:
        raise CacheGenError(f"{args.text} has {len(all_tokens)} tokens, fewer than --tokens + --cont")
    prefix, cont = all_tokens[: args.tokens], all_tokens[args.tokens : args.tokens + args.cont]
    _progress(f"prefill {len(prefix)} tokens, reference logits over {len(cont)} more")
    f16_state = state_of(llm, prefix)
    f16_ref = continuation_logits(llm, f16_state, prefix, cont)
    fa_ref = None
    if args.cache_types or args.kv_type != "f16":
        # llama.cpp quantizes the V cache only with flash attention: the cache types (and the
        # levels on such a cache) are compared with an f16 cache computed the same way (flash on
        # vs off alone differs by a noise floor)
        _progress("f16 cache with flash attention")
        fllm = make_llama(model, n_ctx=n_ctx, n_threads=args.threads, flash_attn=True)
        fa_ref = continuation_logits(fllm, None, prefix, cont)
        fllm.close()
    state, ref = f16_state, f16_ref
    if args.kv_type != "f16":  # the levels encode the state of a context with that cache
        llm.close()
        _progress(f"prefill with a {args.kv_type} cache")
        kv = {"flash_attn": True, "type_k": args.kv_type, "type_v": args.kv_type}
        try:
            llm = make_llama(model, n_ctx=n_ctx, n_threads=args.threads, **kv)
        except ValueError:  # llama-cpp-python: "Failed to create llama_context"
            raise CacheGenError(
                f"llama.cpp makes no context with a {args.kv_type} cache for this model"
            ) from None
        state, ref = state_of(llm, prefix), fa_ref
    rows: list[dict[str, Any]] = []
    exact: list[str] = []  # levels that gave the state back as it was
    for level in args.levels:
        _progress(f"level {level}")
        start = time.perf_counter()
        blob = codec.encode(state, level, kind="seq_buffer", threads=args.threads)
        encode_s = time.perf_counter() - start
        restored = codec.decode(blob, threads=args.threads)
        metrics = compare_logits(ref, continuation_logits(llm, restored, prefix, cont), cont)
        if restored == state:
            exact.append(level)
        rows.append(
            {
                "method": f"llama-cachegen {level}",
                "bytes": len(blob),
                "ratio": len(f16_state) / len(blob),
                "encode_s": encode_s,
                **metrics,
            }
        )
    if fa_ref is not None and args.cache_types:
        # The f16 cache, computed with flash attention: how far an exact cache moves the
        # logits through the model's own rounding (quantized weights quantize their activations,
        # so any perturbation flips some of them). Lossy levels and cache types sit on this floor.
        rows.append(
            {
                "method": FLOOR_METHOD,
                "bytes": len(f16_state),
                "ratio": 1.0,
                **compare_logits(f16_ref, fa_ref, cont),
            }
        )
    for name in args.cache_types:
        _progress(f"llama.cpp cache type {name}")
        if name == args.kv_type != "f16":  # the (flash) context the levels encoded: no second prefill
            qstate = state
            metrics = compare_logits(fa_ref, continuation_logits(llm, state, prefix, cont), cont)
        else:
            try:
                qllm = make_llama(
                    model, n_ctx=n_ctx, n_threads=args.threads, flash_attn=True, type_k=name, type_v=name
                )
            except ValueError:  # llama-cpp-python: "Failed to create llama_context"
                _progress(f"llama.cpp makes no context with a {name} cache for this model: not compared")
                continue
            qstate = state_of(qllm, prefix)
            metrics = compare_logits(fa_ref, continuation_logits(qllm, qstate, prefix, cont), cont)
            qllm.close()
        rows.append(
            {
                "method": f"llama.cpp {name}",
                "bytes": len(qstate),
                "ratio": len(f16_state) / len(qstate),
                **metrics,
            }
        )
    kl = {r["method"]: r["kl"] for r in rows}
    # a level that carries a quantized cache exactly (q8_0 at `high`, q4_0 at every level) has
    # that cache's own KL: there is no promise of the level's to check
    exact_on_kv = [lv for lv in exact if args.kv_type != "f16" and lv in LEVEL_PROMISES]
    promises = {
        level: {
            "reference": ref_type,
            "kl": kl[f"llama-cachegen {level}"],
            "reference_kl": kl[f"llama.cpp {ref_type}"],
        }
        for level, ref_type in LEVEL_PROMISES.items()
        if f"llama-cachegen {level}" in kl and f"llama.cpp {ref_type}" in kl and level not in exact_on_kv
    }
    floor = kl.get(FLOOR_METHOD)
    for p in promises.values():
        p["holds"] = p["kl"] <= p["reference_kl"]
        worst = max(p["kl"], p["reference_kl"])
        p["negligible"] = worst <= NEGLIGIBLE_KL
        p["within_floor"] = p["negligible"] or (floor is not None and worst <= FLOOR_MARGIN * floor)
        # llama.cpp's own cache type may wreck a model (Qwen2.5's q5_1 / q4_0: KL 0.3-8, where
        # SmolLM2's q4_0 is 0.06, Gemma 3's 0.13): the promise then holds by a margin that says little
        p["reference_broken"] = p["reference_kl"] > BROKEN_REFERENCE_KL
    result = {
        "model": model,
        "text": args.text,
        "tokens": len(prefix),
        "cont": len(cont),
        "state_bytes": len(f16_state),
        "kv_type": args.kv_type,
        "kv_state_bytes": len(state),
        "exact_on_kv": exact_on_kv,
        "floor_kl": floor,
        "rows": rows,
        "promises": promises,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    kv_state = (
        f", {args.kv_type} state {_size(len(state))} (what the levels encode)"
        if args.kv_type != "f16"
        else ""
    )
    print(
        f"{len(prefix)} tokens of {args.text}, f16 state {_size(len(f16_state))}{kv_state}; sizes against "
        f"the f16 state, quality over the next {len(cont)} tokens against an f16 cache"
    )
    table = [("method", "size", "ratio", "KL", "top-1", "Δppl")]
    table += [
        (
            r["method"],
            _size(r["bytes"]),
            f"{r['ratio']:.2f}x",
            f"{r['kl']:.4g}",
            f"{r['top1']:.3f}",
            f"{r['dppl']:+.4g}",
        )
        for r in rows
    ]
    print(_table(table))
    for level in exact_on_kv:
        print(
            f"{level}: carries the {args.kv_type} cache exactly (its KL is the cache's own): "
            "no promise to check"
        )
    for level, ref_type in LEVEL_PROMISES.items():
        if (
            level in args.levels
            and level not in promises
            and level not in exact_on_kv
            and ref_type in args.cache_types
        ):
            print(f"{level}: not measured (llama.cpp could not run a {ref_type} cache on this model)")
    for level, p in promises.items():
        verdict = "holds" if p["holds"] else "DOES NOT HOLD"
        noise = ""
        if p["negligible"]:
            noise = f" (both at most {NEGLIGIBLE_KL:g} per token: float rounding, not a measured difference)"
        elif p["within_floor"]:
            floor_is = f"{FLOOR_MARGIN}x the noise floor {floor:.4f}"
            noise = f" (both within {floor_is}: this text barely tells them apart)"
        print(
            f"{level}: KL {p['kl']:.4g} vs llama.cpp {p['reference']}'s {p['reference_kl']:.4g}: "
            f"the promise (at most {p['reference']}'s KL) {verdict} on this model and text{noise}"
        )
        if p["reference_broken"]:
            q8 = kl.get("llama.cpp q8_0")
            against = f"; {level}'s KL is {p['kl'] / q8:.1f}x q8_0's" if q8 else ""
            print(
                f"  llama.cpp's {p['reference']} cache itself breaks this model (KL over "
                f"{BROKEN_REFERENCE_KL:g} per token): the promise bounds little here{against}"
            )
    return 0


# --- serve -----------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    from .stores.http import load_token, serve

    limits = {k: v for k, v in (("max_body", args.max_body), ("body_timeout", args.body_timeout)) if v}
    token = load_token(args.token_file)
    serve(args.dir, args.host, args.port, token=token, private=args.private, verbose=args.verbose, **limits)
    return 0


# --- save / load (chunked contexts, adaptive streaming) ------------------------------------------


def _tokenize(model: str, text: str) -> list[int]:
    """`text`'s token ids as Llama.tokenize gives them (BOS first), from the model's vocabulary
    alone: the context is then sized to them."""
    import llama_cpp
    from llama_cpp import _internals

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    vocab = _open_model(
        lambda path: _internals.LlamaModel(path_model=path, params=params, verbose=False), model
    )
    try:
        return vocab.tokenize(text.encode(), add_bos=True, special=False)
    finally:
        vocab.close()


def _save(args: argparse.Namespace) -> int:
    """Prefills a text and saves the context in chunks under a manifest URL (what `load` and
    `load_prefix` read): a progress line while it prefills, then what went into the store."""
    import llama_cpp

    from .chunks import DEFAULT_LEVELS, save_chunked
    from .llama import model_n_ctx_train

    model = _model(args.model)
    tokens = _tokenize(model, _text(args.text))[: args.tokens]
    if not tokens:
        raise InvalidArgumentError(f"{args.text} holds no tokens: there is no context to save")
    if args.n_ctx is not None and len(tokens) > args.n_ctx:
        raise InvalidArgumentError(
            f"{len(tokens)} tokens do not fit --n-ctx {args.n_ctx}: give a larger --n-ctx or fewer --tokens"
        )
    n_ctx_train = None if args.n_ctx else model_n_ctx_train(model)
    if n_ctx_train and len(tokens) > n_ctx_train:  # what `load` refuses without --n-ctx
        raise InvalidArgumentError(
            f"{len(tokens)} tokens, more than {model}'s training context ({n_ctx_train}): give --n-ctx to "
            "save them anyway, or fewer --tokens"
        )
    llm = _open_llama(
        model,
        args.n_ctx or max(len(tokens), 1),
        args.threads,
        flash_attn=args.flash_attn,
        type_k=GGML_TYPES[args.cache_type_k],
        type_v=GGML_TYPES[args.cache_type_v],
    )
    prefill_s = _prefill(llm, tokens)
    levels = args.levels or DEFAULT_LEVELS
    report = save_chunked(llm, args.url, levels=levels, chunk_tokens=args.chunk_tokens, threads=args.threads)
    state_bytes = int(llama_cpp.llama_state_get_size(llm.ctx))
    if args.json:
        print(
            json.dumps(
                {**dataclasses.asdict(report), "prefill_s": prefill_s, "state_bytes": state_bytes}, indent=2
            )
        )
        return 0
    how = f"{report.chunks} chunks of {report.chunk_tokens} tokens" if report.chunk_tokens else "whole"
    rows = [
        ("tokens", f"{report.n_tokens} (prefilled in {prefill_s:.2f} s)"),
        ("state", f"{_size(state_bytes)}, saved {how}"),
    ]
    for level in levels:
        n = report.level_bytes.get(level, 0)  # none: every chunk of the level was stored before
        # a ratio only where the store had nothing of the context: level_bytes leaves out what it had
        whole = n and report.objects_present == 0
        rows.append((level, f"{_size(n)} written" + (f" ({state_bytes / n:.2f}x)" if whole else "")))
    rows += [
        ("objects", f"{report.objects_written} written, {report.objects_present} stored before"),
        ("manifest", report.url),
    ]
    print(_table(rows))
    if report.fallback:
        print(f"\nsaved whole: {report.fallback}")
    return 0


def _context_params(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """llama-cpp-python's settings for a context laid out as the one that saved `fingerprint`:
    a state saved with flash attention, a quantized cache or a sliding-window cache of its own
    size loads only into such a context (the load refused a context made with the defaults, and
    the CLI had no option to make another)."""
    params: dict[str, Any] = {}
    for field in ("type_k", "type_v"):
        if fingerprint.get(field) in GGML_TYPES:
            params[field] = GGML_TYPES[fingerprint[field]]
    if fingerprint.get("flash_attn") in ("enabled", "disabled"):  # "auto" is llama.cpp's choice
        params["flash_attn"] = fingerprint["flash_attn"] == "enabled"
    if isinstance(fingerprint.get("swa_full"), bool):
        params["swa_full"] = fingerprint["swa_full"]
    return params


def _load(args: argparse.Namespace) -> int:
    """Streams a chunked context into a fresh llama.cpp context: a progress bar per chunk, then the
    report (stream.StreamReport.to_dict with --json)."""
    from tqdm import tqdm

    from . import chunks
    from .llama import StateMeta, check_fingerprint, model_fingerprint, model_n_ctx_train
    from .stream import ChunkRecord, load_streaming

    if args.prompt == "" or (args.max_tokens is not None and not args.prompt):
        raise InvalidArgumentError("--max-tokens goes with a --prompt, which is not empty")
    max_tokens = args.max_tokens or 32
    start = time.perf_counter()
    data = read_url(args.url)  # read first, to size the context: on the SLO's clock too
    manifest_s = time.perf_counter() - start
    model = _model(args.model)
    n_chunks, n_ctx, saved = 1, args.n_ctx, None
    if is_manifest(data):
        m = chunks.Manifest.unpack(data)
        n_chunks = max(1, len(m.chunks))
        n_tokens = int(m.meta.tokens.size)
        n_ctx_train = None if n_ctx else model_n_ctx_train(model)
        if n_ctx_train and n_tokens > n_ctx_train:
            # the context is sized from the manifest before its chunks are read: a forged count
            # (60,000 tokens of SmolLM2: 1.5 GB) would be allocated first and refused only then
            raise InvalidArgumentError(
                f"{redact(args.url)} holds {n_tokens} tokens, more than {model}'s training context "
                f"({n_ctx_train}); give --n-ctx to load it anyway"
            )
        # room for the question and its answer (a token is at least a byte of the prompt)
        n_ctx = n_ctx or n_tokens + 256 + (len(args.prompt.encode()) + max_tokens if args.prompt else 0)
        saved = m.meta.fingerprint
    else:  # a whole container: its envelope, when it has one (else the load says what it is)
        try:
            codec.inspect(data)
        except NotAContainerError as exc:
            raise _not_a_container(redact(args.url), data, exc, "load") from None
        with contextlib.suppress(CacheGenError):
            saved = StateMeta.unpack(codec.user_meta(data)).fingerprint
    llm = _open_llama(model, n_ctx or 4096, args.threads, **_context_params(saved or {}))
    if saved is not None and args.model is None:  # what the load would refuse, with what to do
        try:
            check_fingerprint(saved, model_fingerprint(llm))
        except ModelMismatchError as exc:
            raise ModelMismatchError(
                f"{exc} (the default model: name the saver's with --model GGUF)"
            ) from None
    bar = tqdm(total=n_chunks, unit="chunk", file=sys.stderr, disable=args.json or None)

    def progress(record: ChunkRecord) -> None:
        rate = record.bytes / record.fetch_ms / 1e3 if record.fetch_ms and record.bytes else 0.0
        bar.set_postfix_str(f"chunk {record.index}: {record.level}" + (f", {rate:.1f} MB/s" if rate else ""))
        bar.update(1)

    try:
        report = load_streaming(
            llm,
            args.url,
            slo_s=None if args.slo is None else max(args.slo - manifest_s, 1e-3),
            prior_mbps=args.prior_mbps,
            compute_tps=args.compute_tps,
            level=args.level,
            threads=args.threads,
            progress=progress,
            manifest=data,  # a whole container too: read once, and counted once in the SLO
        )
    finally:
        bar.close()
    # the report from the manifest's read on (1 MB of Gemma 3's last logits took 1.2 s at 8 Mbit/s)
    report.total_ms += manifest_s * 1e3
    report.slo_s = args.slo
    result = report.to_dict()
    if args.prompt:
        context = llm.input_ids[: llm.n_tokens].tolist()
        question = llm.tokenize(args.prompt.encode(), add_bos=False)
        if len(context) + len(question) >= llm.n_ctx():
            raise InvalidArgumentError(
                f"{len(context)} context tokens and the {len(question)}-token prompt do not fit the "
                f"context's {llm.n_ctx()} tokens: give a larger --n-ctx"
            )
        result["answer"], result["prompt_tokens_evaluated"] = _answer(llm, context + question, max_tokens)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    header = ("chunk", "tokens", "level", "why", "bytes", "fetch ms", "decode ms", "compute ms", "Mbit/s")
    rows = [header]
    rows += [
        (
            str(c["index"]),
            f"{c['begin']}-{c['end']}",
            c["level"] if c["upgraded_from"] is None else f"{c['upgraded_from']} -> {c['level']}",
            c["reason"] + (f", {c['given_up']} given up" if c["given_up"] else ""),
            _size(c["bytes"]),
            f"{c['fetch_ms']:.0f}",
            f"{c['decode_ms']:.1f}",
            f"{c['compute_ms']:.0f}",
            "—" if c["mbps"] is None else f"{c['mbps']:.1f}",
        )
        for c in result["chunks"]
    ]
    print(_table(rows))
    slo = "no SLO" if args.slo is None else f"SLO {args.slo:g} s {'met' if report.slo_met else 'MISSED'}"
    print(
        f"\n{result['tokens']} tokens loaded in {result['total_ms']:.0f} ms ({slo}); "
        f"{_size(result['bytes_read'])} read; expected KL {result['expected_kl']:.4f}; "
        f"levels {result['levels']}"
    )
    if result["calibrate_ms"] >= 1:  # a first load per process and model: say where the time went
        print(
            f"this CPU's prefill speed measured in {result['calibrate_ms']:.0f} ms of it "
            "(once per process, beside the manifest's read; --compute-tps skips it)"
        )
    for line in result["failures"]:
        print(f"failure: {line}")
    if result["fallback"]:
        print(f"fallback: {result['fallback']}")
    if args.prompt:
        print(
            f"\nanswer ({result['prompt_tokens_evaluated']} prompt tokens evaluated): "
            f"{result['answer'].strip()!r}"
        )
    return 0


# --- llama-server / proxy ---------------------------------------------------------------------


def _llama_server(argv: list[str]) -> int:
    """Runs the llama-server built from llama-cpp-python's llama.cpp (built once if missing) with
    `argv` as its arguments, untouched (so `llama-cachegen llama-server --help` is the server's)."""
    from .server import llama_server_path

    try:
        path = llama_server_path(build=True)
    except CacheGenError as exc:
        print(f"llama-cachegen llama-server: error: {_message(exc)}", file=sys.stderr)
        return 1
    try:
        os.execv(path, [str(path), *argv])
    except OSError as exc:
        print(f"llama-cachegen llama-server: error: cannot run {path}: {_message(exc)}", file=sys.stderr)
        return 1


def _proxy(args: argparse.Namespace) -> int:
    from .proxy import run_proxy

    run_proxy(args)
    return 0


# --- arguments -------------------------------------------------------------------------------


def _number(kind: type[int] | type[float], low: float, what: str) -> Callable[[str], Any]:
    """An argparse type: a finite `kind` of at least `low`."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}") from None
        if not (math.isfinite(value) and value >= low):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    return parse


_COUNT = _number(int, 1, "a positive integer")
_SECONDS = _number(float, 1e-3, "a positive number of seconds")


def _port(text: str) -> int:
    port = _number(int, 0, "a port number (0-65535)")(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number (0-65535), got {text}")
    return int(port)


def _llama_args(p: argparse.ArgumentParser, tokens: int) -> None:
    p.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument(
        "--text", default="gpl-3.0.txt", help="a text file or a bundled text (default: %(default)s)"
    )
    p.add_argument("--tokens", type=_COUNT, default=tokens, help="context tokens (default: %(default)s)")
    _threads_arg(p)


def _threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=_COUNT,
        default=min(os.cpu_count() or 1, 8),
        help="CPU threads (default: %(default)s)",
    )


def _worker_parser() -> argparse.ArgumentParser:
    """One process of the demo (`_demo-worker`): internal, so not among the commands of --help."""
    p = argparse.ArgumentParser(prog="llama-cachegen _demo-worker")
    _llama_args(p, 1536)
    for flag in ("--role", "--object", "--level"):
        p.add_argument(flag, required=True)
    p.add_argument("--n-ctx", type=_COUNT, required=True)
    p.add_argument("--max-tokens", type=_COUNT, required=True)
    p.set_defaults(func=_demo_worker, command="_demo-worker")
    return p


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llama-cachegen", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    levels = list(codec.LEVELS)

    p = sub.add_parser("demo", help="prefill in one process, load compressed in another, compare answers")
    _llama_args(p, 1536)
    p.add_argument("--n-ctx", type=_COUNT, default=2048)
    p.add_argument("--level", choices=levels, default="balanced")
    p.add_argument("--store", help="store URL for the state (default: a folder in the cache directory)")
    p.add_argument("--max-tokens", type=_COUNT, default=10, help="answer length in tokens")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_demo)

    force = "replace OUTPUT even when it is INPUT (written atomically: the input stays whole until then)"
    p = sub.add_parser("compress", help="compress a llama.cpp state file (any supported kind)")
    p.add_argument("input", help="state file: path or store URL")
    p.add_argument("output", help="container: path or store URL")
    p.add_argument("--level", choices=levels, default="balanced")
    p.add_argument("--kind", choices=list(codec.KINDS), default="auto")
    _threads_arg(p)
    p.add_argument("--force", action="store_true", help=force)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_compress)

    p = sub.add_parser("decompress", help="restore the llama.cpp state bytes of a container")
    p.add_argument("input")
    p.add_argument("output")
    _threads_arg(p)
    p.add_argument("--force", action="store_true", help=force)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_decompress)

    p = sub.add_parser("inspect", help="describe a container or a raw llama.cpp state file")
    p.add_argument("file")
    p.add_argument("--kind", choices=list(codec.KINDS), default="auto", help="state kind of a raw state")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("eval", help="quality and size per level, vs llama.cpp's quantized cache types")
    _llama_args(p, 1024)
    p.add_argument(
        "--cont",
        type=_number(int, 2, "an integer of at least 2"),
        default=256,
        help="teacher-forced continuation tokens (default: %(default)s)",
    )
    p.add_argument("--levels", nargs="+", choices=levels, default=levels)
    p.add_argument(
        "--kv-type",
        choices=list(GGML_TYPES),
        default="f16",
        help="the levels encode a context with this K/V cache type (other than f16: with flash "
        "attention; q8_0 is coded lossily at balanced and compact, the other quantized types "
        "exactly; default: %(default)s)",
    )
    p.add_argument(
        "--cache-types",
        nargs="*",
        choices=list(GGML_TYPES),
        default=list(LEVEL_PROMISES.values()),
        help="llama.cpp KV types to compare (default: each level's reference)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_eval)

    p = sub.add_parser("serve", help="serve a directory as an HTTP store (GET/PUT/HEAD/DELETE)")
    p.add_argument("--dir", required=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument(
        "--port",
        type=_port,
        default=8080,
        help="default: %(default)s; 0 picks a free port (printed on stderr)",
    )
    p.add_argument(
        "--token-file",
        help="file holding the bearer token that writes, deletes and listings need "
        "(default: $LLAMA_CACHEGEN_TOKEN; without a token only a loopback --host is accepted)",
    )
    p.add_argument("--private", action="store_true", help="reads need the token too")
    p.add_argument("--max-body", type=_COUNT, help="largest upload in bytes (default: 8 GiB)")
    p.add_argument(
        "--body-timeout",
        type=_SECONDS,
        help="seconds an upload may send nothing, or a reply's write to a client may stall, before "
        "the connection is dropped (default: 60)",
    )
    p.add_argument("--verbose", action="store_true", help="log every request")
    p.set_defaults(func=_serve)

    p = sub.add_parser("save", help="prefill a text and save the context in chunks (what load reads)")
    p.add_argument("url", help="the context's manifest: path or store URL")
    p.add_argument("--text", required=True, help="a text file, a bundled text, or - for standard input")
    p.add_argument("--tokens", type=_COUNT, help="the text's first N tokens only (default: all)")
    p.add_argument("--levels", nargs="+", choices=levels, help="levels to store (default: the lossy ones)")
    p.add_argument("--chunk-tokens", type=_COUNT, default=256, help="tokens per chunk (default: %(default)s)")
    p.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("--n-ctx", type=_COUNT, help="context size (default: the text's tokens)")
    p.add_argument("--flash-attn", action="store_true", help="flash attention (a load then uses it too)")
    for which in ("k", "v"):
        p.add_argument(
            f"--cache-type-{which}",
            choices=list(GGML_TYPES),
            default="f16",
            help="KV cache type (default: %(default)s)",
        )
    _threads_arg(p)
    p.add_argument("--json", action="store_true", help="print what was saved as JSON")
    p.set_defaults(func=_save)

    p = sub.add_parser("load", help="stream a chunked context into llama.cpp: per chunk a level or text")
    p.add_argument("url", help="the context's manifest: path or store URL")
    p.add_argument(
        "--slo",
        type=_SECONDS,
        help="seconds to read the manifest and load the context, not the model (default: no SLO)",
    )
    p.add_argument("--prior-mbps", type=_number(float, 1e-6, "a positive rate"), help="expected link Mbit/s")
    p.add_argument(
        "--compute-tps",
        type=_number(float, 1e-6, "a positive rate"),
        help="prefill tokens/s to assume instead of measuring them first (a CLI run is a new process: "
        "with --slo it measures 64 tokens before the first fetch, longer on a busy CPU)",
    )
    p.add_argument("--level", choices=levels, help="one fixed level (no adaptation)")
    p.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument(
        "--n-ctx",
        type=_COUNT,
        help="context size (default: the context's tokens + 256, and room for --prompt)",
    )
    p.add_argument("--prompt", help="then continue the loaded context with this text and print the answer")
    p.add_argument("--max-tokens", type=_COUNT, help="the answer's length (default: 32)")
    _threads_arg(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_load)

    # parsed in main (argparse would take the server's options for its own): listed for --help
    p = sub.add_parser(
        "llama-server",
        help="run llama-server built from llama-cpp-python's llama.cpp (built once); ARGS go to it",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="llama-server arguments")

    p = sub.add_parser(
        "proxy", help="a proxy before one llama-server that shares context prefixes through a store"
    )
    p.add_argument("--server", required=True, help="the llama-server's URL, e.g. http://127.0.0.1:8081")
    p.add_argument("--slot-dir", required=True, help="the server's --slot-save-path (on this machine)")
    p.add_argument("--store", required=True, help="store URL all proxies share (redis://, http://, a dir)")
    p.add_argument("--listen", default="127.0.0.1:8080", help="HOST:PORT (default: %(default)s)")
    p.add_argument(
        "--levels",
        nargs="+",
        choices=levels,
        default=["high", "balanced"],
        help="levels uploaded (default: high balanced)",
    )
    p.add_argument("--load-level", choices=levels, help="always load this level (default: by --slo)")
    p.add_argument(
        "--slo",
        type=_SECONDS,
        help="seconds a prefix load may take (default: twice the server's time to compute the prompt, "
        "10 s until it is known)",
    )
    p.add_argument("--chunk-tokens", type=_COUNT, default=256, help="tokens per chunk (default: %(default)s)")
    p.add_argument(
        "--capacity-bytes",
        type=_COUNT,
        help="after each upload, delete the store's least recently used chunk objects past this many bytes "
        "(default: no bound; a shared store needs it on one proxy at least)",
    )
    p.add_argument(
        "--token-file",
        help="bearer token clients must send (default: $LLAMA_CACHEGEN_PROXY_TOKEN; without one, only a "
        "loopback --listen is accepted; an HTTP --store's token is $LLAMA_CACHEGEN_TOKEN)",
    )
    p.add_argument("--server-key-file", help="the llama-server's --api-key, for the proxy's own calls")
    p.add_argument("--model", help="the GGUF the server loaded (default: its /props model_path)")
    p.add_argument("--cache-type-k", default="f16", help="the server's -ctk (default: %(default)s)")
    p.add_argument("--cache-type-v", default="f16", help="the server's -ctv (default: %(default)s)")
    p.add_argument(
        "--flash-attn", choices=["auto", "on", "off"], default="auto", help="the server's -fa (default: auto)"
    )
    p.add_argument("--swa-full", action="store_true", help="the server runs with --swa-full")
    p.add_argument(
        "--max-body-mb", type=_COUNT, default=64, help="largest request accepted, MiB (default: %(default)s)"
    )
    _threads_arg(p)
    p.add_argument("--verbose", action="store_true", help="log every request")
    p.set_defaults(func=_proxy)
    return parser


def _message(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return str(exc)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["llama-server"]:
        return _llama_server(argv[1:])
    parser = _worker_parser() if argv[:1] == ["_demo-worker"] else _parser()
    args = parser.parse_args(argv[1:] if argv[:1] == ["_demo-worker"] else argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # the reader left (`inspect ... | head`): quietly, as the Python docs do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # for Python's flush at exit
        return 1
    except (CacheGenError, OSError) as exc:
        print(f"llama-cachegen {args.command}: error: {_message(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: what was loading is put back (a load never half-loads)
        print(f"llama-cachegen {args.command}: interrupted", file=sys.stderr)
        return 130
