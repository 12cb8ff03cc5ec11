"""The `training` settings section, with its `launch` subsection: how the `drafter` asset trains (the EAGLE-3 recipe,
which every family shares unless its own section holds a field in its stead: `Settings.training_of`) and how it starts
its torchrun job.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from eagle3_assets.section import Section

MAX_RANKS_PER_NODE = 256


class LaunchSettings(Section):
    """How the `drafter` asset starts training: a torchrun job of `nnodes` x `nproc_per_node` ranks."""

    nproc_per_node: Literal["auto"] | int = Field(
        "auto", description="ranks on this node: auto = one per visible GPU (1 without CUDA), or a number "
        "(on CPU, several gloo ranks: tests and benchmarks)",
    )
    nnodes: int = Field(1, ge=1, description="nodes in the job; every node runs the same torchrun command")
    rdzv_endpoint: str | None = Field(
        None, description="host:port where the nodes meet (torchrun's rendezvous); required when nnodes > 1"
    )
    rdzv_id: str = Field("eagle3-drafter", min_length=1, description="the job's name at the rendezvous")
    rdzv_backend: Literal["c10d"] = "c10d"
    join_timeout_s: float = Field(
        600.0, gt=0, description="several nodes: how long each waits at the rendezvous for the others (a node that "
        "never arrives fails the job after this long, named)",
    )
    collective_timeout_s: float = Field(
        600.0, gt=0, description="a collective that waits longer than this (a rank lost) ends the job"
    )

    @field_validator("nproc_per_node", mode="before")
    @classmethod
    def _nproc(cls, value: object) -> object:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_RANKS_PER_NODE):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_RANKS_PER_NODE:
            # On a CPU node torchrun would fork every one of them before the first could fail.
            raise ValueError(
                f"{value} ranks on one node: no node runs more than {MAX_RANKS_PER_NODE} (one per GPU, or a few CPU "
                "ranks); give 'auto' (one rank per visible GPU) or the node's GPU count"
            )
        raise ValueError(f"{value!r}: give 'auto' (one rank per visible GPU) or a whole number of ranks, 1 or more")

    @field_validator("rdzv_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{value!r} is not host:port, e.g. 'eagle3-drafter-0.eagle3-drafter-pods:29400'")
        return value

    @model_validator(mode="after")
    def _nodes_meet(self) -> LaunchSettings:
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ValueError(
                f"nnodes: {self.nnodes} nodes must meet somewhere: set training.launch.rdzv_endpoint to host:port "
                "of a node every node reaches (on Kubernetes, the rendezvous Service)"
            )
        return self


class TrainingSettings(Section):
    """How the drafter is trained (`drafter`)."""

    ttt_steps: int = Field(7, ge=1, description="training-time-test unroll length")
    step_weight: float = Field(0.8, gt=0.0, le=1.0, description="loss weight of step k is step_weight**k")
    lr: float = Field(1e-4, gt=0.0)
    warmup_steps: int = Field(100, ge=0)
    epochs: float = Field(2.0, gt=0.0)
    steps: int | None = Field(None, ge=1, description="optimizer steps of the whole schedule, instead of epochs")
    batch_tokens: int = Field(8192, ge=1, description="tokens per optimizer step, padding included")
    batch_order: Literal["packed", "random", "by_length"] = Field(
        "packed",
        description="a batch is a random draw of samples, several to a row (packed) or one to a padded row "
        "(random), or neighbours of similar length (by_length: less padding, but batches of one kind where "
        "length follows content)",
    )
    grad_clip: float = Field(0.5, gt=0.0)
    adam_beta2: float = Field(0.95, gt=0.0, lt=1.0, description="AdamW's second-moment decay (beta1 is 0.9)")
    weight_decay: float = Field(0.0, ge=0.0)
    seed: int = 0
    checkpoint_every: int = Field(200, ge=1, description="optimizer steps between resumable checkpoints")
    heldout_rows: int = Field(64, ge=0, description="rows held out of training to report acc_k")
    # Checkpoint choice (README, "Choosing the checkpoint"): the held-out acceptance estimate ranks
    # checkpoints where loss does not; evaluating 64 rows costs about what a few training steps cost.
    eval_every: int = Field(
        200, ge=1, description="optimizer steps between held-out evaluations (loss, acc_k, acceptance estimate); "
        "the last step is always evaluated",
    )  # fmt: skip
    # Measured on the demo (BENCHMARKS.md, `checkpoint choice`): the estimate plateaus within its noise at the
    # end of the schedule, so `best` picked an earlier step that served less (k=3 2.571 / 2.596 vs the last 2.607).
    export_checkpoint: Literal["best", "last"] = Field(
        "last",
        description="export the last step's weights, or the evaluated weights with the highest estimated acceptance "
        "length at k=3 (kept in drafter/checkpoints/best); the last checkpoint stays in drafter/checkpoints either way",
    )
    early_stop_evals: int | None = Field(
        None, ge=1, description="stop once this many held-out evaluations in a row did not raise the estimate; "
        "None = train the whole schedule",
    )  # fmt: skip
    device: Literal["auto", "cpu", "cuda"] = "auto"
    launch: LaunchSettings = LaunchSettings()
    # The recipe. Defaults by the ablation (BENCHMARKS.md): the three norms together drafted
    # 5.5% (k=3) / 7.8% (k=7) better than none at the same steps and cost; the other options
    # did not move acceptance. SGLang cannot serve the norms: see `serve_with`.
    norm_before_fc: bool = Field(True, description="RMSNorm over the fused aux features before fc")
    norm_before_residual: bool = Field(True, description="the layer's residual is the normed hidden state")
    norm_output: bool = Field(True, description="each TTT step feeds the next one its normed output")
    train_lm_head: bool = Field(True, description="train lm_head (started from the target's rows) or keep it frozen")
    loss: Literal["soft_ce", "kl", "lk"] = Field("soft_ce", description="soft cross-entropy, KL, or -log acceptance")
    loss_positions: Literal["predicted", "input"] = Field(
        "predicted", description="a prediction is trained when the predicted token is generated, or the input token"
    )
    serve_with: list[Literal["vllm", "sglang"]] = Field(
        default_factory=lambda: ["vllm"],
        description="engines the export must serve in; with 'sglang', the three norm options must be off",
    )
    # How the data reaches training (README, "Training past the disk").
    mode: Literal["offline", "rolling"] = Field(
        "offline",
        description="offline: train once every shard is on disk; rolling: train each shard as it lands and delete "
        "it once a checkpoint has learnt it, with at most window_shards complete shards on disk",
    )
    window_shards: int = Field(2, ge=1, description="rolling: complete shards on disk at most (extraction waits)")
    shard_wait_s: float = Field(
        6 * 3600.0, gt=0, description="rolling: how long training waits for the next shard before the run fails"
    )
    sample_ledger: bool = Field(
        False, description="record every trained sample's row and step in each checkpoint (an audit of exactly-once)"
    )
    # Continuing the released drafter on appended rows (docs/DESIGN.md §5, `drafter/continuation.py`).
    replay_rows: int | None = Field(
        None, ge=0, description="continuing: old rows replayed beside the new ones (seeded, never a held-out row); "
        "None = every old training row. Measured on the demo (BENCHMARKS.md `continue`, 400 rows appended to 3,600, "
        "continue_fraction 0.25): every old row served 0.980 / 0.990 of a from-scratch drafter at k=3 / k=7 and above "
        "the release; as many as the new rows 0.931 / 0.903, none 0.901 / 0.867, both below the release it started "
        "from. The replay costs no optimizer steps; a number bounds it",
    )  # fmt: skip
    # Rolling mode releases every shard it trains, so old rows are gone when prompts are appended: a continuation
    # replays from copies kept before each release. A row costs its sample file, ~4 x hidden_size x 2 bytes per token
    # in bf16 (~83 MB for the seed run's rows, ~0.6 GB for 10k-token rows of a Kimi-shaped target): 1,000 rows are
    # half a default 2,000-row shard, and cover with full replay any append of up to 1,000 rows.
    replay_reservoir_rows: int = Field(
        1000, ge=0, description="rolling: rows of the released shards kept (seeded, a uniform share of each shard) "
        "under drafter/replay/ for a later continuation to replay; 0 keeps none (a continuation then replays nothing)",
    )  # fmt: skip
    continue_fraction: float = Field(
        0.25, gt=0.0, le=1.0, description="continuing: the optimizer steps of a continuation, as a share of the "
        "steps a from-scratch run would take (rounded down). Measured on the demo (BENCHMARKS.md `continue`): with "
        "every old row replayed, 0.25 (264 of 1,057 steps, 0.26x the CPU) served 0.980 / 0.990 of a from-scratch "
        "drafter at k=3 / k=7, 0.1 (105 steps) 0.961 / 0.948; with 400 replayed rows 0.1 and 0.25 served alike "
        "(k=3 2.479), both below the release. 0.25 is kept: within 2% of from scratch at the issue's cost bound",
    )  # fmt: skip

    @property
    def rolling(self) -> bool:
        """Whether training takes the shards as they land, each released once learnt (`mode: rolling`), rather than
        every shard at once after all are extracted (`offline`)."""
        return self.mode == "rolling"

    @model_validator(mode="after")
    def _servable(self) -> TrainingSettings:
        if "sglang" in self.serve_with:
            flags = [f for f in ("norm_before_fc", "norm_before_residual", "norm_output") if getattr(self, f)]
            if flags:
                raise ValueError(
                    f"{', '.join(flags)}: SGLang's EAGLE-3 drafter has no such option and would serve this export "
                    "without it, drafting wrongly; remove 'sglang' from training.serve_with to use it (vLLM reads it)"
                )
        return self

    @model_validator(mode="after")
    def _evaluated(self) -> TrainingSettings:
        if self.heldout_rows == 0 and (self.early_stop_evals is not None or "export_checkpoint" in self.model_fields_set
                                       and self.export_checkpoint == "best"):  # fmt: skip
            raise ValueError(
                "heldout_rows: 0 leaves nothing to evaluate, so early_stop_evals and export_checkpoint: best have "
                "nothing to go by; hold rows out (heldout_rows > 0) or remove those settings"
            )
        if self.rolling and self.early_stop_evals is not None:
            raise ValueError(
                "early_stop_evals: rolling mode trains and releases each shard as it lands; stopping early would "
                "leave the rest extracted for nothing or never released. Remove it, or use mode: offline"
            )
        return self

    @model_validator(mode="after")
    def _single_pass_when_rolling(self) -> TrainingSettings:
        if not self.rolling:
            return self
        # A released shard is gone: a second epoch would have to extract every shard again. Real runs at
        # the scale rolling mode is for see each sample once (README, "Training past the disk").
        if self.steps is not None:
            raise ValueError(
                "steps: rolling mode trains every shard once and plans its steps from the tokenized set; remove "
                "training.steps (or use mode: offline)"
            )
        if "epochs" not in self.model_fields_set:
            object.__setattr__(self, "epochs", 1.0)
        elif self.epochs != 1.0:
            raise ValueError(
                f"epochs: {self.epochs} in rolling mode, where each shard is deleted once trained; a second epoch "
                "would extract every shard again. Set epochs: 1 (more rows instead of more epochs), or mode: offline"
            )
        return self
