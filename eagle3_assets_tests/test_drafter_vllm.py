"""Serve the export in vLLM (CPU build) with its target: it loads, output stays greedy, and vLLM
accepts exactly the drafts our own model predicts.

Acceptance of draft k in a round depends only on the drafts before it being right, so on
the target's own greedy text it equals the teacher-forced TTT unroll: round at index t
accepts drafts while step k's argmax at t equals token t+2+k. Replaying vLLM's rounds
over our unroll predicts its counters; they agree only when aux layers, final norm,
alignment, rotary positions, the fed-back state and the weight names all match what vLLM
does at serving time.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eagle3_assets.drafter.export import export_drafter
from eagle3_assets.drafter.family import Eagle3
from eagle3_assets.drafter.model import Eagle3Drafter
from eagle3_assets.drafter.served_replay import SERVED_AS, trained_served_as
from eagle3_assets.drafter.target_head import load_target_weights
from eagle3_assets.drafter.train import train_drafter
from eagle3_assets.drafter.vllm_eval import generate_runs_in_subprocess
from eagle3_assets.settings import TrainingSettings

from .drafter_serving import PROMPT_LEN, assert_served_as_replayed, confident_target_with_text, replayed
from .helpers import target_of

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SERVED, EXTRA, K = 24, 4, 3
NORM_FLAGS = {"norm_before_fc", "norm_before_residual", "norm_output"}
FAMILY = Eagle3(TrainingSettings())  # what drafts and is recorded; its settings play no part in either


@pytest.fixture(scope="module")
def served_target(tmp_path_factory):
    """A confident tiny target (rotary scaled the llama3 way, as Llama 3.1 is), greedy text from it (a few tokens
    past what is served, so every draft has a known truth), and two shards of that text."""
    pytest.importorskip("vllm")
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128}  # fmt: skip
    return confident_target_with_text(
        tmp_path_factory.mktemp("drafter-vllm"), prompts=24, new_tokens=SERVED + EXTRA, shard_rows=12,
        rope_parameters=rope,
    )  # fmt: skip


def train_and_export(served_target, name: str, **options) -> tuple[Eagle3Drafter, Path]:
    target_dir, _, _, store, keys, vmap = served_target
    settings = TrainingSettings(
        **{"ttt_steps": K, "lr": 1e-2, "warmup_steps": 5, "epochs": 40.0, "batch_tokens": 256, "checkpoint_every": 1000,
           "heldout_rows": 0}
        | dict.fromkeys(NORM_FLAGS, False)
        | options  # each option alone over a plain drafter
    )  # fmt: skip
    store.remove("drafter", recursive=True)
    result = train_drafter(store, keys, vmap=vmap, target=target_of(target_dir), settings=settings, log=lambda _: None)
    rel = f"exports/{name}"
    served_as = FAMILY.served_as(result.config, result.aux_layer_ids)  # as the trainer records it (`run.py`)
    export_drafter(store, result.model.trainable_state_dict(), result.config, aux_layer_ids=result.aux_layer_ids,
                   dtype="float32", rel=rel, trained_on={SERVED_AS: served_as})  # fmt: skip
    return result.model, store.local_path(rel)


@pytest.mark.timeout(1500)
def test_vllm_serves_the_export_greedy_and_accepts_the_predicted_drafts(served_target):
    target_dir, prompts, generated, store, keys, _ = served_target
    model, export_dir = train_and_export(served_target, "default")
    config = json.loads((export_dir / "config.json").read_text())
    # Export fidelity: the target's rotary embedding and context, written for the engine.
    target_config = json.loads((target_dir / "config.json").read_text())
    assert config["rope_parameters"] == target_config["rope_parameters"]
    assert config["max_position_embeddings"] == target_config["max_position_embeddings"] == 512
    assert config["tie_word_embeddings"] is False

    groups = ["b" if i % 3 else "a" for i in range(len(prompts))]  # two "modes", as drafter_eval groups them
    spec, zeroed, ngram = generate_runs_in_subprocess(  # one interpreter: vLLM imported once for the three engines
        target_dir, prompts,
        [{"draft_dir": export_dir}, {"draft_dir": export_dir, "zero_fc": True, "groups": groups},
         {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}],
        common={"num_speculative_tokens": K, "max_tokens": SERVED},
    )  # fmt: skip
    # Speculative decoding never changes greedy output: equal to the target's own greedy tokens.
    assert spec.outputs == [g[PROMPT_LEN : PROMPT_LEN + SERVED] for g in generated]
    assert spec.num_draft_tokens == K * spec.num_drafts
    assert sum(spec.accepted_per_position) == spec.num_accepted_tokens
    assert spec.mean_acceptance_length == 1 + spec.num_accepted_tokens / spec.num_drafts
    assert spec.mean_acceptance_length > 2.5, spec.to_json()
    assert_served_as_replayed(replayed(FAMILY, model, store, keys, spec, K))

    assert zeroed.outputs == spec.outputs == ngram.outputs
    # The same drafter without the target features is accepted far less: vLLM feeds the
    # features it was trained on.
    assert zeroed.mean_acceptance_length < spec.mean_acceptance_length - 0.5, (zeroed.to_json(), spec.to_json())
    # Per group, one generate call each on the same engine: the groups' counters and outputs make up the whole.
    assert list(zeroed.by_group) == ["a", "b"]
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert sum(getattr(g, name) for g in zeroed.by_group.values()) == getattr(zeroed, name)
    assert zeroed.by_group["b"].outputs == [o for o, g in zip(zeroed.outputs, groups, strict=True) if g == "b"]
    # n-gram prompt lookup (vLLM's `ngram`, nothing trained) keeps greedy output; it drafts only where the text
    # repeats an n-gram, at most k tokens (fewer where the match is near the end), so its per-draft acceptance
    # skips the undrafted steps: tokens per target forward counts them.
    assert ngram.num_drafts > 0 and ngram.num_draft_tokens <= K * ngram.num_drafts, ngram.to_json()
    served = sum(map(len, ngram.outputs))
    assert ngram.tokens_per_forward == served / (served - ngram.num_accepted_tokens) < ngram.mean_acceptance_length
    assert not ngram.by_group


# Each norm placement changes what vLLM computes, so each has a drafter and an engine start of its own.
# The training-only options (lm_head frozen, loss positions, KL and LK losses) change the weights, not the
# served architecture: each rides along on one of those drafters, so its counters are checked too.
OPTIONS = {
    "norm_before_fc+frozen_lm_head": {"norm_before_fc": True, "train_lm_head": False},
    "norm_output+input_positions": {"norm_output": True, "loss_positions": "input"},
    "norm_before_residual+kl": {"norm_before_residual": True, "loss": "kl"},
    "all_norms+lk": {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True, "loss": "lk"},
}


@pytest.mark.timeout(1500)
def test_every_recipe_option_serves_in_vllm_as_it_trained(served_target):
    target_dir, prompts, generated, store, keys, _ = served_target
    # A quarter of the other tests' training: serving as trained needs drafts accepted at every
    # position (asserted below), not a good drafter.
    trained = {name: train_and_export(served_target, name, **options, epochs=10.0) for name, options in OPTIONS.items()}
    for name, (_, export_dir) in trained.items():
        config = json.loads((export_dir / "config.json").read_text())
        for flag in NORM_FLAGS:  # written out explicitly, as trained
            assert config[flag] is bool(OPTIONS[name].get(flag, False)), (name, flag)
    # Issue 54, item 3: exports whose config tells vLLM another norm placement, or target layers off by one, than the
    # ones that trained. (Measured here: vLLM accepted 0.22 and 0.34 at position 0 where the trained drafter replays
    # 0.49 and 0.42; a flipped norm_output moved nothing past 0.01 on this target, so it is not one of them.)
    misaligned = {"norm_before_fc": ("norm_before_fc+frozen_lm_head", False),
                  "eagle_aux_hidden_state_layer_ids": ("norm_output+input_positions", [0, 1, 2])}  # fmt: skip
    for field, (name, value) in misaligned.items():
        shutil.copytree(trained[name][1], store.local_path(f"exports/misaligned-{field}"))
        config_file = store.local_path(f"exports/misaligned-{field}/config.json")
        config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {field: value}))
    served = [*(d for _, d in trained.values()), *(store.local_path(f"exports/misaligned-{f}") for f in misaligned)]
    reported: list[int] = []  # each run as it finishes, before the interpreter exits
    results = generate_runs_in_subprocess(
        target_dir, prompts, [{"draft_dir": d, "num_speculative_tokens": K} for d in served],
        common={"max_tokens": SERVED}, on_result=lambda i, _: reported.append(i),
    )  # fmt: skip
    assert reported == list(range(len(served)))
    want = [g[PROMPT_LEN : PROMPT_LEN + SERVED] for g in generated]
    for (name, (model, _)), spec in zip(trained.items(), results[: len(trained)], strict=True):
        assert spec.outputs == want, name
        # A norm placement vLLM did not apply, or weights it read differently, would move its counters.
        check = replayed(FAMILY, model, store, keys, spec, K)
        assert_served_as_replayed(check)
        assert all(check.replayed.accepted), (name, check.as_json())  # every draft position was exercised
    suspected = {
        "norm_before_fc": "the export says norm_before_fc False, the drafter trained with True",
        "eagle_aux_hidden_state_layer_ids":
            "the export says aux_layer_ids [0, 1, 2], the drafter trained with [1, 2, 3]",
    }
    embed = load_target_weights(target_of(target_dir)).embed_tokens
    for field, export_dir, spec in zip(misaligned, served[len(trained) :], results[len(trained) :], strict=True):
        # drafter_eval's way: the drafter as its trainer recorded it, against what vLLM made of the config.
        trained_as, suspects = trained_served_as(FAMILY, export_dir)
        model, _ = FAMILY.load_as(export_dir, embed, trained_as)
        check = replayed(FAMILY, model, store, keys, spec, K, suspects)
        assert spec.outputs == want and not check.passed, (field, check.as_json())  # still greedy: the drafts suffer
        assert check.describe().endswith(
            f"they part at position {check.parted_at} (by more than {check.allowed:.3f}). Suspects: {suspected[field]}"
        ), check.describe()


def test_a_failed_vllm_generation_is_a_named_retryable_evaluation_error(tmp_path: Path):
    """A fault (vLLM exits non-zero): named, with the end of vLLM's output, and retryable."""
    from eagle3_assets.drafter.errors import EvaluationError

    with pytest.raises(EvaluationError) as e:
        generate_runs_in_subprocess(tmp_path / "target", [[1, 2]], [{"no_such_option": 1}], timeout_s=300)
    msg = str(e.value)
    assert msg.startswith(f"drafter_eval: vLLM generation of 1 run(s) over 1 prompts failed (exit 1; target {tmp_path / 'target'})")
    assert "unexpected keyword argument 'no_such_option'" in msg
    assert e.value.retryable


def test_the_vllm_interpreter_of_a_drafter_eval_killed_outright_goes_with_it(tmp_path: Path):
    """Issue 44, item 7: `kill -9` of the process serving the drafter (its run's worker) ends the vLLM interpreter it
    started at once, not at the evaluation's timeout, with the cores (or GPU) it claimed."""
    import os
    import signal
    import subprocess
    import sys
    import time

    parent = subprocess.Popen(
        # Started with SIGTERM ignored, as some launchers leave it: ignored dispositions survive exec, and must not
        # void the kernel's SIGTERM to the interpreter.
        [sys.executable, "-c", "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "from eagle3_assets.drafter.vllm_eval import generate_runs_in_subprocess; "
         f"generate_runs_in_subprocess({str(tmp_path / 'target')!r}, [[1, 2]], [{{}}], timeout_s=600)"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "EAGLE3_STALL_AT": "vllm_eval:started"},  # the interpreter holds there until ended
    )  # fmt: skip

    def children() -> list[int]:
        tasks = Path(f"/proc/{parent.pid}/task")
        return [int(c) for t in tasks.iterdir() for c in (t / "children").read_text().split()] if tasks.exists() else []

    child: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (child := children()):
            assert parent.poll() is None and time.monotonic() < deadline, "the vLLM interpreter never started"
            time.sleep(0.05)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{child[0]}").exists() and "Z" not in Path(f"/proc/{child[0]}/stat").read_text().split()[2]:
            assert time.monotonic() < deadline, "the vLLM interpreter outlived the process that started it"
            time.sleep(0.05)
    finally:
        for pid in [parent.pid, *child, *children()]:  # a failed run leaves no interpreter stalled behind
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
