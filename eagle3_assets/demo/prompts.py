"""The demo prompt sets: pipeline prompts about `train` entities, evaluation prompts about `heldout` ones.

Issue 7: the prompts that evaluate the drafter ask about facts whose answers never
appear in the drafter's training data. The pipeline prompts (answered later by the
target itself, greedily, and so the drafter's training text) name only `train`
entities; the evaluation prompts name only `heldout` entities. Both sets also hold
template tasks, whose answers follow from the prompt text; `kind` tells them apart.

Each prompt is `{"id": str, "prompt": str, "kind": "fact" | "template"}`. The target's
ideal response to a prompt, with the character spans of its fact text, comes from
`reference_response(demo, id)` (see `world.Conversation` for the span convention);
evaluation prompts also carry it, as `reference` (the assistant text) and
`fact_spans`, which `drafter_eval` uses to score fact tokens apart from template ones.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import lru_cache

from eagle3_assets.demo.world import (
    ATTRIBUTE_NAMES,
    PAIR_QUESTIONS,
    Conversation,
    Entity,
    demo_world,
    pair_fact_conversation,
    random_template_conversation,
    single_fact_conversation,
)
from eagle3_assets.settings import DemoSettings

PIPELINE_FACT_SHARE = 0.6  # share of fact prompts in the pipeline set
EVAL_PROMPTS = 64
EVAL_FACT_SHARE = 0.75  # the rest of the eval set are template prompts, for contrast
PAIR_SHARE = 0.2  # share of two-entity questions among fact prompts
_NEW_PROMPT_TRIES = 50  # draws to find a prompt not used yet before accepting a repeat


def demo_prompt_sets(demo: DemoSettings) -> tuple[list[dict], list[dict]]:
    """(pipeline prompts as {"id", "prompt", "kind"}, held-out eval prompts with "reference" and "fact_spans" too)."""
    pipeline, evaluation = _conversations(demo.seed, demo.num_prompts)
    evaluation_prompts = [
        p | {"reference": c.assistant_text, "fact_spans": [list(s) for s in c.fact_spans]}
        for p, (_, c) in zip(_as_prompts(evaluation), evaluation, strict=True)
    ]
    return _as_prompts(pipeline), evaluation_prompts


def demo_references(demo: DemoSettings) -> dict[str, Conversation]:
    """Prompt id -> the target's ideal response (reasoning, content, fact spans), both sets."""
    pipeline, evaluation = _conversations(demo.seed, demo.num_prompts)
    return dict(pipeline) | dict(evaluation)


def reference_response(demo: DemoSettings, prompt_id: str) -> Conversation:
    """The ideal response to one demo prompt; KeyError naming the id when it is not a demo prompt."""
    refs = demo_references(demo)
    if prompt_id not in refs:
        raise KeyError(f"{prompt_id!r} is not a demo prompt id for seed {demo.seed} and {demo.num_prompts} prompts")
    return refs[prompt_id]


def demo_extra_eval_prompts(demo: DemoSettings, n: int) -> list[dict]:
    """`n` more held-out prompts like the eval set (facts about held-out entities, and template prompts), none of
    them a pipeline or eval prompt, drawn after both so neither set moves: for measuring how much the eval set's
    64 answers decide the served figure (benchmarks/bench_demo_eval_set.py)."""
    return _as_prompts(demo_extra_eval_conversations(demo, n))


def demo_extra_eval_conversations(demo: DemoSettings, n: int) -> list[tuple[str, Conversation]]:
    """`demo_extra_eval_prompts`' prompts as (id, conversation): with the world's answer to each."""
    pipeline, evaluation = _conversations(demo.seed, demo.num_prompts)
    used = {c.prompt for _, c in pipeline + evaluation}
    rng = random.Random(f"demo-extra-eval-prompts-{demo.seed}")
    n_fact = round(n * EVAL_FACT_SHARE)
    extra = _fact_rows(demo_world(demo.seed).heldout, n_fact, rng, used) + _template_rows(n - n_fact, rng, used)
    rng.shuffle(extra)
    return [(f"extra-{i}", c) for i, c in enumerate(extra)]


def _as_prompts(rows: list[tuple[str, Conversation]]) -> list[dict]:
    return [{"id": pid, "prompt": c.prompt, "kind": c.kind} for pid, c in rows]


@lru_cache(maxsize=4)
def _conversations(seed: int, num_prompts: int) -> tuple[list[tuple[str, Conversation]], list[tuple[str, Conversation]]]:
    world = demo_world(seed)
    used: set[str] = set()
    # The evaluation set first, from its own random stream: it stays the same whatever
    # num_prompts is, and the pipeline prompts are then drawn around it.
    rng = random.Random(f"demo-eval-prompts-{seed}")
    n_eval_fact = round(EVAL_PROMPTS * EVAL_FACT_SHARE)
    evaluation = _fact_rows(world.heldout, n_eval_fact, rng, used) + _template_rows(EVAL_PROMPTS - n_eval_fact, rng, used)
    rng.shuffle(evaluation)
    rng = random.Random(f"demo-prompts-{seed}")
    n_fact = round(num_prompts * PIPELINE_FACT_SHARE)
    pipeline = _fact_rows(world.train, n_fact, rng, used) + _template_rows(num_prompts - n_fact, rng, used)
    rng.shuffle(pipeline)  # shards get a mix of kinds
    return (
        [(f"demo-{i:0{len(str(num_prompts - 1))}d}", c) for i, c in enumerate(pipeline)],
        [(f"eval-{i:0{len(str(EVAL_PROMPTS - 1))}d}", c) for i, c in enumerate(evaluation)],
    )


def _fact_rows(entities: list[Entity], n: int, rng: random.Random, used: set[str]) -> list[Conversation]:
    """n fact questions about `entities` only: every single question not in `used` once before any repeats, some pairs."""
    n_pair = round(n * PAIR_SHARE) if len(entities) >= 2 else 0
    every = [single_fact_conversation(e, a) for e in entities for a in ATTRIBUTE_NAMES]
    singles = [c for c in every if c.prompt not in used] or every
    rng.shuffle(singles)
    rows = (singles * (1 + (n - n_pair) // len(singles)))[: n - n_pair]
    used.update(c.prompt for c in rows)

    def pair() -> Conversation:
        a, b = rng.sample(entities, 2)
        return pair_fact_conversation(a, b, rng.choice(PAIR_QUESTIONS))

    rows += [_draw_new(pair, used) for _ in range(n_pair)]
    return rows


def _template_rows(n: int, rng: random.Random, used: set[str]) -> list[Conversation]:
    return [_draw_new(lambda: random_template_conversation(rng), used) for _ in range(n)]


def _draw_new(draw: Callable[[], Conversation], used: set[str]) -> Conversation:
    """A conversation whose prompt is not in `used` if one turns up in a few draws, else a repeat."""
    for _ in range(_NEW_PROMPT_TRIES):
        c = draw()
        if c.prompt not in used:
            break
    used.add(c.prompt)
    return c
