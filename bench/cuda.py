"""GPU decode throughput (docs/cuda.md): GB/s of f16 state decoded on a CUDA device, against the CPU
decoder and a device-to-device memcpy of the same bytes, for whole containers and 256-token chunks
(one call each, and all in one launch: "1 launch").

    python bench/cuda.py [--cells 4096] [--channels 1024] [--layers 8] [--reps 5]

"GPU" is a whole call from host memory (checks and plan on the CPU, upload, kernels, wait);
"kernels" is the device time of the kernels alone and "upload" the container's host-to-device copy
(CUDA events, `codec.device_timing`), so that a caller whose container already streams to the
device in pinned memory can read off what the kernels sustain.

The state is synthetic (one sequence, f16 K and transposed V, like llama.cpp without flash
attention) so that its size is a knob; encoding it takes the CPU a while (~0.3 GB/s per core).
Exits with status 2 and says why when there is no CUDA device.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
import sys
import time

import llama_cachegen as lcg
import numpy as np
from llama_cachegen import codec
from llama_cachegen.llama_format import IO_MAGIC

LEVELS = ("lossless", "high", "balanced", "compact")


def synthetic_state(cells: int, channels: int, layers: int) -> bytes:
    """A llama.cpp sequence buffer: one stream, f16 K rows and transposed f16 V, correlated channels."""
    rng = np.random.default_rng(0)
    out = bytearray(struct.pack("<IiI", IO_MAGIC, 0, 1) + struct.pack("<I", cells))
    for pos in range(cells):
        out += struct.pack("<iIi", pos, 1, 0)
    out += struct.pack("<II", 1, layers)
    scale = rng.uniform(0.2, 3.0, channels).astype(np.float32)
    for _ in range(layers):
        k = (rng.standard_normal((cells, channels), np.float32) * scale).astype(np.float16)
        out += struct.pack("<iQ", 1, 2 * channels) + k.tobytes()
    for _ in range(layers):
        v = (rng.standard_normal((cells, channels), np.float32) * 0.5).astype(np.float16)
        out += struct.pack("<iII", 1, 2, channels) + v.T.copy().tobytes()
    return bytes(out)


def best(fn, reps: int) -> float:  # noqa: ANN001
    fn()  # warm up (page faults, the backend's first load, table uploads)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def best_device(fn, reps: int) -> tuple[float, float, float]:  # noqa: ANN001
    """(wall, upload, kernels) seconds, each the best of reps; fn returns its (upload, kernels)."""
    fn()
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        upload, kernels = fn()
        runs.append((time.perf_counter() - t0, upload, kernels))
    return tuple(min(r[i] for r in runs) for i in range(3))


def rate(gb: float, seconds: float) -> str:
    return f"{gb / seconds:.1f}" if seconds > 0 else "-"  # the emulator times nothing


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", type=int, default=4096)
    ap.add_argument("--channels", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=256, help="chunk tokens")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--levels", default=",".join(LEVELS))
    ap.add_argument("--slice", type=int, default=None, help="symbols per stream slice (default 65536)")
    args = ap.parse_args()

    if not lcg.cuda_available():
        try:
            lcg.DeviceBuffer(1)
        except lcg.NoDeviceError as e:
            print(f"bench/cuda.py: no CUDA device, nothing to measure ({e})", file=sys.stderr)
        return 2

    state = synthetic_state(args.cells, args.channels, args.layers)
    n = len(state)
    gb = n / 1e9
    shape = f"{args.cells} cells x {args.channels} channels x {args.layers} layers"
    print(f"state: {shape} x K,V f16 = {n / 2**20:.0f} MiB, slices of {args.slice or 65536} symbols")
    host = bytearray(n)
    dev, dev2 = lcg.DeviceBuffer(n), lcg.DeviceBuffer(n)
    dev.copy_from(state)
    memcpy_s = best(lambda: dev.copy_to(dev2), args.reps)
    h2d_s = best(lambda: dev.copy_from(state), args.reps)
    print(f"device memcpy (D2D): {gb / memcpy_s:8.1f} GB/s   host->device: {gb / h2d_s:6.1f} GB/s")
    head = (
        f"{'level':<9} {'ratio':>6} {'CPU GB/s':>9} {'GPU GB/s':>9} {'kernels GB/s':>13} {'upload GB/s':>12}"
        f" {'chunks GB/s':>12} {'chunk kernels GB/s':>19} {'1 launch GB/s':>13} {'its kernels':>14}"
    )
    print(f"{head}  (CPU: {os.cpu_count()} threads; GB/s of f16 state, upload: of container)")
    for level in args.levels.split(","):
        t0 = time.perf_counter()
        blob = lcg.encode(state, level, slice_elements=args.slice)
        enc_s = time.perf_counter() - t0
        cpu_s = best(lambda b=blob: lcg.decode_into(b, host), args.reps)

        def whole(b=blob) -> tuple[float, float]:
            lcg.decode_into(b, dev)
            return codec.device_timing()

        gpu_s, upload_s, kernels_s = best_device(whole, args.reps)
        if dev.to_host() != host:
            print(f"{level}: GPU and CPU bytes differ", file=sys.stderr)
            return 1
        # chunks: statistics opened once, each chunk decoded into its place on the device
        chunker = codec.Chunker(state, level, slice_elements=args.slice)
        stats = chunker.stats()
        sid = hashlib.sha256(stats).digest()
        opened = codec.Stats(stats, sid)
        bounds = list(range(0, args.cells, args.chunk)) + [args.cells]
        chunks = [chunker.chunk(b, e, sid) for b, e in zip(bounds, bounds[1:], strict=False)]
        layout = codec.skeleton_state(codec.encode_skeleton(state), args.cells)

        def chunked(chunks=chunks, opened=opened, layout=layout) -> tuple[float, float]:
            upload = kernels = 0.0
            for c in chunks:
                codec.decode_chunk(c, opened, layout, device_state=dev)
                up, k = codec.device_timing()
                upload, kernels = upload + up, kernels + k
            return upload, kernels

        dev.copy_from(layout)  # K/V zero: a chunk left undecoded shows
        chunk_s, _, chunk_kernels_s = best_device(chunked, args.reps)
        if dev.to_host() != host:
            print(f"{level}: GPU chunks and CPU bytes differ", file=sys.stderr)
            return 1

        def together(chunks=chunks, opened=opened, layout=layout) -> tuple[float, float]:
            codec.decode_chunks(chunks, opened, layout, device_state=dev2)
            return codec.device_timing()

        dev2.copy_from(layout)
        launch_s, _, launch_kernels_s = best_device(together, args.reps)
        if dev2.to_host() != host:
            print(f"{level}: GPU chunks in one launch and CPU bytes differ", file=sys.stderr)
            return 1
        print(
            f"{level:<9} {n / len(blob):6.2f} {gb / cpu_s:9.2f} {gb / gpu_s:9.2f} {rate(gb, kernels_s):>13}"
            f" {rate(len(blob) / 1e9, upload_s):>12} {gb / chunk_s:12.2f} {rate(gb, chunk_kernels_s):>19}"
            f" {gb / launch_s:13.2f} {rate(gb, launch_kernels_s):>14}  (encode {enc_s:.1f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
