#!/usr/bin/env bash
# The wheels the lent GPU machine lacks (it has torch, transformers, safetensors, numpy,
# pyyaml, fsspec; no pydantic), unpacked into .gpu_deps/site for Python 3.12 / x86_64, so
# they travel with the working tree (`carry: [".gpu_deps"]`) and benchmarks/gpu_check.py
# puts them on sys.path. Needs the package registry: run it here, before the device call.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf .gpu_deps
"$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --no-deps \
    --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d .gpu_deps/wheels pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions
for w in .gpu_deps/wheels/*.whl; do "$PY" -m zipfile -e "$w" .gpu_deps/site; done
rm -rf .gpu_deps/wheels
du -sh .gpu_deps
