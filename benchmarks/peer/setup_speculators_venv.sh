#!/usr/bin/env bash
# Build (or reuse) the peer venv for speculators' EAGLE-3 trainer, kept apart from the project's
# .venv: speculators pins its own torch/transformers stack.
#   bash benchmarks/peer/setup_speculators_venv.sh        # -> .peer/speculators/
# Idempotent: a venv whose `import speculators` works is left as it is.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${PEER_VENV:-$ROOT/.peer/speculators}"
PY="${PYTHON:-python3}"
check() {
  "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers
assert torch.__version__ == "2.13.0+cpu", f"torch {torch.__version__}, expected the 2.13.0 CPU wheel"
import speculators  # noqa: F401
from speculators.models.eagle3 import Eagle3DraftModel  # noqa: F401
print("speculators", md.version("speculators"), "torch", torch.__version__, "transformers", transformers.__version__)
PY
}
if [ -x "$VENV/bin/python" ] && check 2>/dev/null; then
  echo "peer venv ready: $VENV"; exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# CPU torch first, so speculators' dependency on torch is already satisfied by the CPU wheel.
"$VENV/bin/pip" install -q torch==2.13.0
# torch pinned again in the same command: torchvision's newest release wants torch 2.14.1
# (a CUDA build from PyPI), and the resolver would otherwise upgrade torch to fit it.
"$VENV/bin/pip" install -q speculators==0.9.0 torch==2.13.0
# speculators pulls a CUDA torchvision (and friends) that fail to import against CPU torch 2.13
# and break `import transformers`; speculators does not need them for text drafters.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# CUDA runtime wheels a CUDA torch may have pulled in: the CPU wheel needs none of them.
cuda=$("$VENV/bin/pip" list --format=freeze 2>/dev/null | cut -d= -f1 | grep -E '^(nvidia-|cuda-|triton$)' || true)
[ -z "$cuda" ] || "$VENV/bin/pip" uninstall -y -q $cuda
check
echo "peer venv ready: $VENV"
