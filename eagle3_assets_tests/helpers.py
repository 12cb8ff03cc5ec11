"""Helpers the tests share: one tiny-Llama builder, shards written with the real sample writer,
vocab maps, a Dagster instance with the repo's pool limit, and vLLM test-server settings."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from dagster import DagsterInstance
from dagster._core.test_utils import instance_for_test
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_assets.crash_points import CRASH_ENV, STALL_ENV, STALLED
from eagle3_assets.hidden_states.hf_extractor import final_norm
from eagle3_assets.hidden_states.manifest import ShardManifest
from eagle3_assets.sample_file import FORMAT, SampleSpec, encode_sample, sample_path
from eagle3_assets.settings import VllmSettings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel
from eagle3_assets.vllm_server.client import free_port
from eagle3_assets.vocab_map import VocabMap

REPO = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN, LAYERS, HEAD_DIM, DRAFT_VOCAB = 256, 64, 4, 32, 64
AUX_IDS = [1, 2, 3]


def tiny_llama(
    out_dir: Path | None = None,
    *,
    seed: int = 0,
    vocab: int = VOCAB,
    hidden: int = HIDDEN,
    layers: int = LAYERS,
    heads: int = 2,
    kv_heads: int = 1,
    tie: bool = False,
    tokenizer: bool = False,
    rope_parameters: dict | None = None,
) -> LlamaForCausalLM:
    """A random Llama (head_dim 32, which vLLM can serve), saved as safetensors in `out_dir` when given.

    The final norm is drawn from [0.5, 2): a flat one would hide "norm applied twice".
    """
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        **({"rope_parameters": rope_parameters} if rope_parameters else {}),
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 2.0)
    if out_dir is not None:
        model.save_pretrained(out_dir)
        if tokenizer:
            write_word_tokenizer(out_dir, vocab)
    return model


def write_word_tokenizer(out_dir: Path, vocab: int) -> None:
    """A word-level tokenizer `t0 … t{vocab-1}` (vLLM needs one next to the target)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out_dir)


def target_of(model_dir: Path, aux_layer_ids: list[int] = AUX_IDS) -> TargetModel:
    return TargetModel.read(model_dir, aux_layer_ids=aux_layer_ids)


def random_rows(
    n: int, *, seed: int = 0, min_len: int = 8, max_len: int = 24, vocab: int = VOCAB
) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) rows: a short 'prompt' (mask 0) then 'assistant' tokens (mask 1)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        T = int(rng.integers(min_len, max_len + 1))
        prompt = int(rng.integers(2, T // 2 + 1))
        ids = rng.integers(3, vocab, size=T).tolist()
        rows.append((ids, [0] * prompt + [1] * (T - prompt)))
    return rows


@torch.no_grad()
def hidden_states(model: LlamaForCausalLM, ids: list[int], aux_ids: list[int], norm: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, 3H], last [T, H]) of one row, the way the HF backend extracts them."""
    captured: dict[str, torch.Tensor] = {}
    handle = final_norm(model).register_forward_pre_hook(lambda _m, args: captured.setdefault("pre", args[0]))
    out = model(torch.tensor([ids]), output_hidden_states=True)
    handle.remove()
    hs = out.hidden_states
    last = captured["pre"][0] if norm == "pre_norm" else hs[-1][0]
    return torch.cat([hs[i][0] for i in aux_ids], dim=-1), last


def write_shard(
    store: ArtifactStore,
    model: LlamaForCausalLM,
    rows: list[tuple[list[int], list[int]]],
    start: int,
    *,
    complete: bool = True,
    aux_ids: list[int] = AUX_IDS,
    norm: str = "pre_norm",
    dtype: str = "float32",
) -> str:
    """Rows as shard `rows_<start>-<start+len>`, written with the pipeline's own `encode_sample`; returns its key."""
    key = f"rows_{start}-{start + len(rows)}"
    spec = SampleSpec(model.config.hidden_size, tuple(aux_ids), dtype, "tiny-llama", norm)
    tokens = 0
    for i, (ids, mask) in enumerate(rows):
        aux, last = hidden_states(model, ids, aux_ids, norm)
        data = encode_sample(
            row=start + i, input_ids=np.asarray(ids, np.int32), loss_mask=np.asarray(mask, np.uint8),
            aux_hidden_states=aux, last_hidden_state=last, spec=spec, backend="hf",
        )  # fmt: skip
        store.write_bytes(sample_path(key, start + i), data)
        tokens += len(ids)
    if complete:
        sizes = store.sizes(f"hidden_states/{key}")
        ShardManifest(
            format=FORMAT, shard=key, row_start=start, row_end=start + len(rows), rows=len(rows), tokens=tokens,
            bytes=sum(sizes.values()), aux_layer_ids=tuple(aux_ids), hidden_size=model.config.hidden_size, dtype=dtype,
            last_hidden_state_norm=norm, model="tiny-llama", backend="hf", rows_computed=len(rows), rows_skipped=0,
            seconds=0.0, created="2026-12-01T12:00:00+00:00",
        ).write(store)  # fmt: skip
    return key


def random_vocab_map(vocab: int = VOCAB, draft: int = DRAFT_VOCAB, *, seed: int = 0) -> VocabMap:
    """A map of a random set of `draft` target ids (docs/DESIGN.md §3 layout)."""
    used = np.sort(np.random.default_rng(seed).choice(vocab, size=draft, replace=False))
    t2d = np.zeros(vocab, dtype=bool)
    t2d[used] = True
    return VocabMap((used - np.arange(draft)).astype(np.int64), t2d)


def greedy_vocab_map(model: LlamaForCausalLM, rows, draft: int = DRAFT_VOCAB) -> VocabMap:
    """A map holding the target's most frequent top-1 tokens on `rows`, so most positions are kept."""
    counts = np.zeros(model.config.vocab_size, dtype=np.int64)
    with torch.no_grad():
        for ids, _ in rows:
            top1 = model(torch.tensor([ids])).logits[0].argmax(-1)
            np.add.at(counts, top1.numpy(), 1)
    used = np.sort(np.argsort(-counts, kind="stable")[:draft])
    t2d = np.zeros(model.config.vocab_size, dtype=bool)
    t2d[used] = True
    return VocabMap((used - np.arange(draft)).astype(np.int64), t2d)


@contextmanager
def gpu_instance(**overrides) -> Iterator[DagsterInstance]:
    """A test instance with the repo's dagster.yaml pool limit (`gpu`: 1)."""
    with instance_for_test(overrides={"concurrency": {"pools": {"default_limit": 1}}, **overrides}) as instance:
        yield instance


def vllm_test_settings(max_model_len: int = 256, **overrides) -> VllmSettings:
    """Engine settings for a CPU test server: float32 (exact comparisons), eager (starts faster)."""
    base = dict(
        host="127.0.0.1",
        port=free_port(),
        dtype="float32",
        max_model_len=max_model_len,
        max_concurrency=4,
        # On the CPU backend this is the share of host memory the server may take (not GPU memory):
        # the default 0.9 refuses to start while another test server is up.
        gpu_memory_utilization=0.2,
        startup_timeout_s=600.0,
        extra_args=["--enforce-eager"],
    )
    base.update(overrides)
    return VllmSettings(**base)


def wait_for_line(proc: subprocess.Popen, wanted: str) -> str:
    """`proc`'s output up to and including the first line that contains `wanted`."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if wanted in line:
            return "".join(seen)
    proc.wait()
    raise AssertionError(f"exited {proc.returncode} before {wanted!r}:\n" + "".join(seen)[-4000:])


def wait_until_stalled(proc: subprocess.Popen, at: str) -> str:
    return wait_for_line(proc, STALLED + at)


def processes_with_env(name: str, value: str) -> list[int]:
    """Live processes whose environment sets `name=value` (a test's unique store path: all it started)."""
    from eagle3_assets.processes import process_alive

    wanted, found = f"{name}={value}".encode(), []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and wanted in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in found if process_alive(pid)]


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, 9)
    except ProcessLookupError:
        pass


class Operator:
    """What an operator has on a node: a $DAGSTER_HOME (with the repo's dagster.yaml, or not), a
    settings file and a store holding the tiny demo target; and the CLI run against them."""

    def __init__(self, tmp: Path, tiny_target_dir: Path, *, pool_limit: bool = True, **overrides):
        from eagle3_assets.project import DEMO_MODEL_DIR, DEMO_MODEL_SETTINGS, Project

        from .conftest import TINY_DEMO, tiny_settings

        self.home, self.root = tmp / "home", tmp / "root"
        self.home.mkdir()
        if pool_limit:
            shutil.copy(REPO / "dagster.yaml", self.home / "dagster.yaml")
        settings = tiny_settings(**overrides)
        (tmp / "eagle3.yaml").write_text(settings.model_dump_json())  # JSON is YAML
        store = ArtifactStore(self.root)
        store.put_dir(tiny_target_dir, DEMO_MODEL_DIR)  # the demo target `target_model` would build, cached
        store.write_json(DEMO_MODEL_SETTINGS, TINY_DEMO.model_dump())
        self.env = {
            **os.environ, "DAGSTER_HOME": str(self.home), "EAGLE3_CONFIG": str(tmp / "eagle3.yaml"),
            "EAGLE3_ROOT": str(self.root), "PYTHONUNBUFFERED": "1",
        }  # fmt: skip
        self.project = Project(settings, store)

    def materialize(self, select: str, partition: str | None = None) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "dagster", "asset", "materialize", "-m", "eagle3_assets.definitions",
               "--select", select] + (["--partition", partition] if partition else [])  # fmt: skip
        return subprocess.Popen(
            cmd, cwd=REPO, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip

    def start(self, *args: str, crash_at: str | None = None) -> subprocess.CompletedProcess:
        """`python -m eagle3_assets.start ARGS`, killed outright at the crash point `crash_at` if given."""
        env = {**self.env, CRASH_ENV: crash_at} if crash_at else self.env
        cmd = [sys.executable, "-m", "eagle3_assets.start", *args]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)

    def spawn(self, *args: str, stall_at: str | None = None, crash_at: str | None = None) -> subprocess.Popen:
        """`python -m eagle3_assets.start ARGS` in a session of its own, output merged on a pipe; it holds at the
        crash point `stall_at` (`wait_until_stalled`), or dies at `crash_at`."""
        env = {**self.env, **({STALL_ENV: stall_at} if stall_at else {}), **({CRASH_ENV: crash_at} if crash_at else {})}
        cmd = [sys.executable, "-m", "eagle3_assets.start", *args]
        return subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )  # fmt: skip

    def instance(self) -> DagsterInstance:
        return DagsterInstance.from_config(str(self.home))

    def data_assets(self) -> None:
        """prompts … vocab_map, in this process, into the operator's instance (shard keys registered)."""
        from dagster import AssetKey

        from eagle3_assets.definitions import build_definitions

        keys = ["prompts", "target_model", "responses", "tokenized", "token_freq", "vocab_map"]
        with self.instance() as instance:
            job = build_definitions(self.project).resolve_implicit_global_asset_job_def()
            assert job.execute_in_process(instance=instance, asset_selection=[AssetKey(k) for k in keys]).success


def prompt_file_operator(tmp: Path, tiny_target_dir: Path, rows: int = 40) -> tuple[Operator, Path, dict, list[dict]]:
    """An operator whose settings name a prompt file (the tiny demo's first `rows` prompts, 4 held out), so a test can
    append to it: the operator, the file, those settings, and every demo prompt."""
    from eagle3_assets.demo.prompts import demo_prompt_sets

    from .conftest import TINY_DEMO

    prompts = tmp / "prompts.jsonl"
    train, held = demo_prompt_sets(TINY_DEMO)
    prompts.write_text("".join(json.dumps(p) + "\n" for p in train[:rows]))
    (tmp / "eval.jsonl").write_text("".join(json.dumps(p) + "\n" for p in held[:4]))
    base = dict(prompts=str(prompts), eval_prompts=str(tmp / "eval.jsonl"))
    return Operator(tmp, tiny_target_dir, **base), prompts, base, train


def hybrid_demo_tokenizer(target: TargetModel):
    """The target's tokenizer with Qwen3's hybrid switch in its chat template: `enable_thinking: false` closes an
    empty think block in the generation prompt. The engine only sees ids, so any backend serves it as is."""
    import copy

    from eagle3_assets.demo.tokenizer import CHAT_TEMPLATE
    from eagle3_assets.target import load_tokenizer

    plain = "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    assert plain in CHAT_TEMPLATE
    tok = copy.deepcopy(load_tokenizer(target))
    tok.chat_template = CHAT_TEMPLATE.replace(
        plain,
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}"
        "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think></think>' }}{% endif %}{% endif %}",
    )
    return tok


def release_the_export(store: ArtifactStore) -> tuple[str, dict[str, torch.Tensor]]:
    """Release the drafter's export as the first release, through the real gate (`promote`), as a `drafter_eval` that
    served it greedily would: (its sha256, the released weights in float32)."""
    from safetensors.torch import load

    from eagle3_assets.drafter.eval_report import ServedReport
    from eagle3_assets.drafter.release import RELEASE_DIR, export_digest, promote, release_decision

    sha = export_digest(store)
    report = ServedReport.from_json(
        {"mean_acceptance_length_k3": 1.5, "mean_acceptance_length_k7": 1.6, "outputs_match_greedy": True,
         "export_sha256": sha}
    )  # fmt: skip
    promote(store, release_decision(report, None, 1.0), report, "none")
    return sha, {k: v.float() for k, v in load(store.read_bytes(f"{RELEASE_DIR}/model.safetensors")).items()}
