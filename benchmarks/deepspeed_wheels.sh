#!/usr/bin/env bash
# DeepSpeed and the packages it needs beyond what the GPU image has, as wheels for Python 3.10-3.13 on Linux x86-64,
# for `DS_WHEELS=DIR bash benchmarks/run_gpu.sh OUT deepspeed` on a machine without internet. DeepSpeed is published
# as source only: it is built here into a wheel without its compiled ops (a client optimizer needs none).
# Usage: bash benchmarks/deepspeed_wheels.sh DIR   (needs pip and torch in the Python that runs it)
set -euo pipefail
dir=${1:?usage: deepspeed_wheels.sh DIR}
mkdir -p "$dir"
python=${PYTHON:-python3}
DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "deepspeed>=0.14"
for version in 3.10 3.11 3.12 3.13; do
    "$python" -m pip download -q --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --python-version "$version" -d "$dir" einops hjson msgpack ninja py-cpuinfo pydantic
done
ls "$dir"
