#!/usr/bin/env bash
# The CUDA backend on a machine with a GPU (docs/cuda.md), as one prepared run: build the package
# with the kernels for that GPU, run tests/test_cuda.py (the GPU checks run in-process there, with
# the conversion check over every f32; the emulated ones run everywhere else), the bad-input check
# under compute-sanitizer, then bench/cuda.py. Logs go to $OUT (default /tmp/gpu-check);
# LCG_NCU=1 adds a profile of the decode kernel, LCG_BASELINE=DIR an A/B against another tree's.
# Needs nvcc, cmake, numpy, pytest and cffi in the python3 it finds (the device tool's machines
# lack cffi: carry its wheel).
#
#     OUT=/tmp/gpu bash bench/gpu-check.sh [bench/cuda.py arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
ARCH=${LCG_CUDA_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv | tee "$OUT/gpu.txt"

export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
python3 -m pip install -q --no-build-isolation --no-deps --no-cache-dir \
  --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCH" . 2>&1 | tail -20 || exit 1
nvcc -arch=sm_"$ARCH" --fmad=false -std=c++17 -Xptxas -v -Inative/include -Inative/src \
  -c native/src/cuda/*.cu -o /tmp/lcg-kernels.o 2>&1 | grep -E "Function properties|registers|spill" \
  | tee "$OUT/ptxas.txt"

export PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider -k "not emulated" tests/test_cuda.py 2>&1 | tee "$OUT/test_cuda.txt"
if command -v compute-sanitizer >/dev/null; then
  (cd tests && timeout 120 compute-sanitizer --tool memcheck --print-limit 5 python3 -c \
    "import test_cuda; test_cuda.check_bad_input_never_faults(); test_cuda.check_chunks_match_cpu(); print('sanitizer run ok')") \
    2>&1 | tail -15 | tee "$OUT/sanitizer.txt"
fi
timeout 300 python3 bench/cuda.py "$@" 2>&1 | tee "$OUT/bench_cuda.txt"
# LCG_BASELINE=DIR (another tree's checkout, e.g. `git worktree add` of an older commit, carried
# along): its backend built beside this one, and the bench run under each in turn, twice, on the
# same warm GPU (LCG_CUDA_LIBRARY picks the backend; the plan ABI must match: cuda/plan.h).
if [ -n "${LCG_BASELINE:-}" ]; then
  for tree in "$LCG_BASELINE" .; do
    name=$([ "$tree" = . ] && echo current || echo baseline)
    nvcc -arch=sm_"$ARCH" --fmad=false -std=c++17 -O3 -shared -Xcompiler -fPIC -cudart static \
      -I"$tree"/native/include -I"$tree"/native/src "$tree"/native/src/cuda/decode.cu \
      -o /tmp/lcg-backend-$name.so || exit 1
  done
  for run in 1 2; do
    for name in baseline current; do
      echo "== $name (run $run)" | tee -a "$OUT/bench_ab.txt"
      LCG_CUDA_LIBRARY=/tmp/lcg-backend-$name.so timeout 150 python3 bench/cuda.py "$@" 2>&1 \
        | tee -a "$OUT/bench_ab.txt"
    done
  done
fi
# LCG_NCU=1: one launch of the decode kernel (balanced) under Nsight Compute
if [ -n "${LCG_NCU:-}" ] && command -v ncu >/dev/null; then
  timeout 180 ncu --kernel-name decode_slices --launch-skip 0 --launch-count 1 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section InstructionStats --section MemoryWorkloadAnalysis \
    python3 bench/cuda.py --levels balanced --reps 1 --layers 32 2>&1 | tail -150 | tee "$OUT/ncu.txt"
fi
