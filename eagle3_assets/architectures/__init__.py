"""Target architectures the project builds miniatures of and runs the whole graph on, one file each.

`ARCHITECTURES` maps `demo.architecture` names to their `Architecture`; `by_hf_architecture` finds the entry
for a checkpoint's `config.json` `architectures[0]` (None for one without a miniature here).
"""

from __future__ import annotations

from eagle3_assets.architectures.base import Architecture, MiniatureShape
from eagle3_assets.architectures.deepseek_v3 import DEEPSEEK_V3
from eagle3_assets.architectures.gpt_oss import GPT_OSS
from eagle3_assets.architectures.kimi_k25 import KIMI_K25
from eagle3_assets.architectures.llama import LLAMA
from eagle3_assets.architectures.qwen3 import QWEN3
from eagle3_assets.architectures.qwen3_moe import QWEN3_MOE

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (LLAMA, DEEPSEEK_V3, KIMI_K25, QWEN3_MOE, QWEN3, GPT_OSS)}


def by_hf_architecture(hf_architecture: str) -> Architecture | None:
    return next((a for a in ARCHITECTURES.values() if a.hf_architecture == hf_architecture), None)


__all__ = ["ARCHITECTURES", "Architecture", "MiniatureShape", "by_hf_architecture"]
