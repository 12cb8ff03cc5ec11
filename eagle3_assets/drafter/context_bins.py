"""Context-length bins: acceptance by how long the prompt is.

A drafter trained at short lengths can collapse at long ones, and a mean over all prompts hides it when
long prompts are few. `drafter_eval` labels each held-out prompt with the bin its prompt length in tokens (the
ids the engine is given) falls in, by `evaluation.context_bins` edges: bin i holds lengths in
[edges[i], edges[i+1]), the last one every length from the last edge on. A bin with fewer than
`evaluation.min_prompts_per_bin` prompts is reported as too small: its figures are kept, but the release gate
does not judge on them (a mean over two prompts moves by ±50% between prompts).

vLLM's counters are read per `generate` call (`vllm_eval` `groups`), so each (mode, bin) pair is one group; the
per-mode and per-bin figures are sums of the groups' counters.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import pairwise

GROUP_SEPARATOR = "|"  # never in a bin label, so a mode label holding one still splits right (`split_group`)


def bin_labels(edges: Sequence[int]) -> list[str]:
    """One label per bin, in edge order: "0-1024" for [0, 1024), "65536+" for the open last bin."""
    return [f"{lo}-{hi}" for lo, hi in pairwise(edges)] + [f"{edges[-1]}+"]


def context_bin(length: int, edges: Sequence[int]) -> str:
    """The label of the bin `length` (prompt tokens) falls in; `edges` start at 0 (settings check it)."""
    if length < edges[0]:
        raise ValueError(f"prompt length {length} is below the first context bin edge {edges[0]}")
    return bin_labels(edges)[bisect_right(edges, length) - 1]


def prompts_per_bin(lengths: Sequence[int], edges: Sequence[int]) -> dict[str, int]:
    """Prompts in every bin, empty ones included (an empty bin is reported, never silently dropped)."""
    counts = dict.fromkeys(bin_labels(edges), 0)
    for n in lengths:
        counts[context_bin(n, edges)] += 1
    return counts


def too_small(counts: dict[str, int], minimum: int) -> list[str]:
    """The bins with fewer than `minimum` prompts: reported, not judged."""
    return [b for b, n in counts.items() if n < minimum]


def group_label(mode: str, bin_label: str) -> str:
    """The `vllm_eval` group of the prompts of one chat-template mode in one context bin."""
    return f"{mode}{GROUP_SEPARATOR}{bin_label}"


def split_group(label: str) -> tuple[str, str]:
    """(mode, bin) of a `group_label`."""
    mode, _, bin_label = label.rpartition(GROUP_SEPARATOR)
    return mode, bin_label
