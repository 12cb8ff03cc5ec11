"""Train speculators' EAGLE-3 (or DFlash) drafter on CPU, for exactly N optimizer steps; runs INSIDE the peer venv.

    .peer/speculators/bin/python benchmarks/peer/speculators_cpu.py \\
        --data /tmp/peer-data --target /tmp/peer-demo-store/target_model/model --out /tmp/peer-spec \\
        --steps 155 --lr 3e-3 --warmup-steps 20 --ttt-steps 7 --step-weight 0.8 --total-seq-len 2048

`--data` is the output of `convert_shards.py` (project venv). The last stdout line is one
JSON object: steps, CPU seconds per step (process time: all threads of this process,
data loading included, validation and checkpoint writes excluded), wall time, tokens per
step, the last step's and the last validation's metrics, and `export_dir`, a directory
vLLM 0.32 serves as an EAGLE-3 draft (`speculative_config={"method": "eagle3", "model": ...}`).

What speculators 0.9.0 needs (read from its installed source; nothing of it is copied here)
-----------------------------------------------------------------------------------------
Data. `speculators train --data-path D` loads a HF `datasets` dataset with
`load_from_disk(D)` (columns `input_ids`, `loss_mask`, `seq_len`, torch format); the loss
mask comes from that dataset (1 = assistant token; the hidden-state files carry none),
so it knows assistant tokens only through `loss_mask`. The hidden states come from the
"file" backend: `<hidden-states-path>/hs_<i>.safetensors` for dataset row i, with
`hidden_states` [T, L+1, H] (the L aux layers, then the last layer; vLLM's
extract_hidden_states layout, last layer PRE-norm) and `token_ids` [T], which must equal
the row's `input_ids` or the sample is dropped. Its trainer computes the target
distribution itself: `verifier_lm_head(verifier_norm(last))`, restricted to the draft
vocab rows, with the target's final norm and lm_head loaded from `--verifier-name-or-path`
(a local HF dir). Train/validation split: by position, the first int(N * train_data_ratio)
rows train, the rest validate (no shuffle), so this wrapper passes a ratio that makes the
first `n_train` rows (ours, by the converter's order) its training split. Batches are
packed: one row of `--total-seq-len` tokens per step, samples concatenated with
document-id masking (multipack sampler over shuffled lengths), a sample split at the
budget's end; after `shift_batch` each sample loses one token.

Vocab map. `--d2t-path` / `--t2d-path` (.npy, the same d2t/t2d as ours: d2t offsets
int64 [draft], t2d bool [target]) and `--draft-vocab-size`; the model checks
sum(t2d) == draft size and initialises `lm_head` (frozen) and `verifier_lm_head` from the
target's lm_head rows where t2d is true.

Trainer. `TrainConfig.resolve(argv)` takes the `speculators train` flags; `cli.main(cfg)`
builds the draft (`Eagle3DraftModel.from_training_args`: a one-layer Llama; defaults
norm_before_fc, norm_output, norm_before_residual all true; embeddings frozen), the
loaders and a `Trainer`. Settings used: `--max-steps` (optimizer steps, across epochs;
the schedule then spans max_steps), `--lr`, `--optimizer adamw|muon` (default muon),
`--weight-decay` (default 0.01), `--scheduler-type cosine --scheduler-warmup-steps`
(transformers' get_cosine_schedule_with_warmup, 0.5 cycles), `--ttt-steps`,
`--ttt-step-loss-decay` (step k weighted decay**k), `--loss-fn` (default kl_div),
`--loss-implementation` (default "fused", a Triton kernel: on CPU it must be "eager"),
`--total-seq-len` (token budget per step), `--hidden-states-dtype` (data dtype and autocast
dtype), `--draft-attn-impl simple_flex_attention|sdpa|eager` (default flex attention, which has no
backward on CPU in torch 2.13: "FlexAttention does not support backward on CPU", so
this wrapper uses sdpa, the option speculators documents for hardware without flex), `--seed` (default 42),
`--num-workers`. Grad clip 1.0 is hard-coded. TTT: the fed-back state is the layer output
(post-norm with norm_output); the token fed at step k is the ground-truth token shifted
by k (teacher forcing), not the draft's own argmax.

CPU. The `Trainer` moves the model to `local_rank` (0 = cuda:0), autocasts on "cuda" when
no accelerator is visible, and its step timer calls `torch.accelerator.synchronize()`
every logged step (raises on a CPU-only torch). This wrapper subclasses the trainer
(model and batches to "cpu", autocast on "cpu"), replaces the step timer with one that
does not synchronise, stops an epoch loop that `max_steps` has already reached (the
stock loop runs one step more in each epoch after the limit), and records process time
per step through the trainer's own `step_callback`. `torch.compile` is used by
speculators only when CUDA is available, so nothing is compiled here.

Checkpoint. At each epoch end the trainer saves `<save-path>/<epoch>/` with
`save_pretrained`: `config.json` in speculators' format (`speculators_model_type:
"eagle3"`, `architectures: ["Eagle3Speculator"]`, `transformer_layer_config` (a Llama
config), `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids` (vLLM's "input of layer i"
ids), `norm_before_residual`, `norm_before_fc`, `norm_output`, `speculators_config` with
the verifier path) and `model.safetensors` in bf16 (`fc.weight`, `input_norm.weight`,
`layers.0.*` with 2H-wide q/k/v and `hidden_norm`, `norm.weight`, `lm_head.weight`,
`d2t`, `t2d`, and `embed_tokens.weight`); vLLM 0.32 reads that format directly. The
final epoch's directory, minus the optimizer state, is copied to `<out>/export/`.

DFlash (`--speculator-type dflash`). The same data, vocab map, trainer and CPU patches; the draft is
`DFlashDraftModel` (Qwen3 layers, `--num-layers`, default 5), its block `--block-size` tokens
including the anchor (the bonus token: block_size - 1 drafted), `--max-anchors` blocks per row,
`--mask-token-id` the id its mask slots carry, per-slot loss weights D-PACE (`--dflash-decay-gamma`),
loss `ce` (its DFlash default) on the target's logits; the TTT flags do not apply and are not
passed. Those knobs go through `--spec-arg FLAG=VALUE`. Its `config.json`
(`speculators_model_type: "dflash"`) is what vLLM 0.32 serves as `method: "dflash"`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # speculators' rich progress bars: noise in a log
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local target only, never the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def build_dataset(data_dir: Path, manifest: dict) -> Path:
    """speculators' arrow dataset (input_ids, loss_mask, seq_len) from the converted hs files."""
    import torch
    from datasets import Dataset, load_from_disk
    from safetensors import safe_open

    ds_dir = data_dir / "speculators_dataset"
    stamp = ds_dir / "built_from.json"
    key = {"rows": manifest["rows"]}
    if stamp.exists() and json.loads(stamp.read_text()) == key:
        return ds_dir
    ids, masks, lens = [], [], []
    for i in range(len(manifest["rows"])):
        with safe_open(str(data_dir / "hidden_states" / f"hs_{i}.safetensors"), framework="pt") as f:
            tok = f.get_tensor("token_ids")
            mask = f.get_tensor("loss_mask")
        ids.append(tok.tolist())
        masks.append(mask.to(torch.int64).tolist())
        lens.append(len(tok))
    if ds_dir.exists():
        shutil.rmtree(ds_dir)
    ds = Dataset.from_dict({"input_ids": ids, "loss_mask": masks, "seq_len": lens})
    ds.set_format(type="torch")
    ds.save_to_disk(str(ds_dir))
    check = load_from_disk(str(ds_dir))
    assert len(check) == len(ids) and torch.equal(check[0]["input_ids"], torch.tensor(ids[0]))
    stamp.write_text(json.dumps(key))
    return ds_dir


STEP_LINE = "[speculators-cpu] step"


class _Recorder:
    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.wall: list[float] = []
        self.tokens: list[int] = []
        self.train: list[dict] = []
        self.val: list[dict] = []
        self.t_cpu = time.process_time()
        self.t_wall = time.perf_counter()

    def mark(self) -> None:
        self.t_cpu, self.t_wall = time.process_time(), time.perf_counter()

    def step(self) -> None:
        c, w = time.process_time(), time.perf_counter()
        self.cpu.append(c - self.t_cpu)
        self.wall.append(w - self.t_wall)
        self.t_cpu, self.t_wall = c, w
        # Progress, and the CPU cost so far for a caller that plans a run against it (bench_peer_speculators).
        print(f"{STEP_LINE} {len(self.cpu)} cpu_s {self.cpu[-1]:.4f}", file=sys.stderr, flush=True)


REC = _Recorder()


class _MetricsHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if isinstance(msg, dict):
            if "train" in msg:
                REC.train.append({"step": msg.get("global_step"), **msg["train"]})
            if "val" in msg:
                REC.val.append({"epoch": msg.get("epoch"), **msg["val"]})


def install_cpu_patches(max_steps: int) -> None:
    import torch
    import speculators.train.cli as spec_cli
    import speculators.train.trainer as spec_trainer

    base_timer = spec_trainer._StepTimer

    class CpuStepTimer(base_timer):
        """The trainer's step timer without `torch.accelerator.synchronize()` (nothing to wait for on CPU)."""

        def mark(self, name: str) -> None:
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self) -> float | None:
            return time.perf_counter() if self.enabled else None

        def profile(self, num_tokens: int) -> dict | None:
            REC.tokens.append(int(num_tokens))
            return super().profile(num_tokens)

    class CpuTrainer(spec_trainer.Trainer):
        """speculators' Trainer on the CPU: model, batches and autocast on "cpu"."""

        def setup_model(self):
            self.local_rank = "cpu"  # Trainer moves the model and every batch to self.local_rank
            self.device_type = "cpu"  # autocast device
            super().setup_model()
            # Exactly as many epochs as max_steps needs: each extra epoch would validate and checkpoint again.
            per_epoch = len(self.train_loader)
            self.config = self.config._replace(num_epochs=max(1, math.ceil(max_steps / per_epoch)))
            self.steps_per_epoch = per_epoch

        def train_epoch(self, epoch, *, step_callback=None):
            if self.config.max_steps is not None and self.global_step >= self.config.max_steps:
                return  # the stock loop would run one more step before checking max_steps
            REC.mark()

            def on_step():
                REC.step()
                if step_callback is not None:
                    step_callback()

            return super().train_epoch(epoch, step_callback=on_step)

    spec_trainer._StepTimer = CpuStepTimer
    spec_cli.Trainer = CpuTrainer

    setup_metric_logger = spec_cli.setup_metric_logger

    def setup_metric_logger_and_record(*args, **kwargs):
        setup_metric_logger(*args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(_MetricsHandler())

    spec_cli.setup_metric_logger = setup_metric_logger_and_record
    del torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="speculators' EAGLE-3 trainer on CPU for exactly --steps steps.")
    ap.add_argument("--data", required=True, type=Path, help="convert_shards.py output")
    ap.add_argument("--target", required=True, type=Path, help="the target's local HF model directory")
    ap.add_argument("--out", required=True, type=Path, help="checkpoints, logs, export/ and result.json go here")
    ap.add_argument("--speculator-type", default="eagle3", choices=["eagle3", "dflash"])
    ap.add_argument(
        "--spec-arg", action="append", default=[], metavar="FLAG=VALUE",
        help="one more `speculators train` flag, e.g. --spec-arg num-layers=2 (DFlash's --block-size, --max-anchors, ...)",
    )  # fmt: skip
    ap.add_argument("--steps", type=int, default=155)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--scheduler", default="cosine", choices=["cosine", "linear", "none"])
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--step-weight", type=float, default=0.8, help="--ttt-step-loss-decay: step k weighted w**k")
    ap.add_argument("--total-seq-len", type=int, default=2048, help="packed tokens per optimizer step")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"])
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--loss-fn", default=None, help="speculators' --loss-fn (default: its own, kl_div)")
    ap.add_argument(
        "--attn-impl", default="sdpa", choices=["sdpa", "eager"],
        help="speculators' default simple_flex_attention has no backward on CPU (NotImplementedError)",
    )  # fmt: skip
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="data + autocast dtype")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or None)
    args = ap.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    data_dir, out = args.data.resolve(), args.out.resolve()
    manifest = json.loads((data_dir / "manifest.json").read_text())
    n_train, n_total = manifest["n_train"], len(manifest["rows"])
    if not 0 < n_train < n_total:
        raise SystemExit("speculators needs a validation split: convert with --heldout-rows >= 1")
    ratio = (n_train + 0.5) / n_total  # int(n_total * ratio) == n_train, away from float edges
    assert int(n_total * ratio) == n_train
    ds_dir = build_dataset(data_dir, manifest)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_path = out / "checkpoints"

    spec_argv = [
        "--verifier-name-or-path", str(args.target.resolve()),
        "--data-path", str(ds_dir),
        "--hidden-states-path", str(data_dir / "hidden_states"),
        "--on-missing", "raise",
        "--save-path", str(save_path),
        "--log-dir", str(out / "logs"),
        "--d2t-path", str(data_dir / "d2t.npy"),
        "--t2d-path", str(data_dir / "t2d.npy"),
        "--draft-vocab-size", str(manifest["draft_vocab_size"]),
        "--target-layer-ids", *[str(i) for i in manifest["aux_layer_ids"]],
        "--train-data-ratio", repr(ratio),
        "--total-seq-len", str(args.total_seq_len),
        "--max-steps", str(args.steps),
        "--epochs", str(args.steps),  # upper bound; the wrapper trims it to ceil(steps / steps per epoch)
        "--lr", repr(args.lr),
        "--optimizer", args.optimizer,
        "--weight-decay", repr(args.weight_decay),
        "--scheduler-type", args.scheduler,
        "--scheduler-warmup-steps", str(args.warmup_steps),
        "--hidden-states-dtype", args.dtype,
        "--draft-attn-impl", args.attn_impl,
        "--loss-implementation", "eager",  # the default "fused" loss needs Triton (a GPU)
        "--num-workers", "0",
        "--seed", str(args.seed),
        "--log-freq", "1",
        "--no-resume-from-checkpoint",
    ]  # fmt: skip
    spec_argv += ["--speculator-type", args.speculator_type]
    if args.speculator_type == "eagle3":  # test-time training: EAGLE-3's recipe, no DFlash knob
        spec_argv += ["--ttt-steps", str(args.ttt_steps), "--ttt-step-loss-decay", repr(args.step_weight)]
    for given in args.spec_arg:
        flag, sep, value = given.partition("=")
        if not sep:
            raise SystemExit(f"--spec-arg {given!r}: expected FLAG=VALUE")
        spec_argv += [f"--{flag.removeprefix('--')}", value]
    if args.loss_fn:
        spec_argv += ["--loss-fn", args.loss_fn]

    from speculators.train.cli import main as spec_main
    from speculators.train.config import TrainConfig

    install_cpu_patches(args.steps)
    cfg = TrainConfig.resolve(spec_argv)
    t_cpu0, t_wall0 = time.process_time(), time.perf_counter()
    spec_main(cfg)
    total_cpu, total_wall = time.process_time() - t_cpu0, time.perf_counter() - t_wall0

    steps = len(REC.cpu)
    if steps != args.steps:
        raise SystemExit(f"speculators ran {steps} optimizer steps, expected {args.steps}")
    epochs = sorted(int(p.name) for p in save_path.iterdir() if p.is_dir() and not p.is_symlink() and p.name.isdigit())
    final = save_path / str(epochs[-1])
    export = out / "export"
    export.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(final / name, export / name)
    result = {
        "tool": "speculators",
        "steps": steps,
        "epochs_run": len(epochs),
        "cpu_s_per_step_mean": statistics.fmean(REC.cpu),
        "cpu_s_per_step_median": statistics.median(REC.cpu),
        "cpu_s_train_steps": sum(REC.cpu),
        "wall_s_per_step_mean": statistics.fmean(REC.wall),
        "cpu_s_total_process_run": total_cpu,
        "wall_s_total_run": total_wall,
        "threads": torch.get_num_threads(),
        "tokens_per_step_mean": statistics.fmean(REC.tokens) if REC.tokens else None,
        "cpu_s_per_step": REC.cpu,
        "last_train_metrics": REC.train[-1] if REC.train else {},
        "train_metrics": REC.train,  # every logged step: the learning curve
        "last_val_metrics": REC.val[-1] if REC.val else {},
        "n_train_rows": n_train,
        "n_val_rows": n_total - n_train,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "speculators_argv": spec_argv,
        "checkpoint": str(final),
        "export_dir": str(export),
    }
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
