"""Every served figure explained: vLLM's speculative rounds replayed with the trained drafter (issue 54, item 3).

On the target's own greedy answer, a speculative round whose last verified index is t drafts k tokens from the
target's features up to t and the tokens up to t + 1, and greedy verification accepts the leading drafts that equal
the answer's next tokens; the next round starts past the accepted ones and the target's own token. Everything a
round needs is on hand after the eval: the greedy answers, the target's features of prompt + answer (the extraction
backend the shards are made with), and the trained drafter, which drafts every round of a row in one forward
(`Family.drafted`: an EAGLE-3 unroll at every index, a DFlash block at every anchor). Replaying the rounds gives the
counters vLLM reports, drafts and accepted drafts per position, when vLLM serves exactly what trained.

They part when it does not: a layer tap off by one, a rotary layout, a norm, a weight vLLM's loader never read. Each
moves acceptance at some position more than float rounding (a bf16 engine beside float32 features) does, so a
per-position difference of `REPLAY_TOLERANCE` in acceptance rate (and a draft) parts them; the check names the first
position that parts and which suspects the export's config already shows (`export_suspects`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagle3_assets.drafter.export import TRAINED_ON_FILE
from eagle3_assets.drafter.family import Family
from eagle3_assets.drafter.vllm_eval import GenerationResult
from eagle3_assets.hidden_states.base import ExtractedSample

# Most a per-position acceptance rate may differ between vLLM's counters and the replay, beside one draft's share of
# them (`ReplayCheck.allowed`). The engine's features and the extractor's differ by rounding, which flips a near-tie
# draft now and then: measured up to 0.013 (the small demo, both families, ~450-680 drafts; one draft of 54 on the
# Qwen3-MoE leg). A defect moves rates by more, even on a tiny target that drafts mostly from the tokens (target
# layers off by one: 0.08 at position 0; a norm before fc: 0.27).
REPLAY_TOLERANCE = 0.03
# The `trained_on.json` entry that says how an engine must serve the drafter to serve what trained
# (`Family.served_as`), written with the export by the trainer.
SERVED_AS = "served_as"


@dataclass(frozen=True)
class Rounds:
    """Speculative rounds as vLLM counts them: drafts (rounds that drafted) and, per position, drafts accepted.
    `past_end`, replayed only: per position, the drafts of a request's last round that lie past its answer's end, every
    draft before them accepted. vLLM counts a round's accepted drafts before it cuts the output at the stop token (or
    at max_tokens), so it may count these too: the target verified them against its own continuation past the end,
    which the answer does not hold. Empty: none."""

    drafts: int
    accepted: list[int]
    past_end: list[int] = field(default_factory=list)

    @property
    def rates(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted]

    @property
    def past_end_rates(self) -> list[float]:
        return [p / self.drafts if self.drafts else 0.0 for p in self.past_end or [0] * len(self.accepted)]

    def __add__(self, other: Rounds) -> Rounds:
        zeros = [0] * len(self.accepted)
        past = [a + b for a, b in zip(self.past_end or zeros, other.past_end or zeros, strict=True)]
        accepted = [a + b for a, b in zip(self.accepted, other.accepted, strict=True)]
        return Rounds(self.drafts + other.drafts, accepted, past if any(past) else [])


def replay_rounds(drafted: torch.Tensor, ids: Sequence[int], start: int, served: int) -> Rounds:
    """The rounds vLLM drafts serving `served` tokens after the prompt `ids[:start]`, where `ids` is the prompt and the
    greedy answer and `drafted[a, t]` [k, T] the target id the drafter proposes at position a of a round whose last
    verified index is t (the token it proposes for index t + 2 + a). A round that accepts every draft up to the
    answer's end counts its later positions in `past_end`."""
    k = drafted.shape[0]
    drafts, accepted, past_end = 0, [0] * k, [0] * k
    newest = start  # index of the newest token: the prefill's output first
    while newest - start + 1 < served:  # the request is unfinished: another round
        t, a = newest - 1, 0
        drafts += 1
        while a < k and t + 2 + a < len(ids) and int(drafted[a, t]) == ids[t + 2 + a]:
            accepted[a] += 1
            a += 1
        if a < k and t + 2 + a >= len(ids):  # every draft up to the answer's end accepted: the rest lie past it
            for p in range(a, k):
                past_end[p] += 1
        newest += a + 1
    return Rounds(drafts, accepted, past_end if any(past_end) else [])


@dataclass(frozen=True)
class ReplayCheck:
    """vLLM's counters at k against the replay's; `slack`: the share of the drafts allowed on top of the tolerance
    for answers whose speculative output parted from greedy (near ties: the replay cannot follow vLLM past there)."""

    k: int
    served: Rounds
    replayed: Rounds
    tolerance: float = REPLAY_TOLERANCE
    slack: float = 0.0
    suspects: list[str] = field(default_factory=list)

    @property
    def allowed(self) -> float:
        """The most a position's rates may part: the tolerance, the slack and one draft's share."""
        return self.tolerance + self.slack + 1 / max(self.served.drafts, 1)

    @property
    def parted_at(self) -> int | None:
        """The first draft position (0-based, vLLM's `acceptance_per_position` index) whose rates part: vLLM's rate
        below the replay's, or above it and the drafts it may have counted past an answer's end (`Rounds.past_end`)."""
        rates = zip(self.served.rates, self.replayed.rates, self.replayed.past_end_rates, strict=True)
        return next(
            (i for i, (s, r, past) in enumerate(rates) if s < r - self.allowed or s > r + past + self.allowed), None
        )

    @property
    def passed(self) -> bool:
        return self.parted_at is None

    def describe(self) -> str:
        served = ", ".join(f"{r:.3f}" for r in self.served.rates)
        replayed = ", ".join(f"{r:.3f}" for r in self.replayed.rates)
        past = ", ".join(f"{r:.3f}" for r in self.replayed.past_end_rates)
        head = (
            f"k={self.k}: vLLM accepted per position [{served}] over {self.served.drafts} drafts, the trained drafter "
            f"replayed [{replayed}] over {self.replayed.drafts}"
            + (f" (and up to [{past}] more past the answers' ends)" if self.replayed.past_end else "")
        )
        if (at := self.parted_at) is None:
            return f"{head}: within {self.allowed:.3f} at every position"
        why = "; ".join(self.suspects) or (
            "the export's config is the trained one: a weight vLLM's loader never read, or a rotary or norm layout "
            "vLLM's model computes otherwise"
        )
        return f"{head}: they part at position {at} (by more than {self.allowed:.3f}). Suspects: {why}"

    def as_json(self) -> dict[str, Any]:
        return {
            "k": self.k, "passed": self.passed, "parted_at": self.parted_at, "allowed": round(self.allowed, 4),
            "served_drafts": self.served.drafts, "replayed_drafts": self.replayed.drafts,
            "served_per_position": [round(r, 4) for r in self.served.rates],
            "replayed_per_position": [round(r, 4) for r in self.replayed.rates],
            "replayed_past_end_per_position": [round(r, 4) for r in self.replayed.past_end_rates],
            "suspects": self.suspects,
        }  # fmt: skip


def export_suspects(trained: dict[str, Any], exported: dict[str, Any]) -> list[str]:
    """What the export tells vLLM that differs from what trained, field by field (both the drafter's config as a
    dict, `aux_layer_ids` included): each a cheap, certain cause of a parting."""
    return [
        f"the export says {name} {exported.get(name)!r}, the drafter trained with {value!r}"
        for name, value in trained.items()
        if exported.get(name) != value
    ]


def trained_served_as(family: Family, export_dir: Path) -> tuple[dict[str, Any], list[str]]:
    """(how the drafter served must be read to be the one that trained, and what the export tells vLLM otherwise).
    An export without the trainer's record (an imported drafter, one exported before the record) is replayed as
    its config says: the check then proves the served figure is the export's own."""
    exported = family.export_says(export_dir)
    record = export_dir / TRAINED_ON_FILE
    trained = json.loads(record.read_text()).get(SERVED_AS) if record.exists() else None
    return (trained, export_suspects(trained, exported)) if trained else (exported, [])


def replay_served(
    family: Family, model: nn.Module, samples: Sequence[ExtractedSample], prompt_lengths: Sequence[int],
    speculative: Mapping[int, GenerationResult], suspects: list[str],
) -> list[ReplayCheck]:  # fmt: skip
    """Each speculative pass (k -> vLLM's result) against the rounds `model` drafts on the same answers: `samples`
    the target's features of prompt + greedy answer per prompt, `prompt_lengths` where each answer starts."""
    checks, device = [], next(model.parameters()).device
    for k, spec in speculative.items():
        replayed, parted_tokens = Rounds(0, [0] * k), 0
        for sample, start, served in zip(samples, prompt_lengths, spec.outputs, strict=True):
            ids = sample.input_ids.tolist()
            # Past a near tie vLLM answered otherwise than greedy: the replay follows it only up to there.
            same = next((i for i, (a, b) in enumerate(zip(served, ids[start:])) if a != b), len(served))
            parted_tokens += len(served) - same
            row, aux = torch.as_tensor(ids, device=device)[None], sample.aux_hidden_states[None].to(device)
            drafted = family.drafted(model, row, aux, k).cpu()
            replayed += replay_rounds(drafted, ids, start, same)
        accepted = list(spec.accepted_per_position)[:k]
        served_rounds = Rounds(spec.num_drafts, accepted + [0] * (k - len(accepted)))
        slack = parted_tokens / spec.num_drafts if spec.num_drafts else 0.0
        checks.append(ReplayCheck(k, served_rounds, replayed, slack=slack, suspects=suspects))
    return checks
