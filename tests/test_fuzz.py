"""Bounded fuzzing: a few thousand mutants of containers and envelopes through every parser, in a
subprocess (a crash fails the test instead of killing pytest). Only CacheGenError may come out.
20,000 mutants by default (FUZZ_MUTANTS), about a second on these small states.

The containers (whole, and chunked: skeletons, statistics, chunks decoded into their place) are
encoded here from synthetic states (conftest.py), so the mutants follow
whatever container format the native library writes. A longer campaign: run this file's script
by hand with a larger FUZZ_MUTANTS and other FUZZ_SEED values. The same mutants run once more on
the library built with AddressSanitizer and UBSan (LCG_SANITIZE), where a read out of bounds that
happens not to crash fails too; that build is kept in the cache folder, keyed by the native
sources, so a later run with the same sources skips it. That build's emulator of the CUDA backend
runs the device path's corrupt-stream and chunk checks (tests/test_cuda.py) too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import llama_cachegen
import pytest
from llama_cachegen.model import cache_dir

ROOT = Path(__file__).resolve().parent.parent

_FUZZER = r"""
import json, os, random, struct, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from conftest import full_buffer, kv_cache_bytes, seq_buffer
import llama_cachegen as lcg
from llama_cachegen import codec
from llama_cachegen.errors import CacheGenError
from llama_cachegen.llama import StateMeta

rng = random.Random(int(os.environ.get("FUZZ_SEED", "7")))
n_mutants = int(os.environ.get("FUZZ_MUTANTS", "20000"))
np_rng = np.random.default_rng(1)

def envelope(n_tokens):
    return StateMeta(
        fingerprint={"arch": "llama", "n_layer": 2, "type_k": "f16", "swa_full": None},
        scope="all", seq_id=None, n_ctx=64, tokens=np.arange(n_tokens, dtype=np.intc),
        logits=np.ones(5, np.single), seed=3,
    ).pack()

seeds = []
for level in ("lossless", "balanced", "compact"):
    mem = kv_cache_bytes(np_rng, n_layer=2, n_embd=32, cells_per_stream=(12,), v_trans=level == "balanced")
    seeds.append(lcg.encode(seq_buffer(mem), level, user_meta=envelope(12)))
    mem = kv_cache_bytes(np_rng, n_layer=1, n_embd=16, cells_per_stream=(5, 0, 3))
    seeds.append(lcg.encode(full_buffer(mem), level, kind="full_buffer"))
    mem = kv_cache_bytes(np_rng, n_layer=2, n_embd=64, cells_per_stream=(48,), ext=True)  # many lanes
    seeds.append(lcg.encode(seq_buffer(mem), level))
envelopes = [envelope(n) for n in (0, 1, 7)]

# chunked objects: (skeleton, stats, stats id, chunks, positions) of a few states
import hashlib
families = []
for level, v_trans in (("lossless", False), ("balanced", True), ("compact", False)):
    state = seq_buffer(kv_cache_bytes(np_rng, n_layer=2, n_embd=24, cells_per_stream=(20,), v_trans=v_trans))
    chunker = codec.Chunker(state, level)
    stats = chunker.stats()
    sid = hashlib.sha256(stats).digest()
    chunks = [chunker.chunk(b, min(b + 8, 20), sid) for b in range(0, 20, 8)]
    families.append((codec.encode_skeleton(state), stats, sid, chunks))
seeds += [obj for skel, stats, _, chunks in families for obj in (skel, stats, *chunks)]

def chunk_targets():  # a mutated chunk, statistics object or skeleton, the rest of its family intact
    skel, stats, sid, chunks = rng.choice(families)
    chunk = rng.choice(chunks)
    which = rng.choice(("chunk", "chunk", "stats", "skeleton"))
    op, mutant = mutate({"chunk": chunk, "stats": stats, "skeleton": skel}[which])
    def decode_chunk(_):
        state = codec.skeleton_state(mutant if which == "skeleton" else skel, 20)
        opened = codec.Stats(mutant if which == "stats" else stats, sid)
        codec.decode_chunk(mutant if which == "chunk" else chunk, opened, state)
    return op, mutant, {f"decode_{which}": decode_chunk}

INTERESTING = [0, 1, 2, 0x7F, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 40, 2**64 - 1]

def mutate(data):
    b = bytearray(data)
    op = rng.choice(("flip", "flip", "truncate", "splice", "size", "size", "insert", "delete"))
    if not b:
        return op, bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    if op == "flip":
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif op == "truncate":
        del b[rng.randrange(len(b)):]
    elif op == "splice":
        other = rng.choice(seeds + envelopes)
        i, j = rng.randrange(len(b)), rng.randrange(len(other))
        b[i:] = other[j : j + rng.randrange(1, len(b) - i + 64)]
    elif op == "size":
        width = rng.choice((4, 8))
        i = rng.randrange(0, max(1, len(b) - width + 1)) & ~3
        value = rng.choice(INTERESTING + [len(b), len(b) * rng.randint(2, 1000), rng.getrandbits(32)])
        b[i : i + width] = (value % (1 << 8 * width)).to_bytes(width, "little")[: len(b) - i]
    elif op == "insert":
        i = rng.randrange(len(b) + 1)
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    else:
        i = rng.randrange(len(b))
        del b[i : i + rng.randint(1, 16)]
    return op, bytes(b)

def meta_of(blob):
    return StateMeta.unpack(codec.user_meta(blob))

TARGETS = {
    "decode": lambda blob: codec.decode(blob),
    "decoded_size": codec.decoded_size,
    "inspect": codec.inspect,
    "user_meta": codec.user_meta,
    "envelope": meta_of,
}
counts, failures = {}, []
start = time.monotonic()
for i in range(n_mutants):
    if i % 4 == 3:  # an envelope, straight to its parser
        op, mutant = mutate(rng.choice(envelopes))
        targets = {"envelope_bytes": StateMeta.unpack}
    elif i % 4 == 2:
        op, mutant, targets = chunk_targets()
    else:
        op, mutant = mutate(rng.choice(seeds))
        for _ in range(rng.choice((0, 0, 1, 2))):  # stacked mutations
            op, mutant = mutate(mutant)
        targets = TARGETS
    for name, parse in targets.items():
        try:
            parse(mutant)
            outcome = "accepted"
        except CacheGenError as exc:
            outcome = type(exc).__name__
        except BaseException as exc:
            failures.append({"target": name, "op": op, "mutant": i, "error": repr(exc)[:300]})
            continue
        counts[f"{name}:{outcome}"] = counts.get(f"{name}:{outcome}", 0) + 1
print(json.dumps({"mutants": n_mutants, "seconds": time.monotonic() - start, "counts": counts,
                  "failures": failures[:20], "n_failures": len(failures)}))
"""


def _fuzz(env: dict[str, str] | None = None) -> dict:
    """Runs the fuzzer; its report."""
    proc = subprocess.run(
        [sys.executable, "-c", _FUZZER, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, f"the fuzzer died (exit {proc.returncode}): {proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["n_failures"] == 0, json.dumps(report["failures"], indent=1)
    return report


def test_mutants_raise_only_cachegen_errors() -> None:
    counts = _fuzz()["counts"]
    # the mutants reached every parser, and some were refused by each
    chunked = ("decode_chunk", "decode_stats", "decode_skeleton")
    for target in ("decode", "inspect", "user_meta", "envelope", "envelope_bytes", *chunked):
        assert (
            sum(n for k, n in counts.items() if k.startswith(f"{target}:") and not k.endswith("accepted")) > 0
        )


def _sanitized_build() -> Path:
    """libllama_cachegen and the CUDA backend's emulator built with LCG_SANITIZE, in the cache
    folder under a hash of the sources."""
    sources = [ROOT / "CMakeLists.txt", *sorted((ROOT / "native").rglob("*.[ch]*"))]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:16]
    build = cache_dir() / f"asan-build-{digest}"
    if not all((build / name).is_file() for name in _SANITIZED):
        for old in cache_dir().glob("asan-build-*"):  # other sources' builds
            shutil.rmtree(old, ignore_errors=True)
        # gcc's: the runtimes preloaded are gcc's (a CC=clang build would need clang's)
        config = ["-DLCG_SANITIZE=ON", "-DLCG_CUDA=OFF", "-DCMAKE_BUILD_TYPE=RelWithDebInfo"]
        config += ["-DCMAKE_C_COMPILER=gcc", "-DCMAKE_CXX_COMPILER=g++"]
        targets = [name.removeprefix("lib").removesuffix(".so") for name in _SANITIZED]
        for command in (
            ["cmake", "-S", ROOT, "-B", build, *config],
            ["cmake", "--build", build, "--target", *targets, "-j", str(os.cpu_count() or 1)],
        ):
            proc = subprocess.run(command, capture_output=True, text=True)
            assert proc.returncode == 0, (
                f"{command[:2]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
    return build


_SANITIZED = ("libllama_cachegen.so", "libllama_cachegen_cuda_emu.so")


def test_mutants_under_address_and_undefined_behaviour_sanitizers(tmp_path: Path) -> None:
    runtimes = [
        subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        for name in ("libasan.so", "libubsan.so")
    ]
    if shutil.which("cmake") is None or not all(os.path.isabs(r) for r in runtimes):
        pytest.skip("needs cmake and gcc's sanitizer runtimes")
    package = tmp_path / "llama_cachegen"  # the installed package, with the sanitized library
    shutil.copytree(Path(llama_cachegen.__file__).parent, package)
    build = _sanitized_build()
    for name in _SANITIZED:
        shutil.copy(build / name, package / name)
    env = dict(
        os.environ,
        PYTHONPATH=str(tmp_path),
        LD_PRELOAD=" ".join(runtimes),
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",  # Python's own allocations are no leaks of ours
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
    )
    loaded = subprocess.run(
        [sys.executable, "-c", "import llama_cachegen; print(open('/proc/self/maps').read())"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    assert str(package / "libllama_cachegen.so") in loaded and "libasan" in loaded  # the fuzzer's library
    assert _fuzz(env)["mutants"] > 0
    # the device path on the emulator: corrupt streams and chunks through the host's plans and the
    # kernels' per-lane code (a fault there is a read or write out of bounds on a GPU)
    env["LCG_CUDA_LIBRARY"] = str(package / "libllama_cachegen_cuda_emu.so")
    checks = "test_cuda.check_bad_input_never_faults(); test_cuda.check_chunks_match_cpu(); print('ok')"
    proc = subprocess.run(
        [sys.executable, "-c", f"import test_cuda; {checks}"],
        cwd=Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
