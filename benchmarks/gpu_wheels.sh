#!/usr/bin/env bash
# Wheels of what the GPU suite needs beyond a CUDA PyTorch image (one that already holds torch, triton, numpy,
# transformers, tokenizers, safetensors, httpx, jinja2, prometheus_client, pytest and its plugins), for a GPU
# machine with no package index. Run where pip can reach one:
#
#   bash benchmarks/gpu_wheels.sh [DIR] [PYTHON_VERSION]     # default .whl and 3.12
#
# then carry DIR beside the checkout: `gpu_suite.sh setup` installs every wheel in .whl/ with --no-deps.
# flashinfer-python is 0.6.18, the version docs/benchmarks.md's flashinfer figures ran: from 0.7 its wheel bundles
# compiled kernels (33 MB at 0.7.0, 99 MB at 0.7.4) where 0.6.x compiles them on first use with the machine's nvcc
# (18 MB). Its optional cuDNN and CUTLASS-DSL paths are left out; the engine uses neither.
set -euo pipefail
dir=${1:-.whl}
py=${2:-3.12}
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp "${platforms[@]}" \
    -d "$dir" \
    msgspec litestar litestar-htmx multipart polyfactory faker rich-click sniffio \
    sqlalchemy greenlet alembic mako aiosqlite uvicorn websockets 'llguidance>=1.9,<2' \
    'flashinfer-python==0.6.18' 'apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8,!=0.1.8.post0' fla-core
ls "$dir"
du -sh "$dir"
