"""Pipeline settings: one validated model, loaded from the YAML file named by EAGLE3_CONFIG.

Without EAGLE3_CONFIG the embedded demo applies: the project builds a tiny target
model and its prompts itself, so a fresh machine runs the whole graph offline.
Every error names the setting at fault, e.g. `aux_layer_ids: layer id 2 appears twice`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal, NamedTuple

import fsspec
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

CONFIG_ENV = "EAGLE3_CONFIG"
ROOT_ENV = "EAGLE3_ROOT"
DEFAULT_ROOT = ".eagle3"


class SettingsError(ValueError):
    """Settings that cannot work; the message names the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GenerationSettings(_Section):
    """How the target answers the prompts (`responses`)."""

    backend: Literal["hf", "vllm"] = "hf"
    max_new_tokens: int = Field(2048, ge=1)
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    batch_size: int = Field(32, ge=1, description="prompts per generate() call")
    rows_per_part: int = Field(256, ge=1, description="rows per atomically written part file: the resume granularity")
    max_error_rate: float = Field(0.05, ge=0.0, le=1.0, description="fail the asset when more rows than this fail")
    seed: int = 0


class ExtractionSettings(_Section):
    """How hidden states are extracted into shards (`hidden_states`)."""

    backend: Literal["hf", "vllm"] = "hf"
    batch_tokens: int = Field(16384, ge=1, description="padded tokens per forward batch (rows sorted by length)")
    storage_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    progress_interval_s: float = Field(30.0, gt=0, description="seconds between progress observations")
    disk_margin: float = Field(0.05, ge=0.0, description="extra free space required over the projection, as a fraction")
    max_retries: int = Field(2, ge=0, description="in-run retries of a failed shard")
    backfill_cron: str = Field("*/15 * * * *", description="when missing or failed shards are requested")


class TrainingSettings(_Section):
    """How the drafter is trained (`drafter`)."""

    ttt_steps: int = Field(7, ge=1, description="training-time-test unroll length")
    step_weight: float = Field(0.8, gt=0.0, le=1.0, description="loss weight of step k is step_weight**k")
    lr: float = Field(1e-4, gt=0.0)
    warmup_steps: int = Field(100, ge=0)
    epochs: float = Field(2.0, gt=0.0)
    batch_tokens: int = Field(8192, ge=1, description="tokens per optimizer step (padded)")
    grad_clip: float = Field(0.5, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    seed: int = 0
    checkpoint_every: int = Field(200, ge=1, description="optimizer steps between resumable checkpoints")
    heldout_rows: int = Field(64, ge=0, description="rows held out of training to report acc_k")
    device: Literal["auto", "cpu", "cuda"] = "auto"


class VllmSettings(_Section):
    """Engine settings passed through to vLLM when a backend is `vllm` (generation or extraction)."""

    server_url: str | None = Field(
        None, description="reuse a vLLM server already running at this URL; None = start one for the run"
    )
    host: str = Field("127.0.0.1", description="where a server started by the pipeline listens")
    port: int = Field(8000, ge=1, le=65535)
    tensor_parallel_size: int = Field(1, ge=1)
    dtype: str = "auto"
    max_model_len: int | None = Field(None, ge=16)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    reasoning_parser: str | None = Field(None, description="e.g. deepseek_r1 when <think>/</think> are single tokens")
    max_concurrency: int = Field(16, ge=1, description="requests in flight per run")
    startup_timeout_s: float = Field(900.0, gt=0)
    extra_args: list[str] = Field(default_factory=list, description="more `vllm serve` arguments, passed as-is")


class AlertSettings(_Section):
    """Stall and failure alerts (issue: operating it)."""

    stall_after_s: float = Field(900.0, gt=0, description="a shard run with no progress for this long is stalled")
    webhook_env: str = Field(
        "EAGLE3_ALERT_WEBHOOK", description="name of the environment variable holding the webhook URL (a secret)"
    )


class DemoSettings(_Section):
    """The embedded demo target and prompt set (used when no target/prompts are configured)."""

    num_prompts: int = Field(2000, ge=1)
    hidden_size: int = Field(128, ge=32)
    num_layers: int = Field(4, ge=4)
    head_dim: int = Field(32, ge=32, description="vLLM cannot serve head_dim < 32")
    vocab_size: int = Field(1024, ge=64)
    train_steps: int = Field(1500, ge=0, description="0 = an untrained model (tests)")
    seed: int = 0


class Settings(_Section):
    """Everything the pipeline needs to know; validated when loaded."""

    target_model: str | None = Field(None, description="HF model directory (local or fsspec URL); None = demo target")
    prompts: str | None = Field(None, description="JSONL of prompts (local or fsspec URL); None = demo prompts")
    eval_prompts: str | None = Field(
        None, description="JSONL of held-out prompts for drafter_eval, never used in training; None = demo's"
    )
    shard_size: int = Field(2000, ge=1, description="rows per hidden-state shard")
    aux_layer_ids: list[int] | None = Field(
        None, description="aux layers, 'input of layer i' ids; default [2, N//2, N-3]"
    )
    draft_vocab_size: int = Field(32000, ge=1)
    max_seq_len: int = Field(4096, ge=8, description="tokens per conversation row")
    overlong: Literal["truncate", "drop"] = Field("truncate", description="what to do with rows over max_seq_len")
    generation: GenerationSettings = GenerationSettings()
    extraction: ExtractionSettings = ExtractionSettings()
    training: TrainingSettings = TrainingSettings()
    vllm: VllmSettings = VllmSettings()
    alerts: AlertSettings = AlertSettings()
    demo: DemoSettings = DemoSettings()

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

    @property
    def is_demo(self) -> bool:
        return self.target_model is None

    def resolved_aux_layer_ids(self, num_layers: int) -> list[int]:
        """The aux layer ids for a model with `num_layers` decoder layers, checked against it."""
        ids = self.aux_layer_ids or default_aux_layer_ids(num_layers)
        bad = [i for i in ids if not 1 <= i <= num_layers - 1]
        if bad:
            raise SettingsError(
                f"aux_layer_ids: layer id(s) {bad} outside the model, which has {num_layers} layers "
                f"(valid 'input of layer i' ids: 1..{num_layers - 1})"
            )
        if len(set(ids)) != len(ids):
            raise SettingsError(
                f"aux_layer_ids: default ids {ids} collide for a {num_layers}-layer model; set them explicitly"
            )
        return ids

    def check_against_model(self, *, num_layers: int, vocab_size: int) -> None:
        """Settings that only make sense for a given model; raise SettingsError naming the field."""
        if self.draft_vocab_size > vocab_size:
            raise SettingsError(
                f"draft_vocab_size: {self.draft_vocab_size} is larger than the target vocabulary ({vocab_size})"
            )
        self.resolved_aux_layer_ids(num_layers)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """DESIGN §4: [2, N//2, N-3] (Kimi, 61 layers: [2, 30, 58])."""
    return [2, num_layers // 2, num_layers - 3]


def demo_settings() -> Settings:
    """The embedded demo: a 4-layer target, 2,000 prompts in 400-row shards."""
    demo = DemoSettings()
    return Settings(
        shard_size=400,
        aux_layer_ids=[1, 2, 3],
        draft_vocab_size=512,
        max_seq_len=512,
        generation=GenerationSettings(max_new_tokens=160, batch_size=64, rows_per_part=200),
        # One row per forward: on CPU, padded batches cost more than they save
        # (benchmarks/bench_extraction.py); on a GPU keep the default budget.
        extraction=ExtractionSettings(batch_tokens=1, progress_interval_s=2.0),
        # The demo's 2,000 rows hold only ~60k tokens: many small steps over many epochs
        # (625 steps; 1,000 rows for 900 steps drafted worse, BENCHMARKS.md).
        training=TrainingSettings(
            lr=3e-3, warmup_steps=20, epochs=20.0, batch_tokens=2048, checkpoint_every=100, heldout_rows=64
        ),
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


class ModelShape(NamedTuple):
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_context: int  # max_position_embeddings; 0 when the config does not say


def read_model_shape(model_path: str) -> ModelShape | None:
    """The target's shape from its config.json, or None when it cannot be read here."""
    try:
        with fsspec.open(f"{model_path.rstrip('/')}/config.json", "r") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    try:
        return ModelShape(
            int(cfg["num_hidden_layers"]),
            int(cfg.get("hidden_size", 0)),
            int(cfg["vocab_size"]),
            int(cfg.get("max_position_embeddings") or 0),
        )
    except (KeyError, TypeError, ValueError):
        return None


def load_settings(environ: dict[str, str] | None = None) -> Settings:
    """Settings from $EAGLE3_CONFIG (YAML), or the demo settings when it is unset."""
    env = os.environ if environ is None else environ
    path = env.get(CONFIG_ENV)
    if not path:
        return demo_settings()
    try:
        with fsspec.open(path, "r") as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise SettingsError(f"{CONFIG_ENV}={path}: file not found") from None
    except yaml.YAMLError as e:
        raise SettingsError(f"{CONFIG_ENV}={path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"{CONFIG_ENV}={path}: expected a mapping of settings, got {type(data).__name__}")
    settings = parse_settings(data, source=path)
    if settings.target_model:
        shape = read_model_shape(settings.target_model)
        if shape is not None:
            try:
                settings.check_against_model(num_layers=shape.num_layers, vocab_size=shape.vocab_size)
            except SettingsError as e:
                raise SettingsError(f"invalid settings in {path}: {e}") from None
    return settings


def artifact_root(environ: dict[str, str] | None = None) -> str:
    """$EAGLE3_ROOT (any fsspec URL), default ./.eagle3 resolved against the working directory."""
    env = os.environ if environ is None else environ
    root = env.get(ROOT_ENV) or DEFAULT_ROOT
    if "://" not in root:
        root = str(Path(root).resolve())
    return root
