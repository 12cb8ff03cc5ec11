"""Drafter families, each declared once: what the pipeline names, stores and serves it by.

A spec holds every name the rest of the package derives from a family: its assets, its store directory, its
rolling trainer's pool, the vLLM method that serves it, the settings it reads, and the targets vLLM serves it beside.
The asset registry (`artifacts.py`, `definitions.py`) makes each family's entries from its spec; settings name
families by `name` (`drafters`), the one string a family travels as across a process boundary (`--family`) or in a
record (`release.json`, window records, calibration points).

Plain data, no torch and no Dagster: settings, `--plan` and the code location read it without loading either. What a
family trains (model, objective, export) is `drafter/family.py`'s.

Adding a family: its spec below (and in `FAMILIES`), its settings section on `Settings` (`settings_section`), and its
model, loss and export files with its `Family` in `drafter/family.py`.

EAGLE-3 keeps the names it had before there were families (`drafter`, `drafter_eval`, pool `trainer`, the store's
top): its history and records stay where they are. The others follow one rule (`by_rule`).
"""

from __future__ import annotations

from dataclasses import dataclass

# Architectures (HF `architectures[0]`) whose vLLM 0.32 model implements `SupportsEagle3`: the interface through which
# vLLM hands a drafter the target's aux hidden states. EAGLE-3 and DFlash both read those (vLLM refuses a target
# without it: "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"), so both serve
# beside exactly these. Listed from vLLM 0.32's registry (text and multimodal models), each class checked with
# `interfaces.supports_eagle3`, or by its bases where the module needs packages not installed here (torchvision).
EAGLE3_TARGETS = frozenset({
    "AfmoeForCausalLM", "ApertusForCausalLM", "Cohere2MoeForCausalLM", "CohereCompassForConditionalGeneration",
    "Cosmos3ForConditionalGeneration", "DeepseekForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM", "DeepseekV41ForCausalLM", "DeepseekV4ForCausalLM", "Ernie4_5ForCausalLM",
    "Exaone4_5_ForConditionalGeneration", "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration",
    "Gemma4UnifiedForConditionalGeneration", "GlmMoeDsaForCausalLM", "GptOssForCausalLM", "GraniteForCausalLM",
    "GraniteSWAForCausalLM", "IQuestCoderForCausalLM", "InternLM3ForCausalLM", "InternS1ProForConditionalGeneration",
    "InternS2MobiusForConditionalGeneration", "InternS2PreviewForConditionalGeneration", "K2HorizonForCausalLM",
    "KimiK25ForConditionalGeneration", "KimiK3ForConditionalGeneration", "KimiLinearForCausalLM", "LLaMAForCausalLM",
    "LagunaForCausalLM", "LightOnOCRForConditionalGeneration", "Llama4ForCausalLM", "Llama4ForConditionalGeneration",
    "LlamaForCausalLM", "LlavaForConditionalGeneration", "MiMoForCausalLM", "MiMoV2FlashForCausalLM",
    "MiMoV2ForCausalLM", "MiMoV2OmniForCausalLM", "MiniCPM3ForCausalLM", "MiniCPMForCausalLM",
    "MiniCPMV4_6ForConditionalGeneration", "MiniCPMV4_7ForConditionalGeneration", "MiniMaxM2ForCausalLM",
    "Ministral3ForCausalLM", "Mistral3ForConditionalGeneration", "MistralForCausalLM", "MistralLarge3ForCausalLM",
    "MuseGlimmerForCausalLM", "MuseGlimmerForConditionalGeneration", "NemotronHForCausalLM",
    "NemotronHPuzzleForCausalLM", "NemotronH_Nano_Omni_Reasoning_V3", "NemotronH_Nano_VL_V2",
    "NemotronH_Omni_Reasoning_V3", "NemotronH_Super_Omni_Reasoning_V3", "OpenCUAForConditionalGeneration",
    "Phi3ForCausalLM", "PixtralForConditionalGeneration", "Plamo3ForCausalLM", "Qwen2ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration", "Qwen3ASRForConditionalGeneration", "Qwen3ASRRealtimeGeneration",
    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3OmniMoeForConditionalGeneration",
    "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration", "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
    "SarvamMLAForCausalLM", "Step1ForCausalLM", "TeleChat2ForCausalLM", "TeleChat3ForCausalLM", "TeleFLMForCausalLM",
})  # fmt: skip


@dataclass(frozen=True)
class FamilySpec:
    name: str  # in `settings.drafters`, `--family` and every record that names a family
    description: str  # what its drafter is: the start of its asset's description
    root: str  # the store directory of its outputs ("" = the store's top)
    drafter_asset: str  # its training + export asset (and artifact)
    eval_asset: str  # its asset serving the export in vLLM
    trainer_pool: str  # its rolling trainer's Dagster pool (each family its own: they train from one window at once)
    vllm_method: str  # `speculative_config.method`
    settings_section: str  # the `Settings` section holding its own recipe (`training` for EAGLE-3's)
    # Fields of `training` only this family reads; each shapes its model or loss (a continuation must share them).
    training_fields: tuple[str, ...] = ()
    # Fields of `training` this family takes from its own section instead, by the same name: its schedule, where the
    # shared one was tuned for another family (`Settings.training_of`). Neither read nor recorded from `training`.
    recipe_fields: tuple[str, ...] = ()
    # drafter_eval scores acc_k by token class through this family's training objective (EAGLE-3's TTT unroll).
    token_classes: bool = False
    # An import of this family keeps its own vocab map while it is the release (`vocab_map` adopts it): its head was
    # trained for its draft ids alone. False: its head is the target's over the whole vocabulary, continued on the
    # store's map from that head's rows of it.
    adopts_import_map: bool = False
    target_architectures: frozenset[str] = EAGLE3_TARGETS  # HF architectures vLLM serves it beside


TRAINER_POOL = "trainer"


def by_rule(name: str, description: str, recipe_fields: tuple[str, ...] = ()) -> FamilySpec:
    """A family named after the rule for every family but EAGLE-3: `<asset>_<name>`, `families/<name>/`."""
    return FamilySpec(
        name=name, description=description, root=f"families/{name}", drafter_asset=f"drafter_{name}",
        eval_asset=f"drafter_eval_{name}", trainer_pool=f"{TRAINER_POOL}_{name}", vllm_method=name,
        settings_section=name, recipe_fields=recipe_fields,
    )  # fmt: skip


EAGLE3 = FamilySpec(
    name="eagle3",
    description="The EAGLE-3 draft model (one layer over three target layers, trained by TTT unrolls)",
    root="",
    drafter_asset="drafter",
    eval_asset="drafter_eval",
    trainer_pool=TRAINER_POOL,
    vllm_method="eagle3",
    settings_section="training",
    training_fields=("ttt_steps", "step_weight", "norm_before_fc", "norm_before_residual", "norm_output"),
    token_classes=True,
    adopts_import_map=True,
)
# DFlash's schedule is its own (`dflash_settings.py`): EAGLE-3's (the demo's lr 3e-3, 16 epochs, weight decay 0.3)
# was never tuned for it, and the references train it otherwise.
DFLASH = by_rule(
    "dflash", "The DFlash block draft model (drafts a whole block per forward, non-causal over mask slots)",
    recipe_fields=("lr", "epochs", "weight_decay"),
)

# Every family, by name, in the order errors and `--family` list them.
FAMILIES: dict[str, FamilySpec] = {f.name: f for f in (EAGLE3, DFLASH)}


class UnknownFamily(ValueError):
    """A family name no spec declares."""


def family_names() -> tuple[str, ...]:
    return tuple(FAMILIES)


def family_spec(name: str) -> FamilySpec:
    """The spec of family `name`; an error naming the families there are."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnknownFamily(
            f"drafter family {name!r} does not exist; the families are {', '.join(FAMILIES)}"
        ) from None
