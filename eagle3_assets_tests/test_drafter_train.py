"""Training runs: a killed run resumes with the same step counter and loss curve, time slices,
memory:// stores, checkpoint contents, the shard guard, and that the drafter learns."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file
from safetensors.torch import save as st_save

from eagle3_assets.drafter.checkpoint import (
    CheckpointError,
    StagingFull,
    checkpoint_rel,
    list_checkpoints,
    read_checkpoint_state,
    save_checkpoint,
)
from eagle3_assets.drafter.launch import LaunchRefused, refuse_another_world_size
from eagle3_assets.drafter.run import export_choice
from eagle3_assets.drafter.selection import BEST_DIR
from eagle3_assets.drafter.schedule import short_run_warning, warmup_cosine
from eagle3_assets.drafter.train import NonFiniteLossError, TrainingError, train_drafter
from eagle3_assets.sample_file import read_header
from eagle3_assets.settings import TrainingSettings
from eagle3_assets.storage import ArtifactStore

from .helpers import greedy_vocab_map, random_rows, target_of, tiny_llama, write_shard

pytestmark = pytest.mark.slow  # trains drafters

SETTINGS = TrainingSettings(
    ttt_steps=3, lr=3e-3, warmup_steps=2, epochs=2.0, batch_tokens=96, checkpoint_every=2, heldout_rows=4, seed=0
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A target and two complete shards of 16 rows, written once; tests copy the store."""
    root = tmp_path_factory.mktemp("train-data")
    model = tiny_llama(root / "target")
    store = ArtifactStore(root / "store")
    rows = random_rows(32, seed=0, min_len=8, max_len=16)
    keys = [write_shard(store, model, rows[:16], 0), write_shard(store, model, rows[16:], 16)]
    return root, keys, greedy_vocab_map(model, rows)


def copy_store(data, dest: Path) -> ArtifactStore:
    root, *_ = data
    shutil.copytree(root / "store", dest)
    return ArtifactStore(dest)


def run(store, data, settings=SETTINGS, **kw):
    root, keys, vmap = data
    curve: dict[int, float] = {}
    result = train_drafter(
        store, keys, vmap=vmap, target=target_of(root / "target"), settings=settings,
        on_metrics=lambda step, m: curve.setdefault(step, m["loss"]) if "loss" in m else None,
        log=lambda _: None, **kw,
    )
    return result, curve


TRAIN_RUN = textwrap.dedent(
    """
    import json, os, signal, sys
    import numpy as np, torch
    from eagle3_assets.drafter.train import train_drafter
    from eagle3_assets.settings import TrainingSettings
    from eagle3_assets.storage import ArtifactStore
    from eagle3_assets.target import TargetModel
    from eagle3_assets.vocab_map import VocabMap

    args = json.loads(sys.argv[1])
    torch.set_num_threads(args["threads"])
    log = open(args["curve"], "a")

    def on_metrics(step, m):
        log.write(json.dumps([step, m["loss"]]) + "\\n")
        log.flush()
        if step == args["kill_at"]:
            os.kill(os.getpid(), signal.SIGKILL)

    r = train_drafter(
        ArtifactStore(args["store"]), args["keys"], vmap=VocabMap(np.array(args["d2t"]), np.array(args["t2d"])),
        target=TargetModel.read(args["target"], aux_layer_ids=[1, 2, 3]), settings=TrainingSettings(**args["settings"]),
        on_metrics=on_metrics,
    )
    json.dump({"step": r.step, "total": r.total_steps, "resumed_from": r.resumed_from, "heldout": r.heldout},
              open(args["result"], "w"))
    """
)


def train_in_subprocess(tmp_path: Path, data, store_dir: Path, name: str, kill_at: int | None = None):
    """One `train_drafter` call in a fresh interpreter with 1 thread: (exit code, curve, result or None).

    Every run the test compares is made this way, so they all compute with the same kernels:
    floats from different process kinds differ in the last bits. One thread, because with two
    about one process in fifteen sums some step-1 gradient in another order (measured: 38 of 40
    fresh processes agree bit for bit, with the math attention backend too; 40 of 40 on one
    thread), a choice the CPU math libraries make once per process, and Adam turns that last
    bit into 1e-5 in a weight. On one thread a resume that restores everything is exact.
    """
    root, keys, vmap = data
    script = tmp_path / "train_run.py"
    script.write_text(TRAIN_RUN)
    curve, result = tmp_path / f"{name}.curve.jsonl", tmp_path / f"{name}.result.json"
    args = {
        "threads": 1, "curve": str(curve), "result": str(result), "kill_at": kill_at,
        "store": str(store_dir), "keys": keys, "d2t": vmap.d2t.tolist(), "t2d": vmap.t2d.tolist(),
        "target": str(root / "target"), "settings": SETTINGS.model_dump(),
    }  # fmt: skip
    proc = subprocess.run([sys.executable, str(script), json.dumps(args)], capture_output=True, text=True, timeout=600)
    points = [json.loads(line) for line in curve.read_text().splitlines()] if curve.exists() else []
    out = json.loads(result.read_text()) if result.exists() else None
    return proc, {s: loss for s, loss in points}, out


def final_weights(store_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(store_dir / f"drafter/checkpoints/step_{step}/model.safetensors"))


def test_killed_run_resumes_with_the_same_step_counter_and_loss_curve(tmp_path, data):
    copy_store(data, tmp_path / "ref")
    proc, ref_curve, reference = train_in_subprocess(tmp_path, data, tmp_path / "ref", "ref")
    assert proc.returncode == 0, proc.stderr[-2000:]
    total = reference["total"]
    assert reference["step"] == total == len(ref_curve) > 6 and sorted(ref_curve) == list(range(1, total + 1))

    store = copy_store(data, tmp_path / "killed")
    proc, killed_curve, _ = train_in_subprocess(tmp_path, data, tmp_path / "killed", "killed", kill_at=5)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert sorted(killed_curve) == [1, 2, 3, 4, 5]
    assert list_checkpoints(store) == [2, 4]  # every 2 steps, the last two kept; step 5 never checkpointed

    proc, curve, resumed = train_in_subprocess(tmp_path, data, tmp_path / "killed", "resumed")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert resumed["resumed_from"] == 4 and resumed["step"] == total
    assert sorted(curve) == list(range(5, total + 1))  # the counter continues at 5
    # The curve continues where the killed run left it, step for step the uninterrupted run's, bit
    # for bit: a lost step, a reset optimizer, scheduler or RNG, or another data position would not.
    assert {**killed_curve, **curve} == ref_curve
    assert resumed["heldout"] == reference["heldout"]
    got, want = final_weights(tmp_path / "killed", total), final_weights(tmp_path / "ref", total)
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name
    assert list_checkpoints(store)[-1] == total


def test_time_slices_on_a_memory_store_and_checkpoint_contents(data):
    root, keys, vmap = data
    store = ArtifactStore(f"memory://drafter-train-{uuid.uuid4().hex}")
    for key in keys:
        for name in ArtifactStore(root / "store").listdir(f"hidden_states/{key}"):
            store.write_bytes(f"hidden_states/{key}/{name}", (root / "store/hidden_states" / key / name).read_bytes())
    first, curve1 = run(store, data, max_steps=3)
    assert (first.step, first.finished, first.heldout, first.checkpoint) == (3, False, {}, "drafter/checkpoints/step_3")
    assert sorted(store.listdir("drafter/checkpoints/step_3")) == [
        "model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"
    ]
    state = store.read_json("drafter/checkpoints/step_3/state.json")
    assert state["step"] == 3 and state["aux_layer_ids"] == [1, 2, 3]
    assert state["drafter_config"]["draft_vocab_size"] == 64
    # TensorBoard events were copied from the local writer into the store.
    assert any(n.startswith("events.out.tfevents") for n in store.listdir("drafter/tensorboard/run_from_step_0"))

    # A rank killed while it uploaded the next checkpoint left its temporary copy (issue 44, item 7): multi-GB at scale.
    store.write_bytes("drafter/checkpoints/.step_4.tmp-killedrank/model.safetensors", b"partial")
    second, curve2 = run(store, data)
    assert second.resumed_from == 3 and second.finished and sorted(curve2)[0] == 4
    assert not [p for p in store.fs.ls(store.path("drafter/checkpoints"), detail=False) if ".tmp-" in p]
    # Called again when already done: no step runs, the result still carries the metrics.
    third, curve3 = run(store, data)
    assert (third.step, third.resumed_from, curve3) == (second.step, second.step, {})
    assert third.metrics == second.metrics and third.heldout == second.heldout
    assert set(second.heldout) >= {"loss", "acc_0", "acc_1", "acc_2"}
    # One event directory per call (the third logged only its held-out figures).
    runs = ["run_from_step_0", "run_from_step_3", f"run_from_step_{second.step}"]
    assert store.listdir("drafter/tensorboard") == sorted(runs)


def test_changed_settings_refuse_to_resume_and_missing_shards_refuse_to_start(tmp_path, data):
    store = copy_store(data, tmp_path / "s")
    run(store, data, max_steps=2)
    with pytest.raises(CheckpointError, match=r"settings.batch_tokens: checkpoint 96, now 128"):
        run(store, data, settings=SETTINGS.model_copy(update={"batch_tokens": 128}))
    fresh, _ = run(store, data, settings=SETTINGS.model_copy(update={"batch_tokens": 128}), resume=False, max_steps=1)
    assert fresh.resumed_from is None and fresh.step == 1

    os.remove(tmp_path / "s" / "hidden_states" / data[1][1] / "_SUCCESS.json")
    # A MissingShardsError, and like every drafter training error a TrainingError (what callers catch).
    with pytest.raises(TrainingError, match=r"1 hidden-state shard\(s\) are not complete \(no _SUCCESS.json\): rows_16-32"):
        run(store, data)


def test_a_checkpoint_older_than_a_setting_resumes_when_the_setting_asks_for_the_old_behaviour(tmp_path, data):
    store = copy_store(data, tmp_path / "s")
    old = SETTINGS.model_copy(update={"batch_order": "by_length", "adam_beta2": 0.95})  # what runs did then
    run(store, data, settings=old, max_steps=2)
    state_file = tmp_path / "s" / checkpoint_rel(2) / "state.json"
    state = json.loads(state_file.read_text())
    for added in ("batch_order", "adam_beta2"):  # as written before these settings existed
        del state["run"]["settings"][added]
    state_file.write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"settings.batch_order: checkpoint 'by_length', now 'packed'"):
        run(store, data)
    resumed, _ = run(store, data, settings=old, max_steps=3)
    assert (resumed.resumed_from, resumed.step) == (2, 3)


def test_turning_the_sample_ledger_on_resumes_and_says_where_the_ledger_starts(tmp_path, data):
    """`sample_ledger` keeps a record, it changes nothing learnt (issue 44, item 6): a run resumed with it turned on
    goes on from its checkpoint, not from step 0, and its ledger starts at the step after, as it says."""
    store = copy_store(data, tmp_path / "s")
    run(store, data, max_steps=2)
    root, keys, vmap = data
    lines: list[str] = []
    resumed = train_drafter(
        store, keys, vmap=vmap, target=target_of(root / "target"),
        settings=SETTINGS.model_copy(update={"sample_ledger": True}), log=lines.append, max_steps=4,
    )  # fmt: skip
    assert (resumed.resumed_from, resumed.step) == (2, 4)
    assert (
        f"drafter: training.sample_ledger is on, but {checkpoint_rel(2)} kept no ledger: the ledger starts at step 3 "
        "(steps 1-2 are not in it)"
    ) in lines
    state = json.loads((tmp_path / "s" / checkpoint_rel(4) / "state.json").read_text())
    assert state["ledger_from"] == 3 and [step for step, _ in state["ledger"]] == [3, 4]


def test_drafter_learns_a_peaked_target(tmp_path):
    """On a target with confident predictions the drafter fits its training rows (a tiny set of
    random rows does not generalise to held-out rows; the vLLM test serves what it learned)."""
    model = tiny_llama(tmp_path / "target", seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)  # confident: one clear top-1 at most positions
    model.save_pretrained(tmp_path / "target")
    store = ArtifactStore(tmp_path / "store")
    rows = random_rows(48, seed=1, min_len=10, max_len=20)
    keys = [write_shard(store, model, rows, 0)]
    vmap = greedy_vocab_map(model, rows)
    settings = TrainingSettings(
        ttt_steps=2, lr=1e-2, warmup_steps=5, epochs=25.0, batch_tokens=256, checkpoint_every=1000, heldout_rows=8
    )
    curve: dict[int, dict[str, float]] = {}
    result = train_drafter(
        store, keys, vmap=vmap, target=target_of(tmp_path / "target"), settings=settings,
        on_metrics=curve.__setitem__, log=lambda _: None,
    )
    assert result.step == 100  # 40 rows of 10-20 tokens packed into 256-token batches: 4 a epoch
    first, last = curve[1], curve[100]
    assert first["acc_0"] < 0.5 and last["acc_0"] > 0.9 and last["acc_1"] > 0.85
    assert last["loss"] < first["loss"] / 2
    assert last["lr"] < 1e-4  # cosine decayed to ~0 at the end
    assert set(result.heldout) == {"loss", "loss_0", "loss_1", "acc_0", "acc_1", "accept_len_k3", "accept_len_k7"}


TWO_RANK_RUN = textwrap.dedent(
    """
    import hashlib, json, os, sys
    import numpy as np, torch
    from eagle3_assets.drafter.train import train_drafter
    from eagle3_assets.settings import TrainingSettings
    from eagle3_assets.storage import ArtifactStore
    from eagle3_assets.target import TargetModel
    from eagle3_assets.vocab_map import VocabMap

    args = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(1)
    curve = []
    r = train_drafter(
        ArtifactStore(args["store"]), args["keys"], vmap=VocabMap(np.array(args["d2t"]), np.array(args["t2d"])),
        target=TargetModel.read(args["target"], aux_layer_ids=[1, 2, 3]), settings=TrainingSettings(**args["settings"]),
        log=lambda _: None, on_metrics=lambda step, m: curve.append([step, m["loss"], m["acc_0"]]),
    )
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in r.model.trainable_state_dict().values())).hexdigest()
    out = {"step": r.step, "total": r.total_steps, "digest": digest, "heldout": r.heldout, "curve": curve}
    open(os.path.join(args["out"], f"rank_{os.environ['RANK']}.json"), "w").write(json.dumps(out))
    """
)


def torchrun_training(
    tmp_path: Path, data, ranks: int, name: str, settings: TrainingSettings = SETTINGS
) -> tuple[Path, list[dict]]:
    """`train_drafter` under torchrun with `ranks` CPU ranks (gloo) on a copy of the store: each rank's result."""
    root, keys, vmap = data
    work = tmp_path / name
    copy_store(data, work / "store")
    (work / "run.py").write_text(TWO_RANK_RUN)
    (work / "args.json").write_text(json.dumps({
        "store": str(work / "store"), "keys": keys, "d2t": vmap.d2t.tolist(), "t2d": vmap.t2d.tolist(),
        "target": str(root / "target"), "settings": settings.model_dump(), "out": str(work),
    }))  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         str(work / "run.py"), str(work / "args.json")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return work / "store", [json.loads((work / f"rank_{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.slow
def test_two_ranks_train_what_one_rank_trains_with_the_same_global_batch(tmp_path, data):
    """torchrun with 2 CPU ranks (gloo): ranks stay in sync, only rank 0 writes, and each step trains the
    global batch one rank trains (split in two, gradients reweighted): the same losses, weights and acc_k."""
    # 112-token batches: every planned batch of both epochs holds 5 samples or more, so 2 ranks skip none
    # (a batch of one sample is one rank's alone; `test_split_batch_…`).
    settings = SETTINGS.model_copy(update={"batch_tokens": 112})
    store_dir, (r0, r1) = torchrun_training(tmp_path, data, 2, "two", settings)
    _, (one,) = torchrun_training(tmp_path, data, 1, "one", settings)
    assert r0["step"] == r0["total"] == r1["step"] == one["total"] > 0
    assert r0["digest"] == r1["digest"]  # DistributedDataParallel kept the replicas identical
    assert r0["heldout"] == r1["heldout"] and set(r0["heldout"]) >= {"acc_0", "acc_1", "acc_2"}
    # Only the order of float sums differs between one and two ranks.
    assert [s for s, *_ in r0["curve"]] == [s for s, *_ in one["curve"]] == list(range(1, one["total"] + 1))
    for (_, loss2, acc2), (_, loss1, acc1) in zip(r0["curve"], one["curve"], strict=True):
        assert loss2 == pytest.approx(loss1, rel=1e-4) and acc2 == acc1
    assert r0["heldout"] == pytest.approx(one["heldout"], rel=1e-4)
    store = ArtifactStore(store_dir)
    assert list_checkpoints(store)[-1] == r0["total"]
    assert store.read_json(f"drafter/checkpoints/step_{r0['total']}/state.json")["run"]["world_size"] == 2
    # Another number of ranks does not resume it: the refusal names both and what to set.
    with pytest.raises(LaunchRefused) as refused:
        refuse_another_world_size(store, 1)
    last = store.url_of(checkpoint_rel(r0["total"]))
    assert str(refused.value) == (
        f"{last} was written by 2 rank(s) and this job would run "
        f"1: resume it on 2 (training.launch.nnodes x nproc_per_node = 2), or remove "
        f"{store.url_of('drafter/checkpoints')} to start over on 1"
    )
    refuse_another_world_size(store, 2)


def test_a_non_finite_loss_stops_training_naming_the_batch_and_no_bad_weights_are_published(tmp_path, data):
    """Finite values large enough to overflow (the loader passes them): the step that meets them stops the run.
    Without `norm_before_fc`: that norm maps such a row to zeros, finite."""
    settings = SETTINGS.model_copy(update={"norm_before_fc": False})
    store = copy_store(data, tmp_path / "s")
    run(store, data, settings, max_steps=2)  # a good checkpoint at step 2
    root, keys, vmap = data
    rel = f"hidden_states/{keys[0]}/3.safetensors"
    tensors = st_load(store.read_bytes(rel))
    tensors["aux_hidden_states"].fill_(3e38)
    with store.open(rel) as f:
        header, _ = read_header(f)
    store.write_bytes(rel, st_save(tensors, metadata=header["__metadata__"]))
    with pytest.raises(NonFiniteLossError) as e:
        run(store, data, settings)
    message = str(e.value)
    assert message.startswith("step ") and store.url_of(rel) in message
    assert "Nothing of this step was applied; the last checkpoint is intact." in message
    assert list_checkpoints(store)[-1] < int(message.split()[1].rstrip(":"))
    good = load_file(str(tmp_path / "s" / f"drafter/checkpoints/step_{list_checkpoints(store)[-1]}/model.safetensors"))
    assert all(bool(torch.isfinite(t).all()) for t in good.values() if t.is_floating_point())


def test_weights_that_are_not_finite_are_never_checkpointed(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    store = ArtifactStore(tmp_path)
    bad = {"fc.weight": torch.tensor([[1.0, float("inf")]]), "d2t": torch.zeros(2, dtype=torch.int64)}
    with pytest.raises(CheckpointError, match=r"step 7: not checkpointed, 1 tensor\(s\) hold non-finite values \(fc.weight\)"):
        save_checkpoint(store, 7, model_tensors=bad, optimizer=opt, param_names=["weight", "bias"], scheduler=sched, state={})
    assert list_checkpoints(store) == []


def test_a_full_local_temporary_directory_under_a_checkpoint_is_a_named_refusal(tmp_path, monkeypatch):
    """Issue 44, item 9 (left from issue 33): a checkpoint is assembled in the local temporary directory first; a full
    one (the write fails with ENOSPC: no test can fill the disk, so the write is made to fail) refuses naming the
    directory, its free bytes and the bytes needed, and leaves the checkpoint before as the newest, readable."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    store = ArtifactStore(tmp_path / "store")
    names = [n for n, _ in model.named_parameters()]
    save = dict(model_tensors=dict(model.named_parameters()), optimizer=opt, param_names=names, scheduler=sched,
                state={"next_position": {"epoch": 0, "batch": 2}})  # fmt: skip
    save_checkpoint(store, 2, **save)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "local"))
    (tmp_path / "local").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again

    def full(tensors, path, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr("eagle3_assets.drafter.checkpoint.save_file", full)
    with pytest.raises(StagingFull) as e:
        save_checkpoint(store, 4, **save)
    assert not e.value.retryable
    message = str(e.value)
    needed = sum(p.numel() * 4 + 128 for p in model.parameters())  # the weights; the optimizer and state come on top
    assert re.fullmatch(
        rf"cannot assemble {re.escape(store.url_of(checkpoint_rel(4)))} in the local temporary directory "
        rf"{re.escape(str(tmp_path / 'local'))}: [\d,]+ bytes free there, ([\d,]+) bytes needed \(writing it failed: "
        r"\[Errno 28\] No space left on device: '.+/model\.safetensors'\)\. Free space there, or point TMPDIR at a "
        rf"larger disk; the newest checkpoint, {re.escape(store.url_of(checkpoint_rel(2)))}, is intact",
        message,
    )
    assert int(re.search(r"([\d,]+) bytes needed", message)[1].replace(",", "")) > needed
    assert list_checkpoints(store) == [2] and read_checkpoint_state(store, checkpoint_rel(2)).step == 2
    assert list((tmp_path / "local").iterdir()) == []  # nothing left in the temporary directory


def test_the_schedule_warms_up_linearly_then_decays_to_zero_at_the_last_step():
    factor = warmup_cosine(4, 20)
    assert [factor(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert factor(12) == pytest.approx(0.5)
    assert factor(20) == pytest.approx(0.0)
    # Warmup longer than the run: the learning rate never reaches lr.
    never = warmup_cosine(100, 80)
    assert max(never(s) for s in range(80)) == pytest.approx(0.8)


def test_a_run_too_short_for_its_warmup_is_named_with_what_to_set():
    library = TrainingSettings()  # lr 1e-4, 100 warmup steps: written for long runs
    assert short_run_warning(library, 401) is None
    assert short_run_warning(library, 400) == (
        "drafter: warmup_steps 100 is 25% of this run's 400 steps: lr 0.0001 is reached late or never. "
        "For a run this short set training.warmup_steps to about 20 and training.lr as README.md's table "
        "'Optimizer settings by run length' says"
    )
    assert short_run_warning(library, 80).startswith("drafter: warmup_steps 100 is 125% of this run's 80 steps:")
    assert "warmup_steps to about 1 and" in short_run_warning(library, 3)  # never 0


def test_the_drafter_log_says_when_warmup_is_too_long_for_the_run(tmp_path, data):
    root, keys, vmap = data
    logs: list[str] = []
    settings = SETTINGS.model_copy(update={"warmup_steps": 100, "steps": 4})
    train_drafter(
        copy_store(data, tmp_path / "store"), keys, vmap=vmap, target=target_of(root / "target"), settings=settings,
        log=logs.append,
    )  # fmt: skip
    assert short_run_warning(settings, 4) in logs
    assert not [line for line in logs if "warmup_steps" in line and line != short_run_warning(settings, 4)]


def test_held_out_evaluations_as_it_trains_keep_the_best_weights_and_stop_early(tmp_path, data):
    root, keys, vmap = data
    store = copy_store(data, tmp_path / "s")
    early = SETTINGS.model_copy(update={"eval_every": 2, "early_stop_evals": 1})
    lines: list[str] = []
    observed: dict[int, dict[str, float]] = {}

    def train(settings: TrainingSettings = early):
        return train_drafter(
            store, keys, vmap=vmap, target=target_of(root / "target"), settings=settings, log=lines.append,
            on_eval=observed.__setitem__,
        )  # fmt: skip

    result = train()
    # The estimate fell at step 4 (1.069 -> 1.034 on 29 held-out chains): one evaluation without a rise stops it.
    assert (result.step, result.total_steps, result.finished, result.stopped_early) == (4, 10, True, True)
    evals = result.evaluations
    assert [e["step"] for e in evals] == [2, 4] and result.best == evals[0]
    assert round(evals[0]["accept_len_k3"], 3) == 1.069 and round(evals[1]["accept_len_k3"], 3) == 1.034
    assert observed[4] == {f"heldout_{k}": v for k, v in evals[1].items() if k != "step"}
    assert result.heldout == {k: v for k, v in evals[1].items() if k != "step"}
    assert any(re.fullmatch(
        r"drafter: step 4/10 held-out loss [\d.]+ acc_k [\d.]+ [\d.]+ [\d.]+ accept_len k=3 1\.034 k=7 1\.034 "
        r"\(best accept_len_k3 1\.069 at step 2\)", line) for line in lines), lines  # fmt: skip
    assert "drafter: stopping early at step 4: 1 held-out evaluation(s) without a rise (training.early_stop_evals)" in lines
    # The history travels in the checkpoint; the best weights are kept beside it.
    assert store.read_json(f"{checkpoint_rel(4)}/state.json")["evals"] == evals
    assert store.read_json(f"{BEST_DIR}/state.json")["evaluation"] == evals[0]
    best, best_step = export_choice(store, result, "best", lines.append)
    last, last_step = export_choice(store, result, "last", lines.append)
    assert (best_step, last_step) == (2, 4)
    assert not torch.equal(best["fc.weight"], last["fc.weight"])
    assert torch.equal(last["fc.weight"], result.model.trainable_state_dict()["fc.weight"])

    again = train()  # stopped early is finished: nothing more runs
    assert (again.step, again.resumed_from, again.stopped_early, again.evaluations) == (4, 4, True, evals)
    assert sorted(observed) == [2, 4]
    # The early stop is not part of the run: without it the same run trains on to its end.
    rest = train(early.model_copy(update={"early_stop_evals": None}))
    assert (rest.resumed_from, rest.step, rest.stopped_early) == (4, 10, False)
    assert [e["step"] for e in rest.evaluations] == [2, 4, 6, 8, 10]
