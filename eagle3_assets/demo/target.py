"""Build the embedded demo target: a small model trained in-process on the synthetic world.

`build_demo_target(out_dir, demo)` trains the tokenizer, then a miniature of `demo.architecture` (a Llama by
default; `eagle3_assets/architectures/` declares the others; a vision-language wrapper, Kimi-K2.5's, is trained as
its text model and then written in the wrapper's layout)
on conversations about EVERY entity (train and heldout: the target must know all the
facts; only the drafter's data is split) plus template tasks, with the loss on the
assistant tokens only. It then measures greedy accuracy on one fact question per
entity and writes a Hugging Face model directory (safetensors, tokenizer with chat
template, greedy generation config) that vLLM can serve.

The directory is assembled under a temporary name next to `out_dir` and renamed into
place at the end, so a crash never leaves a directory that looks like a model.
The same bytes on every build of one commit (issue 43, item 6): the build trains on exactly one
thread, whatever the process was given, so no machine's core count or OMP_NUM_THREADS enters the
float reduction order (on the 2-core machine 1 and 2 threads gave the same bytes; 2 built 1.5x
faster on quiet cores and 8x slower on cores another process was busy on: BENCHMARKS.md, `demo
reproducibility`); and the
build info file holds what the target is, never where or how long it was built
(`DemoTargetInfo.file_json`), since the target's identity digests every one of its files.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from eagle3_assets.architectures import ARCHITECTURES, Architecture, MiniatureShape
from eagle3_assets.demo.kimi_k25 import MODEL_TYPE as KIMI_K25_MODEL_TYPE
from eagle3_assets.demo.kimi_k25 import write_kimi_k25_wrapper

from eagle3_assets.demo.tokenizer import (
    ASSISTANT,
    BOS,
    END,
    PAD,
    TOKEN_IDS,
    render_prompt,
    render_turn,
    train_tokenizer,
)
from eagle3_assets.demo.world import (
    ATTRIBUTE_NAMES,
    Conversation,
    Entity,
    World,
    all_single_fact_conversations,
    demo_world,
    random_fact_conversation,
    random_template_conversation,
    single_fact_conversation,
)
from eagle3_assets.settings import DemoSettings

BUILD_INFO_FILE = "demo_target.json"


@dataclass(frozen=True)
class TrainingRecipe:
    """How the demo target is trained; not user settings. The default build (3,000 steps) takes ~6 min on 2 cores."""

    batch_size: int = 32  # conversations per optimizer step
    long_row_tokens: int = 36  # rows longer than this (two-entity questions) are batched apart
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decays to lr * this
    weight_decay: float = 0.0  # decay erodes memorised facts
    grad_clip: float = 1.0
    fact_share: float = 0.5  # share of fact conversations in the training stream
    pair_share: float = 0.2  # share of two-entity questions among fact conversations
    mlp_ratio: int = 3  # intermediate_size = mlp_ratio * hidden_size: MLPs hold the facts
    max_position_embeddings: int = 2048
    tokenizer_corpus_rows: int = 3000  # random pair/template rows added to the tokenizer corpus
    eval_template_rows: int = 64
    threads: int = 1  # exactly, whatever the process was given: the same bytes on every machine


RECIPE = TrainingRecipe()


@dataclass(frozen=True)
class DemoTargetInfo:
    path: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    head_dim: int
    train_steps: int
    train_loss: float | None  # mean loss over the last 10% of steps; None when train_steps == 0
    fact_accuracy_train: float  # share of train entities answered exactly (greedy)
    fact_accuracy_heldout: float  # same for heldout entities
    fact_value_accuracy: float  # share of recalled attribute values that are right, all entities
    template_accuracy: float  # share of template prompts answered exactly
    build_seconds: float | None  # this build's; None when read from the file, which does not keep it

    def to_json(self) -> dict:
        return asdict(self)

    def file_json(self) -> dict:
        """What `BUILD_INFO_FILE` holds: the target, without where or how long this build ran (the file is part
        of the target's content identity, so those would make every build of one commit a new target)."""
        return {k: v for k, v in asdict(self).items() if k not in ("path", "build_seconds")}


def check_demo_settings(demo: DemoSettings) -> None:
    """Raise ValueError naming the setting when the demo target cannot be built with it."""
    if demo.hidden_size % demo.head_dim:
        raise ValueError(
            f"demo.hidden_size: {demo.hidden_size} is not a multiple of demo.head_dim ({demo.head_dim})"
        )
    if demo.head_dim < 32:
        raise ValueError(f"demo.head_dim: {demo.head_dim} is below 32, which vLLM cannot serve")
    if demo.num_layers < 4:
        raise ValueError(f"demo.num_layers: {demo.num_layers} is below 4 (three aux layers need room)")
    if demo.train_steps < 0:
        raise ValueError(f"demo.train_steps: must be >= 0, got {demo.train_steps}")


def miniature_shape(demo: DemoSettings, vocab_size: int, recipe: TrainingRecipe = RECIPE) -> MiniatureShape:
    return MiniatureShape(
        hidden_size=demo.hidden_size,
        num_layers=demo.num_layers,
        head_dim=demo.head_dim,
        vocab_size=vocab_size,
        bos_token_id=TOKEN_IDS[BOS],
        eos_token_id=TOKEN_IDS[END],
        pad_token_id=TOKEN_IDS[PAD],
        max_position_embeddings=recipe.max_position_embeddings,
        mlp_ratio=recipe.mlp_ratio,
    )


def new_model(demo: DemoSettings, vocab_size: int, recipe: TrainingRecipe = RECIPE) -> PreTrainedModel:
    """The untrained miniature of `demo.architecture`, in float32 (trained so; saved in its served dtype)."""
    arch = ARCHITECTURES[demo.architecture].text  # a wrapper's text model is what trains
    config = AutoConfig.for_model(arch.model_type, **arch.miniature(miniature_shape(demo, vocab_size, recipe)))
    return getattr(transformers, arch.hf_architecture)(config)


def training_stream(world: World, rng: random.Random, recipe: TrainingRecipe = RECIPE) -> Iterator[Conversation]:
    """Endless conversations about all entities and template tasks."""
    while True:
        if rng.random() < recipe.fact_share:
            yield random_fact_conversation(world.entities, rng, recipe.pair_share)
        else:
            yield random_template_conversation(rng)


def tokenizer_corpus(world: World, seed: int, recipe: TrainingRecipe = RECIPE) -> Iterator[str]:
    """Plain texts (no control tokens) covering every question and template task.

    Entity names are cut out of the conversations and given once each, so with the
    tokenizer's min_frequency of 2 no whole name becomes a token: every name is split
    into syllable pieces, and the target has to assemble an entity from several tokens.
    """
    rng = random.Random(f"demo-tokenizer-{seed}")
    rows = all_single_fact_conversations(world.entities)
    rows += [random_fact_conversation(world.entities, rng, pair_share=1.0) for _ in range(recipe.tokenizer_corpus_rows)]
    rows += [random_template_conversation(rng) for _ in range(recipe.tokenizer_corpus_rows)]
    names = re.compile("|".join(sorted((re.escape(e.name) for e in world.entities), key=len, reverse=True)))
    for c in rows:
        for text in (c.prompt, c.reasoning, c.content):
            yield names.sub("", text)
    for e in world.entities:
        yield f" {e.name}"


def encode_batch(tok: PreTrainedTokenizerBase, convs: Sequence[Conversation]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels), labels -100 outside the assistant turn."""
    return collate(tokenize_turns(tok, convs))


def tokenize_turns(tok: PreTrainedTokenizerBase, convs: Sequence[Conversation]) -> list[list[int]]:
    texts = [render_turn(c.prompt, c.reasoning, c.content) for c in convs]
    return tok(texts, add_special_tokens=False)["input_ids"]


def collate(rows: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    assistant_id = TOKEN_IDS[ASSISTANT]
    ids = torch.full((len(rows), width), TOKEN_IDS[PAD], dtype=torch.long)  # [B, T]
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # [B, T]
    attn = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T]
    for i, r in enumerate(rows):
        start = r.index(assistant_id) + 1  # loss on <think> … <|end|>
        ids[i, : len(r)] = torch.tensor(r)
        labels[i, start : len(r)] = ids[i, start : len(r)]
        attn[i, : len(r)] = 1
    return ids, attn, labels


def length_bucketed_batches(
    tok: PreTrainedTokenizerBase, stream: Iterator[Conversation], recipe: TrainingRecipe = RECIPE
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Batches from two length buckets. Two-entity rows are twice as long as the rest,
    and random batches were half padding; sorting whole batches by length instead made
    them one task each, which slowed learning. Two buckets keep short batches mixed."""
    short: list[list[int]] = []
    long: list[list[int]] = []
    while True:
        for row in tokenize_turns(tok, [next(stream) for _ in range(recipe.batch_size)]):
            bucket = long if len(row) > recipe.long_row_tokens else short
            bucket.append(row)
            if len(bucket) == recipe.batch_size:
                yield collate(bucket)
                bucket.clear()


def lr_at(step: int, total: int, recipe: TrainingRecipe = RECIPE) -> float:
    """Linear warmup, then cosine down to min_lr_ratio."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, total - recipe.warmup_steps)
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    world: World,
    steps: int,
    seed: int,
    log: Callable[[str], None],
    recipe: TrainingRecipe = RECIPE,
) -> float | None:
    """Train in place; return the mean loss over the last 10% of steps (None for 0 steps)."""
    if steps == 0:
        return None
    rng = random.Random(f"demo-train-{seed}")
    batches = length_bucketed_batches(tok, training_stream(world, rng, recipe), recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=recipe.weight_decay)
    model.train()
    tail: list[float] = []
    tail_from = steps - max(1, steps // 10)
    t0 = time.monotonic()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, recipe)
        ids, attn, labels = next(batches)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        if step >= tail_from:
            tail.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            log(f"demo target: step {step + 1}/{steps} loss {loss.item():.4f} ({time.monotonic() - t0:.0f}s)")
    model.eval()
    return sum(tail) / len(tail)


@torch.no_grad()
def greedy_answers(
    model: PreTrainedModel, tok: PreTrainedTokenizerBase, prompts: Sequence[str], max_new_tokens: int = 32, batch: int = 64
) -> list[str]:
    """The assistant text (`<think>…</think>answer`, without <|end|>) the model generates for each prompt."""
    end_id, pad_id = TOKEN_IDS[END], TOKEN_IDS[PAD]
    out: list[str] = []
    for i in range(0, len(prompts), batch):
        rows = tok([render_prompt(p) for p in prompts[i : i + batch]], add_special_tokens=False)["input_ids"]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, T], left-padded
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, width - len(r) :] = torch.tensor(r)
            attn[j, width - len(r) :] = 1
        gen = model.generate(
            input_ids=ids,
            attention_mask=attn,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=end_id,
            pad_token_id=pad_id,
        )  # [B, T + new]
        for row in gen[:, width:].tolist():
            if end_id in row:
                row = row[: row.index(end_id)]
            out.append(tok.decode(row, skip_special_tokens=True))
    return out


@dataclass(frozen=True)
class FactScore:
    exact: float  # share of entities whose whole response is right
    values: float  # share of attribute values recalled right


def score_entities(model: PreTrainedModel, tok: PreTrainedTokenizerBase, entities: Sequence[Entity]) -> FactScore:
    """One single-fact question per entity (attribute chosen by position), answered greedily."""
    if not entities:
        raise ValueError("score_entities: no entities to ask about")
    convs = [single_fact_conversation(e, ATTRIBUTE_NAMES[i % len(ATTRIBUTE_NAMES)]) for i, e in enumerate(entities)]
    answers = greedy_answers(model, tok, [c.prompt for c in convs])
    exact = sum(a == c.assistant_text for a, c in zip(answers, convs)) / len(convs)
    right = total = 0
    for a, c in zip(answers, convs):
        want = c.fact_texts()
        got = a.removeprefix("<think>").split("</think>")[0].split(" ")
        right += sum(g == w for g, w in zip(got, want))
        total += len(want)
    return FactScore(exact=exact, values=right / total)


def score_templates(model: PreTrainedModel, tok: PreTrainedTokenizerBase, n: int, seed: int) -> float:
    rng = random.Random(f"demo-template-eval-{seed}")
    convs = [random_template_conversation(rng) for _ in range(n)]
    answers = greedy_answers(model, tok, [c.prompt for c in convs])
    return sum(a == c.assistant_text for a, c in zip(answers, convs)) / max(1, n)


def _save(
    model: PreTrainedModel, tok: PreTrainedTokenizerBase, info: DemoTargetInfo, dest: Path, arch: Architecture
) -> None:
    model.save_pretrained(dest, safe_serialization=True)
    if arch.config_extras:
        config = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps(config | dict(arch.config_extras), indent=2, sort_keys=True) + "\n")
    tok.save_pretrained(dest)
    GenerationConfig(
        do_sample=False,
        bos_token_id=TOKEN_IDS[BOS],
        eos_token_id=TOKEN_IDS[END],
        pad_token_id=TOKEN_IDS[PAD],
    ).save_pretrained(dest)
    (dest / BUILD_INFO_FILE).write_text(json.dumps(info.file_json(), indent=2) + "\n")


def build_demo_target(out_dir: Path, demo: DemoSettings, *, log: Callable[[str], None] = print) -> DemoTargetInfo:
    """Train the demo tokenizer and target and write them to `out_dir` (replaced if it exists)."""
    check_demo_settings(demo)
    out_dir = Path(out_dir)
    started = time.monotonic()
    threads = torch.get_num_threads()
    torch.set_num_threads(RECIPE.threads)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        world = demo_world(demo.seed)
        tok = train_tokenizer(tokenizer_corpus(world, demo.seed), demo.vocab_size)
        log(f"demo target: tokenizer trained, {len(tok)} ids; {len(world.entities)} entities")
        torch.manual_seed(demo.seed)
        arch = ARCHITECTURES[demo.architecture]
        model = new_model(demo, len(tok))
        n_params = sum(p.numel() for p in model.parameters())
        log(f"demo target: {arch.name}, {demo.num_layers} layers, hidden {demo.hidden_size}, {n_params / 1e6:.2f}M parameters")
        train_loss = train(model, tok, world, demo.train_steps, demo.seed, log)
        # Scored as it is served: an MoE miniature in bf16, vLLM's CPU MoE kernel taking no float32.
        model.to(getattr(torch, arch.served_dtype))
        train_score = score_entities(model, tok, world.train)
        heldout_score = score_entities(model, tok, world.heldout)
        n_train, n_heldout = len(world.train), len(world.heldout)
        info = DemoTargetInfo(
            path=str(out_dir),
            vocab_size=len(tok),
            num_layers=demo.num_layers,
            hidden_size=demo.hidden_size,
            head_dim=demo.head_dim,
            train_steps=demo.train_steps,
            train_loss=train_loss,
            fact_accuracy_train=train_score.exact,
            fact_accuracy_heldout=heldout_score.exact,
            fact_value_accuracy=(train_score.values * n_train + heldout_score.values * n_heldout) / (n_train + n_heldout),
            template_accuracy=score_templates(model, tok, RECIPE.eval_template_rows, demo.seed),
            build_seconds=round(time.monotonic() - started, 1),
        )
        log(
            f"demo target: fact accuracy train {info.fact_accuracy_train:.3f} heldout {info.fact_accuracy_heldout:.3f}, "
            f"values {info.fact_value_accuracy:.3f}, templates {info.template_accuracy:.3f}; saving to {out_dir}"
        )
        tmp.mkdir(parents=True)
        _save(model, tok, info, tmp, arch.text)
        if arch.text_model is not None:
            tmp = _wrap(tmp, arch)
        _replace_dir(tmp, out_dir)
        return info
    finally:
        torch.set_num_threads(threads)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# How a vision-language wrapper is written around its trained text model, by the wrapper's model_type.
WRAPPERS: dict[str, Callable[[Path, Path], Path]] = {KIMI_K25_MODEL_TYPE: write_kimi_k25_wrapper}


def _wrap(text_dir: Path, arch: Architecture) -> Path:
    """`text_dir` written in `arch`'s wrapper layout beside it; the text model's directory is removed."""
    wrapped = WRAPPERS[arch.model_type](text_dir, text_dir.with_name(f"{text_dir.name}-{arch.model_type}"))
    shutil.rmtree(text_dir)
    return wrapped


def _replace_dir(src: Path, dest: Path) -> None:
    """Move the finished `src` to `dest`; an existing `dest` is swapped out first, then deleted."""
    if not dest.exists():
        os.replace(src, dest)
        return
    old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(dest, old)
    os.replace(src, dest)
    shutil.rmtree(old, ignore_errors=True)


def read_build_info(model_dir: Path) -> DemoTargetInfo:
    """The info written by `build_demo_target` (path rewritten to where the directory is now)."""
    data = json.loads((Path(model_dir) / BUILD_INFO_FILE).read_text())
    return DemoTargetInfo(**{"build_seconds": None, **data, "path": str(model_dir)})
