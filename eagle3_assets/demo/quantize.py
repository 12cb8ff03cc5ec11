"""W4A16 INT4 quantization of a safetensors causal-LM directory, as Kimi-K2.5 ships it.

Kimi-K2.5's checkpoint is compressed-tensors `pack-quantized`: symmetric int4 weights in groups
of 32 along the input dimension, bf16 activations, and only the routed experts quantized (its
`ignore` list keeps attention, shared experts, dense MLPs, lm_head and the vision tower in bf16).

The quantizer works on the safetensors files, not on a loaded model: transformers 5 fuses each
MoE layer's experts into one 3-D parameter, which compressed-tensors' module matching (it targets
`Linear`) never sees, while the checkpoint keeps one 2-D `experts.N.*_proj.weight` per expert,
which is what vLLM and Kimi-K2.5's published files name. compressed-tensors' own checkpoint
converter does the file walking, the copying of every other file (tokenizer, templates, remote
code), the index and the `quantization_config`; its pack-quantized compressor does the packing.
"""

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from compressed_tensors.compressors import PackedQuantizationCompressor
from compressed_tensors.config import CompressionFormat
from compressed_tensors.entrypoints.convert import convert_checkpoint
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    QuantizationStrategy,
    QuantizationType,
)
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
from compressed_tensors.utils.match import match_quantizable_tensors

# Kimi-K2.5's / K2.6's published `ignore` list, in its order: only routed experts are int4.
KIMI_K25_IGNORE: tuple[str, ...] = (
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    "re:.*lm_head.*",
    "re:vision_tower.*",
    "re:mm_projector.*",
)

# Tensors a module-based quantizer skips by class (embeddings, the MoE router, which vLLM builds
# unquantized) but that a name-based walk over the files would otherwise match as `*.weight`.
NOT_LINEAR: tuple[str, ...] = (r"re:.*embed_tokens$", r"re:.*mlp\.gate$")


def w4a16_scheme(group_size: int) -> QuantizationScheme:
    """The weight-only int4 scheme of Kimi-K2.5's `config_groups.group_0`."""
    return QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(
            num_bits=4,
            type=QuantizationType.INT,
            symmetric=True,
            strategy=QuantizationStrategy.GROUP,
            group_size=group_size,
            dynamic=False,
            observer="minmax",
        ),
        format=CompressionFormat.pack_quantized.value,
    )


class W4A16Quantizer:
    """A compressed-tensors checkpoint `Converter` that packs every targeted weight to int4."""

    def __init__(self, group_size: int, ignore: Sequence[str]) -> None:
        self.scheme = w4a16_scheme(group_size)
        self.ignore = [*ignore, *NOT_LINEAR]

    def process(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for module_name, name in list(
            match_quantizable_tensors(tensors, ignore=self.ignore, targets=["Linear"])
        ):
            weight = tensors.pop(name)
            scale, _ = compute_dynamic_scales_and_zp(weight.float(), self.scheme.weights, None)
            packed = PackedQuantizationCompressor.compress(
                {"weight": weight.float(), "weight_scale": scale}, self.scheme
            )
            packed["weight_scale"] = packed["weight_scale"].to(weight.dtype)
            tensors.update({f"{module_name}.{k}": v for k, v in packed.items()})
        return tensors

    def validate(self, tensors: dict[str, torch.Tensor]) -> None:
        group_size = self.scheme.weights.group_size
        for _, name in match_quantizable_tensors(tensors, ignore=self.ignore, targets=["Linear"]):
            tensor = tensors[name]
            if tensor.ndim != 2 or tensor.shape[1] % group_size:
                raise ValueError(
                    f"{name}: shape {tuple(tensor.shape)} cannot be int4-quantized in groups of "
                    f"{group_size} (a 2-D weight whose input width is a multiple of {group_size} "
                    "is needed); add it to the ignore list"
                )

    def create_config(self) -> QuantizationConfig:
        return QuantizationConfig(
            config_groups={"group_0": self.scheme},
            format=CompressionFormat.pack_quantized.value,
            ignore=list(self.ignore),
            quantization_status=QuantizationStatus.COMPRESSED,
        )

    def get_dependencies(self, weight_name: str) -> set[str]:
        return set()


def quantize_w4a16(
    model_dir: Path,
    out_dir: Path,
    group_size: int = 32,
    *,
    ignore: Sequence[str] = KIMI_K25_IGNORE,
) -> None:
    """Write `model_dir` to `out_dir` with W4A16 pack-quantized weights, all other files copied.

    `ignore` (compressed-tensors module patterns) defaults to Kimi-K2.5's: routed experts only.
    `out_dir` appears complete or not at all.
    """
    if out_dir.exists():
        raise FileExistsError(f"{out_dir}: the quantized model's directory exists already")
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json, not a Hugging Face model directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        convert_checkpoint(model_dir, staging, W4A16Quantizer(group_size, ignore))
        staging.chmod(0o755)  # mkdtemp makes it owner-only; a model directory is shared
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
