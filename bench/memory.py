"""Peak resident memory of encode and decode, beyond their inputs and outputs.

    python bench/memory.py [--tokens 2048] [--model M.gguf] [--threads 2]

Each measurement runs in a fresh process that first holds what the call needs (the state, the
container read from a file, and for decode_into the destination buffer, zeroed), resets the
kernel's high-water mark (/proc/self/clear_refs) and reads it after one call: the extra memory
the call used at its peak (the first call: it includes the allocator's growth). The issue's
bound (decode): at most 1.2 x (state + container) in all, that is extra <= 0.2 x (state +
container). `decode` returns a fresh buffer: its extra includes the state it returns.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import LEVELS, log, require

_PROBE = r"""
import json, sys, time, llama_cachegen as l
def rss(field):
    for line in open('/proc/self/status'):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
state = open(sys.argv[1], 'rb').read()
blob = open(sys.argv[2], 'rb').read()
level, op, threads = sys.argv[3], sys.argv[4], int(sys.argv[5])
dst = bytearray(len(state)) if op == 'decode_into' else None  # zeroed: its pages are resident
held = rss('VmRSS:')
open('/proc/self/clear_refs', 'w').write('5')  # the high-water mark starts again from here
t = time.perf_counter()
if op == 'encode':
    out = l.encode(state, level, threads=threads)
elif op == 'decode_into':
    l.codec.decode_into(blob, dst, threads=threads)
else:  # decode: into a fresh bytearray
    out = l.decode(blob, threads=threads)
seconds = time.perf_counter() - t
print(json.dumps({'extra': rss('VmHWM:') - held, 'seconds': seconds, 'state': len(state),
                  'container': len(blob)}))
"""


def probe(state_path: Path, blob_path: Path, level: str, op: str, threads: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(state_path), str(blob_path), level, op, str(threads)],
        capture_output=True,
        text=True,
        check=False,
    )
    require(out.returncode == 0, f"memory probe {level} {op} failed: {out.stderr[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    import llama_cachegen
    from llama_cachegen import quality
    from llama_cachegen.model import default_model_path, sample_text
    from report import table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    model = args.model or default_model_path()
    llm = quality.make_llama(model, n_ctx=args.tokens + 8, logits_all=False)
    tokens = llm.tokenize(sample_text("gpl-3.0.txt").encode(), add_bos=True)[: args.tokens]
    state = quality.state_of(llm, tokens)
    del llm
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.bin"
        path.write_bytes(state)
        for level in LEVELS:
            blob_path = Path(tmp) / f"{level}.lcg"
            blob_path.write_bytes(llama_cachegen.encode(state, level))
            for op in ("decode_into", "decode", "encode"):
                log(f"memory: {level} {op}")
                r = probe(path, blob_path, level, op, args.threads)
                held = r["state"] + r["container"]
                rows.append(
                    (
                        level,
                        op,
                        r["container"] / 1e6,
                        r["extra"] / 1e6,
                        r["extra"] / held,
                        r["state"] / r["seconds"] / 1e6,
                    )
                )
    name = Path(model).name
    print(f"f16 state of {len(tokens)} tokens of {name}: {len(state) / 1e6:.1f} MB; {args.threads} threads")
    print(
        table(
            ["level", "call", "container MB", "extra peak MB", "extra / (state + container)", "MB/s"],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
