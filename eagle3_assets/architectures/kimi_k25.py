"""Kimi-K2.5: DeepSeek-V3's text model inside a vision-language wrapper, as the run this project is modelled on serves it.

`KimiK25ForConditionalGeneration`, the text model under `text_config`, its tensors under `language_model.` and a vision
tower's config but no vision weights (`demo/kimi_k25.py` writes it). Every engine the pipeline starts serves a wrapper
text-only (`TargetModel.wrapped`: `--language-model-only`); the drafter reads the text model's shape, embedding and
head under the wrapper's names.
"""

from __future__ import annotations

from eagle3_assets.architectures.base import Architecture
from eagle3_assets.architectures.deepseek_v3 import DEEPSEEK_V3

KIMI_K25 = Architecture(
    name="kimi_k25",
    hf_architecture="KimiK25ForConditionalGeneration",
    model_type="kimi_k25",
    attention=DEEPSEEK_V3.attention,
    moe=DEEPSEEK_V3.moe,
    served_dtype=DEEPSEEK_V3.served_dtype,
    miniature=DEEPSEEK_V3.miniature,
    text_model=DEEPSEEK_V3,
    description=f"Kimi-K2.5's vision-language wrapper, served text-only, around {DEEPSEEK_V3.name} ("
    f"{DEEPSEEK_V3.description})",
)
