"""A synthetic world for the demo target: entities with facts, and tasks about them.

Issue 7: acceptance on text that predicts itself cannot tell a working drafter from
a broken one. So the demo target is taught facts that live only in its weights:
a few hundred made-up entities (names built from syllables, so BPE splits them into
several tokens), each with one value per attribute. A fact question names an entity
and the response recalls the entity's whole profile in its reasoning, values only,
in a fixed order, so 44% (one entity) to 47% (two) of the assistant tokens of a fact
row, counting <think>, </think> and <|end|>, are facts that appear nowhere in the prompt:

    What does Mirenor eat?  ->  <think>white Ilmar fish cat hammer 33</think>It eats fish.
 Template tasks (arithmetic, copying, reversing,
counting) have answers derivable from the prompt text: the predictable part.

Everything is a pure function of a seed. Entities are split `train` / `heldout`:
the drafter's prompts ask about `train` entities only, its evaluation prompts about
`heldout` ones; the target itself is taught every entity.

Fact spans: `Conversation.fact_spans` are [start, end) character offsets into
`Conversation.assistant_text` = "<think>" + reasoning + "</think>" + content, which
is exactly the text the target generates after "<|assistant|>" (before "<|end|>").
A span covers one attribute value (no surrounding space) at its FIRST mention in the
response, i.e. in the reasoning; later repeats (in the answer) are copyable from the
context and are not marked. Template rows have no fact spans.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# Attribute value lists are disjoint, so a value's place in a profile is unambiguous.
# Pets and tools all start with a consonant so "a {value}" reads right.
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "color": ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "gray", "pink"),
    "city": ("Avalon", "Brindle", "Corvo", "Dunmere", "Eskar", "Fenwick", "Galt", "Harrow", "Ilmar", "Jorvik"),
    "food": ("apples", "bread", "cheese", "rice", "fish", "honey", "soup", "plums", "nuts", "beans"),
    "pet": ("cat", "dog", "fox", "hen", "yak", "bat", "cow", "pig", "rat", "goat"),
    "tool": ("hammer", "saw", "drill", "brush", "rope", "spade", "needle", "ladder", "wrench", "shovel"),
    "number": tuple(str(n) for n in range(10, 100)),
}
ATTRIBUTE_NAMES: tuple[str, ...] = tuple(ATTRIBUTES)

# Single-entity questions: (attribute asked, question, answer). The reasoning always
# recalls the full profile; the answer repeats the value asked for.
SINGLE_QUESTIONS: dict[str, tuple[str, str]] = {
    "color": ("What color is {name}?", "It is {value}."),
    "city": ("Where does {name} live?", "It lives in {value}."),
    "food": ("What does {name} eat?", "It eats {value}."),
    "pet": ("What pet does {name} keep?", "It keeps a {value}."),
    "tool": ("What tool does {name} use?", "It uses a {value}."),
    "number": ("What is the number of {name}?", "Its number is {value}."),
}
PAIR_QUESTIONS: tuple[str, ...] = ("same_city", "larger_number")

LIST_WORDS: tuple[str, ...] = (
    "kiwi", "lamp", "door", "tree", "book", "cup", "sun", "rock",
    "boat", "star", "key", "ring", "hat", "shoe", "bell", "pen",
)  # fmt: skip
TEMPLATE_TASKS: tuple[str, ...] = ("add", "copy", "reverse", "count")

NAME_SYLLABLES: tuple[str, ...] = (
    "ka", "zo", "mi", "vel", "dar", "ru", "te", "lin", "bo", "sha",
    "qui", "nor", "fe", "ga", "lo", "pim", "tar", "xu", "re", "wen",
    "su", "jo", "bel", "ko", "mur", "di", "fa", "yen", "pa", "tho",
)  # fmt: skip

Split = Literal["train", "heldout"]
Kind = Literal["fact", "template"]


@dataclass(frozen=True)
class Entity:
    name: str
    attributes: dict[str, str] = field(hash=False)  # attribute -> value, in ATTRIBUTE_NAMES order
    split: Split

    def profile(self) -> list[str]:
        """The attribute values in the fixed recall order."""
        return [self.attributes[a] for a in ATTRIBUTE_NAMES]


@dataclass(frozen=True)
class World:
    seed: int
    entities: tuple[Entity, ...]

    @property
    def train(self) -> list[Entity]:
        return [e for e in self.entities if e.split == "train"]

    @property
    def heldout(self) -> list[Entity]:
        return [e for e in self.entities if e.split == "heldout"]

    def entity(self, name: str) -> Entity:
        for e in self.entities:
            if e.name == name:
                return e
        raise KeyError(f"no entity named {name!r} in the world of seed {self.seed}")


@dataclass(frozen=True)
class Conversation:
    """One user prompt and the target's ideal response, kept as reasoning + answer."""

    kind: Kind
    task: str  # a SINGLE_QUESTIONS key, a PAIR_QUESTIONS entry or a TEMPLATE_TASKS entry
    prompt: str
    reasoning: str
    content: str
    fact_spans: tuple[tuple[int, int], ...]  # [start, end) into assistant_text, first mentions only
    entities: tuple[str, ...] = ()  # names of the entities the prompt asks about

    @property
    def assistant_text(self) -> str:
        """What the target generates after <|assistant|>, up to (not including) <|end|>."""
        return f"{THINK_OPEN}{self.reasoning}{THINK_CLOSE}{self.content}"

    def fact_texts(self) -> list[str]:
        text = self.assistant_text
        return [text[a:b] for a, b in self.fact_spans]


def build_world(seed: int, num_entities: int = 250, heldout_fraction: float = 0.2) -> World:
    """`num_entities` entities with distinct multi-syllable names; the last `heldout_fraction` are held out."""
    if num_entities < 2:
        raise ValueError(f"num_entities: need at least 2 entities (one train, one heldout), got {num_entities}")
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction: must be strictly between 0 and 1, got {heldout_fraction}")
    rng = random.Random(f"demo-world-{seed}")
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < num_entities:
        name = "".join(rng.choice(NAME_SYLLABLES) for _ in range(3)).capitalize()
        if name not in seen:
            seen.add(name)
            names.append(name)
    num_heldout = max(1, min(num_entities - 1, round(num_entities * heldout_fraction)))
    entities = []
    for i, name in enumerate(names):
        attributes = {a: rng.choice(values) for a, values in ATTRIBUTES.items()}
        split: Split = "heldout" if i >= num_entities - num_heldout else "train"
        entities.append(Entity(name=name, attributes=attributes, split=split))
    return World(seed=seed, entities=tuple(entities))


class _Builder:
    """Appends reasoning text piece by piece and records where each fact lands."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.length = len(THINK_OPEN)  # offsets are into assistant_text, which starts with <think>
        self.spans: list[tuple[int, int]] = []

    def text(self, s: str) -> None:
        self.parts.append(s)
        self.length += len(s)

    def fact(self, s: str) -> None:
        self.spans.append((self.length, self.length + len(s)))
        self.text(s)

    def profile(self, entity: Entity) -> None:
        for i, value in enumerate(entity.profile()):
            if i:
                self.text(" ")
            self.fact(value)

    @property
    def reasoning(self) -> str:
        return "".join(self.parts)


def single_fact_conversation(entity: Entity, attribute: str) -> Conversation:
    """'What does Mirenor eat?' -> <think>white Ilmar fish cat hammer 33</think>It eats fish."""
    question, answer = SINGLE_QUESTIONS[attribute]
    b = _Builder()
    b.profile(entity)
    return Conversation(
        kind="fact",
        task=attribute,
        prompt=question.format(name=entity.name),
        reasoning=b.reasoning,
        content=answer.format(value=entity.attributes[attribute]),
        fact_spans=tuple(b.spans),
        entities=(entity.name,),
    )


def pair_fact_conversation(a: Entity, b_: Entity, task: str) -> Conversation:
    """Two profiles recalled, then an answer derived from them."""
    if a.name == b_.name:
        raise ValueError(f"a pair question needs two different entities, got {a.name} twice")
    if task == "same_city":
        prompt = f"Do {a.name} and {b_.name} live in the same city?"
        content = "Yes." if a.attributes["city"] == b_.attributes["city"] else "No."
    elif task == "larger_number":
        prompt = f"Who has the larger number, {a.name} or {b_.name}?"
        na, nb = int(a.attributes["number"]), int(b_.attributes["number"])
        content = "They are equal." if na == nb else f"{a.name if na > nb else b_.name}."
    else:
        raise ValueError(f"unknown pair question {task!r}; expected one of {PAIR_QUESTIONS}")
    b = _Builder()
    for i, e in enumerate((a, b_)):
        b.text(f"{' ' if i else ''}{e.name}: ")
        b.profile(e)
        b.text(".")
    return Conversation(
        kind="fact",
        task=task,
        prompt=prompt,
        reasoning=b.reasoning,
        content=content,
        fact_spans=tuple(b.spans),
        entities=(a.name, b_.name),
    )


def template_conversation(task: str, rng: random.Random) -> Conversation:
    """A task whose answer is derivable from the prompt alone."""
    if task == "add":
        x, y = rng.randrange(10), rng.randrange(10)
        prompt, reasoning, content = f"What is {x} + {y}?", f"{x} + {y} = {x + y}", f"{x + y}"
    elif task in ("copy", "reverse", "count"):
        words = rng.sample(LIST_WORDS, rng.randint(3, 5))
        listed = " ".join(words)
        if task == "copy":
            prompt, reasoning, content = f"Repeat these words: {listed}", f"{len(words)} words", listed
        elif task == "reverse":
            prompt = f"Reverse these words: {listed}"
            reasoning = f"{len(words)} words, last first"
            content = " ".join(reversed(words))
        else:
            prompt = f"How many words are in: {listed}"
            reasoning = listed  # copied as-is: "kiwi 1, lamp 2" or "kiwi, lamp" defeat a 4-layer model's copying
            content = f"{len(words)}"
    else:
        raise ValueError(f"unknown template task {task!r}; expected one of {TEMPLATE_TASKS}")
    return Conversation(kind="template", task=task, prompt=prompt, reasoning=reasoning, content=content, fact_spans=())


def random_fact_conversation(entities: Sequence[Entity], rng: random.Random, pair_share: float = 0.2) -> Conversation:
    """A single-entity question (most of the time) or a two-entity one, about `entities` only."""
    if len(entities) >= 2 and rng.random() < pair_share:
        a, b = rng.sample(list(entities), 2)
        return pair_fact_conversation(a, b, rng.choice(PAIR_QUESTIONS))
    return single_fact_conversation(rng.choice(list(entities)), rng.choice(ATTRIBUTE_NAMES))


def random_template_conversation(rng: random.Random) -> Conversation:
    return template_conversation(rng.choice(TEMPLATE_TASKS), rng)


def all_single_fact_conversations(entities: Sequence[Entity]) -> list[Conversation]:
    """Every single-entity question about every entity given, in a fixed order."""
    return [single_fact_conversation(e, a) for e in entities for a in ATTRIBUTE_NAMES]


# The demo world's shape; the target and the prompt sets must agree on it.
NUM_ENTITIES = 250
HELDOUT_FRACTION = 0.2


def demo_world(seed: int) -> World:
    """The world the demo target is taught and the demo prompts ask about."""
    return build_world(seed, NUM_ENTITIES, HELDOUT_FRACTION)
