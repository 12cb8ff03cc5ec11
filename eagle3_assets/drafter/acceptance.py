"""Acceptance length estimated from training-time-test predictions, while the drafter trains.

Loss ranks checkpoints badly; what a drafter buys is the number of tokens each target
forward yields under chain drafting. At one held-out position the TTT unroll drafts
K tokens in a chain, each from the drafter's own previous step, and greedy verification
accepts the leading drafts whose argmax (through d2t) equals the target's argmax: the
"run" at that position is the number of leading TTT steps scored correct (a step that
does not count, e.g. the target's top-1 is outside the draft vocab, ends the run).
With k drafted tokens the target forward yields 1 + min(run, k) tokens, so

    expected tokens per target forward at k = 1 + mean(min(run, k)) = 1 + sum_{i<=k} P(run >= i)

and P(run >= i) is the acceptance rate at position i, in the form vLLM reports it.
Runs are kept as a histogram (`runs[r]` = positions whose run is r, r = 0..K): counts add
over batches and ranks.

Past the unroll (k > K) the rates are extrapolated geometrically: each further position
keeps the conditional rate of the last one, P(run >= i) = P(run >= K) * c**(i-K) with
c = P(run >= K) / P(run >= K-1). A run trained with ttt_steps >= 7 needs no extrapolation.
"""

from __future__ import annotations

import torch

from eagle3_assets.settings import SPECULATIVE_TOKENS


def chain_runs(hits: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Histogram [K+1] int64 of run lengths: `hits` bool [K, B, T] says whether step k's prediction at index t
    is correct, `starts` bool [B, T] the indices a chain starts at (step 0's trained predictions)."""
    alive = starts.clone()
    run = torch.zeros_like(starts, dtype=torch.int64)
    for hit in hits:
        alive &= hit
        run += alive
    return torch.bincount(run[starts], minlength=hits.shape[0] + 1)


def acceptance_rates(runs: torch.Tensor, k: int) -> list[float]:
    """P(run >= i) for i = 1..k, extrapolated past the unroll (module docstring); zeros when nothing was scored."""
    total = int(runs.sum())
    unroll = len(runs) - 1
    if total == 0:
        return [0.0] * k
    at_least = [int(runs[i:].sum()) / total for i in range(unroll + 1)]  # at_least[0] == 1
    ratio = at_least[unroll] / at_least[unroll - 1] if at_least[unroll - 1] else 0.0
    return [at_least[i] if i <= unroll else at_least[unroll] * ratio ** (i - unroll) for i in range(1, k + 1)]


def expected_accept_length(runs: torch.Tensor, k: int) -> float:
    """Expected tokens per target forward with k drafted tokens: 1 + sum of the first k acceptance rates."""
    return 1.0 + sum(acceptance_rates(runs, k))


def acceptance_estimates(runs: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """`accept_len_k3`, `accept_len_k7` (see SPECULATIVE_TOKENS) from a run histogram."""
    return {f"{prefix}accept_len_k{k}": expected_accept_length(runs, k) for k in SPECULATIVE_TOKENS}
