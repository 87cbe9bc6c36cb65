#!/usr/bin/env bash
# Compile every csrc/cuda/*.cu with `nvcc -c` against torch's headers, so the CUDA kernels cannot rot on
# machines (like CI) whose torch has no CUDA. Object files go to a temporary directory and are discarded.
# Usage: scripts/check_cuda_compile.sh [python]   (default: .venv/bin/python, else python3)
# Exit status: 0 all compiled, 1 a compile failed, 2 nvcc or the sources are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
NVCC=${NVCC:-$(command -v nvcc || true)}
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
if [ -z "$NVCC" ]; then echo "nvcc not found" >&2; exit 2; fi
shopt -s nullglob
SOURCES=(csrc/cuda/*.cu)
if [ ${#SOURCES[@]} -eq 0 ]; then echo "no csrc/cuda/*.cu sources" >&2; exit 2; fi
INCLUDES=$("$PY" -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I' + p for p in include_paths()))")
PYINC=$("$PY" -c "import sysconfig; print('-I' + sysconfig.get_paths()['include'])")
ARCH=${CUDA_ARCH:-sm_90}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
# A CPU build of torch ships the c10/cuda headers but not the one cmake generates for them: supply it
# (a CUDA torch's copy says exactly this) in a private include dir searched after torch's own.
SHIM=""
if ! "$PY" -c "import os, sys; from torch.utils.cpp_extension import include_paths; sys.exit(not any(os.path.exists(os.path.join(p, 'c10/cuda/impl/cuda_cmake_macros.h')) for p in include_paths()))"; then
  mkdir -p "$OUT/shim/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$OUT/shim/c10/cuda/impl/cuda_cmake_macros.h"
  SHIM="-I$OUT/shim"
fi
# compile all sources in parallel (one job per source), then collect the results
for src in "${SOURCES[@]}"; do
  # -D flags: what torch's CUDAExtension passes (our CUDA kernels on, no implicit half conversions)
  ( "$NVCC" -c "$src" -o "$OUT/$(basename "$src").o" -std=c++17 -O1 -arch="$ARCH" $INCLUDES $PYINC $SHIM \
      -DMINISGL_WITH_CUDA -DTORCH_EXTENSION_NAME=_C -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
      -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr \
      -Xcompiler -fPIC -w > "$OUT/$(basename "$src").log" 2>&1; echo $? > "$OUT/$(basename "$src").rc" ) &
done
wait
status=0
for src in "${SOURCES[@]}"; do
  if [ "$(cat "$OUT/$(basename "$src").rc")" = 0 ]; then
    echo "ok   $src"
  else
    cat "$OUT/$(basename "$src").log" >&2
    echo "FAIL $src" >&2
    status=1
  fi
done
exit $status
