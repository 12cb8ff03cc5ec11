"""Pipeline settings: one validated model, loaded from the YAML file named by EAGLE3_CONFIG.

Without EAGLE3_CONFIG the embedded demo applies: the project builds a tiny target
model and its prompts itself, so a fresh machine runs the whole graph offline.
Every error names the setting at fault, e.g. `aux_layer_ids: layer id 2 appears twice`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import fsspec
import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from eagle3_assets.architectures import ARCHITECTURES
from eagle3_assets.dflash_settings import DFlashSettings
from eagle3_assets.errors import Refusal
from eagle3_assets.section import Section
from eagle3_assets.evaluation_settings import EvaluationSettings
from eagle3_assets.families import DFLASH, EAGLE3, FamilySpec, family_names, family_spec
from eagle3_assets.start_from import StartFromSettings
from eagle3_assets.storage_dtypes import StorageDtype
from eagle3_assets.traffic_settings import TrafficSettings
from eagle3_assets.training_settings import TrainingSettings

if TYPE_CHECKING:
    from eagle3_assets.target import TargetModel

CONFIG_ENV = "EAGLE3_CONFIG"
ROOT_ENV = "EAGLE3_ROOT"
# The demo's target architecture when no settings file is named (`make demo TARGET=deepseek_v3`).
DEMO_ARCHITECTURE_ENV = "EAGLE3_DEMO_ARCHITECTURE"
DEFAULT_ROOT = ".eagle3"


class SettingsError(Refusal, ValueError):
    """Settings that cannot work; the message names the field (or the environment variable)."""


class GenerationSettings(Section):
    """How the target answers the prompts (`responses`)."""

    backend: Literal["hf", "vllm"] = "hf"
    max_new_tokens: int = Field(2048, ge=1)
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    batch_size: int = Field(32, ge=1, description="prompts per generate() call")
    rows_per_part: int = Field(256, ge=1, description="rows per atomically written part file: the resume granularity")
    max_error_rate: float = Field(0.05, ge=0.0, le=1.0, description="fail the asset when more rows than this fail")
    max_row_attempts: int = Field(
        3,
        ge=1,
        description="materializations that send a row to the engine before a row it keeps failing is given up: "
        "reported as not generated, with its last error, and no longer keeping responses due",
    )
    seed: int = 0
    reasoning: Literal["auto", "think", "harmony", "none"] = Field(
        "auto",
        description="how the target marks its reasoning: <think>...</think>, gpt-oss harmony channels, or none; "
        "auto = from the tokenizer's tokens",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="extra variables for the chat template of every prompt (e.g. {enable_thinking: false}); a "
        "prompt line's own `chat_template_kwargs` override these per key; a kwarg the rendering does not change with, "
        "one that shadows the template's own variables or is of another type than the template compares it with, "
        "is refused",
    )


class ExtractionSettings(Section):
    """How hidden states are extracted into shards (`hidden_states`)."""

    backend: Literal["hf", "vllm"] = "hf"
    batch_tokens: int = Field(16384, ge=1, description="padded tokens per forward batch (rows sorted by length)")
    storage_dtype: StorageDtype = Field(
        "bfloat16", description="float8_e4m3fn: half the bytes, one float32 scale per token and tensor"
    )
    progress_interval_s: float = Field(30.0, gt=0, description="seconds between progress observations")
    disk_margin: float = Field(0.05, ge=0.0, description="extra free space required over the projection, as a fraction")
    max_retries: int = Field(2, ge=0, description="in-run retries of a failed shard (refusals are never retried)")
    backfill_cron: str = Field("*/15 * * * *", description="when missing or failed shards are requested")

    @field_validator("backfill_cron")
    @classmethod
    def _cron(cls, cron: str) -> str:
        # The shape only: the values are checked by Dagster's own parser as the code location loads
        # (`defs/shards/automation.py`), since this module imports no Dagster. `@hourly` and the like are Dagster's too.
        if len(cron.split()) != 5 and not cron.startswith("@"):
            raise ValueError(cron_problem(cron))
        return cron


def cron_problem(cron: str) -> str:
    return f"{cron!r} is not a 5-field cron schedule, e.g. '*/15 * * * *' (every 15 minutes)"


# The speculative token counts drafter_eval serves every drafter at, and the training-time estimate predicts.
SPECULATIVE_TOKENS = (3, 7)


class VllmSettings(Section):
    """Engine settings passed through to vLLM when a backend is `vllm` (generation or extraction)."""

    @field_validator("server_urls")
    @classmethod
    def _distinct_urls(cls, urls: list[str]) -> list[str]:
        cleaned = [u.rstrip("/") for u in urls]
        if len(set(cleaned)) != len(cleaned):
            raise ValueError(f"{urls} names a server twice")
        return cleaned

    @field_validator("cpu_kv_cache_gib", mode="before")
    @classmethod
    def _whole_gib(cls, value: object) -> object:
        # vLLM reads VLLM_CPU_KVCACHE_SPACE with int(): '0.5' kills the server at start, naming no setting.
        whole = isinstance(value, int | float) and not isinstance(value, bool) and float(value).is_integer()
        if value is None or (whole and value >= 1):
            return None if value is None else int(value)
        raise ValueError(
            f"{value!r}: the CPU build takes its KV cache in whole GiB (VLLM_CPU_KVCACHE_SPACE is read as an "
            "integer); give a whole number, 1 or more (e.g. 4)"
        )

    @property
    def extraction_urls(self) -> list[str]:
        """The long-lived servers extraction may use: `server_urls`, else `server_url`, else none (start one)."""
        return self.server_urls or ([self.server_url.rstrip("/")] if self.server_url else [])

    server_url: str | None = Field(
        None, description="reuse a vLLM server already running at this URL; None = start one for the run"
    )
    server_urls: list[str] = Field(
        default_factory=list,
        description="several long-lived extraction servers: each shard run holds one of them while it runs",
    )
    host: str = Field("127.0.0.1", description="where a server started by the pipeline listens")
    port: int = Field(8000, ge=1, le=65535)
    tensor_parallel_size: int = Field(1, ge=1)
    dtype: str = "auto"
    max_model_len: int | None = Field(None, ge=16)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    max_concurrency: int = Field(16, ge=1, description="requests in flight per run")
    startup_timeout_s: float = Field(900.0, gt=0)
    cpu_kv_cache_gib: int | None = Field(
        None, description="the CPU build's KV cache in whole GiB (VLLM_CPU_KVCACHE_SPACE); None = vLLM's default, most "
        "of the RAM",
    )
    cpu_cores: int | None = Field(
        None,
        ge=1,
        description="the CPU build: cores each engine started here runs on, its own where free (README, "
        "'vLLM on a CPU host'); None = every free core but one, at least one",
    )
    extra_args: list[str] = Field(default_factory=list, description="more `vllm serve` arguments, passed as-is")


class AlertSettings(Section):
    """Stall and failure alerts (issue: operating it)."""

    stall_after_s: float = Field(900.0, gt=0, description="a shard run with no progress for this long is stalled")
    webhook_env: str = Field(
        "EAGLE3_ALERT_WEBHOOK", description="name of the environment variable holding the webhook URL (a secret)"
    )


class ApprovalSettings(Section):
    """When the daemon waits for a person before it starts a change (`python -m eagle3_assets.start --approve`)."""

    limit_s: float | None = Field(
        None,
        gt=0,
        description="a plan of what is due (`--plan`) estimated over this many seconds waits under the daemon until "
        "a person approves it; None = the daemon never waits. Seconds, because every step has them (rows, shard "
        "bytes and optimizer steps each price one kind of step only) and the plan measures them from the store's own "
        "past runs, so one figure prices generation, extraction and training alike in the time they hold the GPUs. "
        "A plan with a step no past run measures is not known to be under it, and waits too",
    )


class DemoSettings(Section):
    """The embedded demo target and prompt set (used when no target/prompts are configured)."""

    num_prompts: int = Field(4000, ge=1)
    hidden_size: int = Field(128, ge=32)
    num_layers: int = Field(4, ge=4)
    head_dim: int = Field(32, ge=32, description="vLLM cannot serve head_dim < 32")
    vocab_size: int = Field(1024, ge=64)
    train_steps: int = Field(
        3000, ge=0, description="the target's optimizer steps: 3,000 learn the world to the end (every template, "
        "two-thirds of the two-entity questions about held-out entities; 1,500 left a model whose guesses, and the "
        "drafter's served figure, differed by CPU); 0 = an untrained model (tests)",
    )  # fmt: skip
    seed: int = 0
    architecture: str = Field(
        "llama",
        description="the demo target's architecture: llama, or a miniature of a real target's (deepseek_v3 is "
        "Kimi-K2's; eagle3_assets/architectures/)",
    )

    @field_validator("architecture")
    @classmethod
    def _known_architecture(cls, name: str) -> str:
        if name not in ARCHITECTURES:
            raise ValueError(f"{name!r} is not an architecture the demo builds; name one of {', '.join(ARCHITECTURES)}")
        return name


class Settings(Section):
    """Everything the pipeline needs to know; validated when loaded."""

    target_model: str | None = Field(None, description="HF model directory (local or fsspec URL); None = demo target")
    trust_remote_code: bool = Field(
        False, description="run the tokenizer/model code that ships with the target (Kimi needs it); only for targets you trust"
    )
    prompts: str | None = Field(None, description="JSONL of prompts (local or fsspec URL); None = demo prompts")
    eval_prompts: str | None = Field(
        None, description="JSONL of held-out prompts for drafter_eval, never used in training; None = demo's"
    )
    traffic: TrafficSettings | None = Field(None, description="prompts from a request log (traffic_settings.py)")
    shard_size: int = Field(2000, ge=1, description="rows per hidden-state shard")
    aux_layer_ids: list[int] | None = Field(
        None, description="aux layers, 'input of layer i' ids; default [2, N//2, N-3]"
    )
    draft_vocab_size: int = Field(32000, ge=1)
    # Appends move token counts a little; a recomputed map would then move draft ids under a trained head, and a
    # drafter is never continued on a map it was not trained with (docs/DESIGN.md §3). 0.005: a token outside the
    # draft vocab is never drafted, so a kept map costs at most this share of positions' acceptance (below the 1%
    # a continued drafter may serve under a fresh one), while appends of a few % of rows move coverage by less.
    vocab_map_keep_margin: float = Field(
        0.005, ge=0.0, le=1.0, description="keep the previous vocab map while its coverage of the loss tokens is "
        "within this of a freshly computed map's (0 = recompute whenever a fresh map covers more)",
    )  # fmt: skip
    max_seq_len: int = Field(4096, ge=8, description="tokens per conversation row")
    overlong: Literal["truncate", "drop"] = Field("truncate", description="what to do with rows over max_seq_len")
    unfinished_responses: Literal["keep", "drop"] = Field(
        "keep",
        description="responses cut by max_new_tokens (finish_reason length): train on them as generated "
        "(no end-of-turn is added) or leave them out",
    )
    generation: GenerationSettings = GenerationSettings()
    extraction: ExtractionSettings = ExtractionSettings()
    training: TrainingSettings = TrainingSettings()
    drafters: list[str] = Field(
        default_factory=lambda: [EAGLE3.name],
        description="drafter families trained from the one data build; drafter_release serves the best of them",
    )
    dflash: DFlashSettings = DFlashSettings()
    vllm: VllmSettings = VllmSettings()
    alerts: AlertSettings = AlertSettings()
    approval: ApprovalSettings = ApprovalSettings()
    evaluation: EvaluationSettings = EvaluationSettings()
    demo: DemoSettings = DemoSettings()
    start_from: StartFromSettings | None = None  # a published drafter as the first release (start_from.py)

    @field_validator("aux_layer_ids")
    @classmethod
    def _distinct_layers(cls, ids: list[int] | None) -> list[int] | None:
        if ids is None:
            return None
        if len(ids) != 3:
            raise ValueError(f"EAGLE-3 fuses exactly 3 aux layers, got {len(ids)}: {ids}")
        seen: set[int] = set()
        for i in ids:
            if i < 1:
                raise ValueError(f"layer id {i} is below 1 (id 0 is the embedding output)")
            if i in seen:
                raise ValueError(f"layer id {i} appears twice in {ids}")
            seen.add(i)
        return sorted(ids)

    @field_validator("drafters")
    @classmethod
    def _known_families(cls, names: list[str]) -> list[str]:
        if not names:
            raise ValueError(f"no drafter family named; the families are {', '.join(family_names())}")
        for name in names:
            family_spec(name)  # an error naming the families there are
        if len(set(names)) != len(names):
            raise ValueError(f"a family is named twice in {names}")
        return names

    @model_validator(mode="after")
    def _dflash_servable(self) -> Settings:
        if DFLASH.name not in self.drafters:
            return self
        d = self.dflash
        if d.block_size < max(SPECULATIVE_TOKENS):
            raise ValueError(
                f"dflash.block_size: {d.block_size} mask slots, but drafter_eval serves "
                f"{max(SPECULATIVE_TOKENS)} speculative tokens and vLLM would draft the slots past the block "
                f"untrained; set it to at least {max(SPECULATIVE_TOKENS)}"
            )
        if d.block_size + 2 > self.max_seq_len:
            raise ValueError(f"dflash.block_size: {d.block_size} does not fit a row of max_seq_len {self.max_seq_len}")
        if self.training.rolling and "epochs" in d.model_fields_set and d.epochs != 1.0:
            raise ValueError(
                f"dflash.epochs: {d.epochs} in rolling mode, where each shard is deleted once trained; a second epoch "
                "would extract every shard again. Set dflash.epochs: 1 (or leave it out), or training.mode: offline"
            )
        if d.aux_layer_ids is not None and self.aux_layer_ids is not None:
            if missing := [i for i in d.aux_layer_ids if i not in self.aux_layer_ids]:
                raise ValueError(
                    f"dflash.aux_layer_ids: layers {missing} are not among the stored aux_layer_ids "
                    f"{self.aux_layer_ids}; the shards hold only those"
                )
        return self

    @model_validator(mode="after")
    def _one_rendezvous_per_family(self) -> Settings:
        # Rolling, every family trains at once (each shard is released once all of them consumed it), so two
        # torchrun jobs would meet at the one rendezvous the settings name; offline they train one after the other.
        launch = self.training.launch
        if self.training.rolling and len(self.drafters) > 1 and launch.nnodes > 1:
            raise ValueError(
                f"training.launch.nnodes: {launch.nnodes} nodes with training.mode rolling and drafters "
                f"{self.drafters}: the families train at once, and their jobs would meet at the one "
                f"training.launch.rdzv_endpoint ({launch.rdzv_endpoint}); train them on one node each (nnodes: 1), "
                "or in mode: offline"
            )
        return self

    def training_of(self, family: FamilySpec) -> TrainingSettings:
        """The training settings `family` trains by: `training`, less the fields its own section holds in their stead
        (`FamilySpec.recipe_fields`); in rolling mode every family passes each shard once, whatever its epochs."""
        fields = [f for f in family.recipe_fields if not (f == "epochs" and self.training.rolling)]
        if not fields:
            return self.training
        section = getattr(self, family.settings_section)
        return self.training.model_copy(update={f: getattr(section, f) for f in fields})

    @property
    def is_demo(self) -> bool:
        return self.target_model is None

    def check_evaluable(self) -> None:
        """Raise SettingsError naming the field when `drafter_eval` is bound to refuse, hours of training later:
        a prompt file of one's own with no held-out prompts beside it (the demo brings its own)."""
        if self.prompts is not None and self.eval_prompts is None:
            raise SettingsError(
                "eval_prompts: not set, but `prompts` is: drafter_eval serves the trained drafter on held-out prompts "
                "and would refuse after the drafter trained; name a JSONL of prompts never used in training "
                "(same format as `prompts`), or stop before it (python -m eagle3_assets.start --through drafter)"
            )

    def check_against_target(self, target: TargetModel) -> None:
        """Settings that only make sense for a given target; raise SettingsError naming the field."""
        vocab_size = target.vocab_size
        for name in self.drafters:
            family = family_spec(name)
            # A config that names no architecture says nothing to check (tests' hand-written configs).
            if target.architecture != "unknown" and target.architecture not in family.target_architectures:
                raise SettingsError(
                    f"drafters: vLLM serves no {name} drafter beside {target.architecture} ({target.path}/config.json): "
                    f"it serves one beside the {len(family.target_architectures)} architectures whose model gives a "
                    "drafter the target's hidden states (SupportsEagle3), e.g. LlamaForCausalLM, Qwen3MoeForCausalLM, "
                    "DeepseekV3ForCausalLM, KimiK25ForConditionalGeneration (eagle3_assets/families.py lists them)"
                )
        if target.quantization:
            # transformers 5.19 loads a compressed-tensors MoE's experts only where they are quantized and leaves the
            # others random without an error; the pipeline never runs a target it cannot trust HF to load.
            hf = [f"{s}.backend" for s in ("generation", "extraction") if getattr(self, s).backend == "hf"]
            if hf:
                raise SettingsError(
                    f"{', '.join(hf)}: hf cannot be trusted to load {target.path}, whose weights are quantized "
                    f"({target.quantization}); set {' and '.join(f'{f}: vllm' for f in hf)}"
                )
        if self.draft_vocab_size > vocab_size:
            raise SettingsError(
                f"draft_vocab_size: {self.draft_vocab_size} is larger than the target vocabulary ({vocab_size})"
            )
        mask = self.dflash.mask_token_id
        if DFLASH.name in self.drafters and mask is not None and mask >= vocab_size:
            raise SettingsError(
                f"dflash.mask_token_id: {mask} is outside the target vocabulary (ids 0..{vocab_size - 1})"
            )


def demo_settings(architecture: str = "llama") -> Settings:
    """The embedded demo: a 4-layer target (a miniature of `architecture`), 4,000 prompts in 400-row shards."""
    demo = DemoSettings(architecture=architecture)
    return Settings(
        shard_size=400,
        aux_layer_ids=[1, 2, 3],
        draft_vocab_size=512,
        max_seq_len=512,
        generation=GenerationSettings(max_new_tokens=160, batch_size=64, rows_per_part=200),
        # One row per forward: on CPU, padded batches cost more than they save
        # (benchmarks/bench_extraction.py); on a GPU keep the default budget.
        extraction=ExtractionSettings(batch_tokens=1, progress_interval_s=2.0),
        # The demo's 4,000 rows hold only ~120k tokens: many small packed steps over many
        # epochs (~1,057 steps). Over 16 epochs the drafter learns the training entities by
        # heart; weight decay keeps it reading the features, which is what unseen entities
        # need. Measured at k=3/7 (BENCHMARKS.md): weight decay 0.3 2.61/3.29, none 2.52/3.16.
        training=TrainingSettings(
            lr=3e-3, warmup_steps=20, epochs=16.0, batch_tokens=2048, weight_decay=0.3, checkpoint_every=100,
            heldout_rows=64,
        ),
        # Both families from the one data build; drafter_release serves the better (BENCHMARKS.md `families`). Beside
        # an MLA target EAGLE-3 alone: DFlash's drafter attends as Qwen3 does, and vLLM's CPU build without AMX shares
        # no KV block size between that and MLA (docs/DESIGN.md §6).
        drafters=[EAGLE3.name] if ARCHITECTURES[architecture].attention == "mla" else [EAGLE3.name, DFLASH.name],
        # DFlash by its own recipe (`dflash_settings.py`), measured on the demo (BENCHMARKS.md `dflash recipe`, k=3 / k=7):
        # 2 layers, not the references' 5 (3 served no more: 2.142 at 6 epochs against 2.076, 2.194 at 16 against
        # 2.290, at 1.4x the CPU); 16 epochs, not 6: the references' 6 are of 800K rows, the demo's 4,000 rows take more
        # passes (2.290 against 2.076, 937 CPU-s against 299). lr 3e-3, weight decay 0.3, 16 anchors or each slot's
        # own mean moved k=7 by 0.06 at most: the references' values stay.
        dflash=DFlashSettings(num_layers=2, epochs=16.0),
        demo=demo,
    )


def _format_validation_error(source: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {field}: {e['msg']}")
    return f"invalid settings in {source}:\n" + "\n".join(lines)


def parse_settings(data: dict, source: str = "settings") -> Settings:
    try:
        return Settings.model_validate(data)
    except ValidationError as e:
        raise SettingsError(_format_validation_error(source, e)) from None


def load_settings(environ: dict[str, str] | None = None) -> Settings:
    """Settings from $EAGLE3_CONFIG (YAML), or the demo settings when it is unset."""
    env = os.environ if environ is None else environ
    path = env.get(CONFIG_ENV)
    if not path:
        architecture = env.get(DEMO_ARCHITECTURE_ENV) or "llama"
        try:
            return demo_settings(architecture)
        except ValidationError as e:
            raise SettingsError(_format_validation_error(f"{DEMO_ARCHITECTURE_ENV}={architecture}", e)) from None
    try:
        with fsspec.open(path, "r", encoding="utf-8-sig") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise SettingsError(f"{CONFIG_ENV}={path}: file not found") from None
    except IsADirectoryError:
        raise SettingsError(f"{CONFIG_ENV}={path}: is a directory; name the YAML settings file in it") from None
    except (OSError, ValueError) as e:  # an unknown protocol, an unreadable file
        raise SettingsError(f"{CONFIG_ENV}={path}: cannot be read: {e}") from None
    except yaml.YAMLError as e:
        raise SettingsError(f"{CONFIG_ENV}={path}: not valid YAML: {e}") from None
    if not data:
        # Parsed, an empty file would be the demo's target with a production config's defaults,
        # refused later for settings the user never wrote.
        raise SettingsError(
            f"{CONFIG_ENV}={path}: the file holds no settings; name at least target_model and prompts, "
            f"or unset {CONFIG_ENV} for the demo"
        )
    if not isinstance(data, dict):
        raise SettingsError(f"{CONFIG_ENV}={path}: expected a mapping of settings, got {type(data).__name__}")
    settings = parse_settings(data, source=path)
    local_target = settings.target_model and "://" not in settings.target_model and Path(settings.target_model)
    if local_target and local_target.is_file():
        raise SettingsError(
            f"invalid settings in {path}: target_model: {settings.target_model} is a file; name the model's directory"
        )
    if local_target and local_target.is_dir():
        # A local target is checked now, so a wrong layer id fails the code location, not a shard hours later.
        from eagle3_assets.target import TargetModel, TargetModelError

        try:
            target = TargetModel.read(settings.target_model, aux_layer_ids=settings.aux_layer_ids)
            settings.check_against_target(target)
        except (SettingsError, TargetModelError) as e:
            raise SettingsError(f"invalid settings in {path}: {e}") from None
    return settings


def artifact_root(environ: dict[str, str] | None = None) -> str:
    """$EAGLE3_ROOT (any fsspec URL), default ./.eagle3 resolved against the working directory."""
    env = os.environ if environ is None else environ
    root = env.get(ROOT_ENV) or DEFAULT_ROOT
    if "://" not in root:
        return str(Path(root).resolve())
    protocol = root.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError) as e:
        raise SettingsError(f"{ROOT_ENV}={root}: {e}") from None
    return root
