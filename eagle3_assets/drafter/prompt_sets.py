"""Judged where it matters: with `traffic` set, `drafter_eval` serves two prompt sets, the traffic's held-out split
(`traffic/heldout.jsonl`, never trained on) and the original held-out prompts (`prompts/eval_prompts.jsonl`), and
reports every drafter on each (`eval_report.PROMPT_SETS`), for `drafter_release` to judge on both (`release.py`).

Both sets are served in the same engine passes: an engine start costs more than decoding a few prompts on a CPU
host, so doubling the passes would double the eval. Each prompt's `vllm_eval` group is labelled with its set before
its (mode, context bin) label, and each set's figures add its groups' counters, as the per-mode and per-bin ones do
(`context_bins.py`). Without `traffic` no label carries a set: the groups, and so the report, are what they were.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from eagle3_assets.drafter.context_bins import split_group
from eagle3_assets.drafter.errors import EvaluationError
from eagle3_assets.drafter.eval_report import ACCEPTANCE_BY_BIN, ORIGINAL_SET, PROMPTS_BY_BIN, TRAFFIC_SET
from eagle3_assets.drafter.vllm_eval import GenerationResult
from eagle3_assets.prompts import Prompt, parse_prompts
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.traffic import TRAFFIC_HELDOUT_FILE

# Between a set's name and the (mode, bin) group: a control character, which no mode label holds (JSON escapes it,
# `chat.mode_label`), nor a bin label, nor a set's name; so a label is split on its first one.
SET_SEPARATOR = "\x1e"


def set_group(prompt_set: str, group: str) -> str:
    """The `vllm_eval` group of a set's prompts of one (mode, bin) group (`context_bins.group_label`)."""
    return f"{prompt_set}{SET_SEPARATOR}{group}"


def split_set(label: str) -> tuple[str, str]:
    """(set, (mode, bin) group) of a label; ("", label) for a label of no set (no `traffic`)."""
    prompt_set, sep, group = label.partition(SET_SEPARATOR)
    return (prompt_set, group) if sep else ("", label)


def merged_by(
    by_group: Mapping[str, GenerationResult], part: int, order: Sequence[str] = ()
) -> dict[str, GenerationResult]:
    """The groups' results added up by mode (`part` 0) or by context bin (1), whichever set they are of: the counters
    add. Keys in `order` first, in that order (bins in edge order), then the others as they came."""
    parts: dict[str, list[GenerationResult]] = {}
    for label, result in by_group.items():
        parts.setdefault(split_group(split_set(label)[1])[part], []).append(result)
    keys = [k for k in order if k in parts] + [k for k in parts if k not in order]
    return {key: GenerationResult.merged(parts[key]) for key in keys}


def of_set(by_group: Mapping[str, GenerationResult], prompt_set: str) -> dict[str, GenerationResult]:
    """The groups of one set's prompts."""
    return {label: r for label, r in by_group.items() if split_set(label)[0] == prompt_set}


@dataclass(frozen=True)
class PromptSet:
    name: str  # `TRAFFIC_SET`, `ORIGINAL_SET`
    prompts: list[Prompt]
    file: str  # where they were read, as the report names it


def traffic_heldout(store: ArtifactStore) -> list[Prompt]:
    """The traffic's held-out prompts `traffic_prompts` wrote."""
    if not store.exists(TRAFFIC_HELDOUT_FILE):
        raise EvaluationError(
            f"no traffic held-out prompts at {store.url_of(TRAFFIC_HELDOUT_FILE)}, and `traffic` is set: materialize "
            "traffic_prompts first"
        )
    return parse_prompts(store.read_text(TRAFFIC_HELDOUT_FILE), store.url_of(TRAFFIC_HELDOUT_FILE))


def served_sets(store: ArtifactStore, original: list[Prompt], original_file: str, traffic: bool) -> list[PromptSet]:
    """The prompt sets served, the original held-out prompts first (their place in the engine's prompt list is the one
    they had alone); none without `traffic`: the report is then the one it always was."""
    if not traffic:
        return []
    return [PromptSet(ORIGINAL_SET, original, original_file),
            PromptSet(TRAFFIC_SET, traffic_heldout(store), store.url_of(TRAFFIC_HELDOUT_FILE))]  # fmt: skip


def set_entries(sets: Sequence[PromptSet], bins: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, Any]]:
    """Each set's entry in a drafter's figures, before any pass filled them: its prompts, file and bins."""
    return {
        s.name: {"prompts": len(s.prompts), "prompts_file": s.file, PROMPTS_BY_BIN: dict(bins[s.name]),
                 ACCEPTANCE_BY_BIN: {}}
        for s in sets
    }  # fmt: skip


def blank_like(entries: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The same sets' entries with no figures yet: for another drafter served on the same prompts."""
    return {name: {"prompts": e["prompts"], "prompts_file": e["prompts_file"], PROMPTS_BY_BIN: e[PROMPTS_BY_BIN],
                   ACCEPTANCE_BY_BIN: {}} for name, e in entries.items()}  # fmt: skip


def add_set_figures(entries: dict[str, dict[str, Any]], by_group: Mapping[str, GenerationResult], k: int) -> None:
    """One speculative run's figures at k on each set (`set_entries`), overall and per context bin, rounded as the
    report writes figures. A set with no prompts gets none: nothing was served of it."""
    for name, entry in entries.items():
        groups = of_set(by_group, name)
        if not groups:
            continue
        entry[f"mean_acceptance_length_k{k}"] = round(GenerationResult.merged(list(groups.values())).mean_acceptance_length, 4)
        for b, part in merged_by(groups, 1, list(entry[PROMPTS_BY_BIN])).items():
            entry[ACCEPTANCE_BY_BIN].setdefault(b, {})[f"k{k}"] = round(part.mean_acceptance_length, 4)
