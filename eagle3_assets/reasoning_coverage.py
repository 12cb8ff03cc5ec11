"""The proof behind `tokenized`'s blocking check: every training row is what the target generated.

For each tokenized row and the `responses` row it came from:
- the mask-0 tokens are the prompt exactly as the engine saw it, and the mask-1 tokens
  are the completion exactly as the engine produced it (a prefix of it when the row was
  truncated at `max_seq_len`);
- the reasoning found on the row's own masked tokens (`reasoning.py`, the rule the
  generation used) is the reasoning token count `responses` recorded, so reasoning
  cannot silently fall out of the training data.
The figures say how much of the loss is reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any


from eagle3_assets.reasoning import ReasoningFormat, split_completion
from eagle3_assets.tokenized import TokenizedSet

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase  # annotations only: importing transformers costs ~2 s


@dataclass
class ReasoningCoverage:
    rows: int = 0
    rows_with_reasoning: int = 0
    reasoning_tokens: int = 0  # masked tokens that are reasoning
    loss_tokens: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def reasoning_share(self) -> float:
        return self.reasoning_tokens / self.loss_tokens if self.loss_tokens else 0.0

    def as_metadata(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "rows_with_reasoning": self.rows_with_reasoning,
            "reasoning_tokens": self.reasoning_tokens,
            "loss_tokens": self.loss_tokens,
            "reasoning_share_of_loss_tokens": round(self.reasoning_share, 4),
            "problems": len(self.problems),
        }


def reasoning_coverage(
    tset: TokenizedSet,
    records: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    fmt: ReasoningFormat,
    stop_token_ids: set[int],
    *,
    max_seq_len: int,
) -> ReasoningCoverage:
    by_row = {int(r["row"]): r for r in records}
    out = ReasoningCoverage()
    for r in range(tset.num_rows):
        ids, mask = tset.row(r)
        source = by_row.get(int(tset.row_ids[r]))
        where = f"tokenized row {r} (responses row {int(tset.row_ids[r])}"
        if source is None:
            out.problems.append(f"{where}): no such responses row")
            continue
        where += f", id {source.get('id')})"
        prompt, completion = source.get("prompt_token_ids") or [], source.get("completion_token_ids") or []
        kept, masked = ids[mask == 0].tolist(), ids[mask == 1].tolist()
        truncated = len(ids) == max_seq_len and len(masked) < len(completion)
        out.rows += 1
        out.loss_tokens += len(masked)
        if kept != prompt:
            out.problems.append(f"{where}: its mask-0 tokens are not the prompt the engine was given")
        if masked != (completion[: len(masked)] if truncated else completion):
            out.problems.append(
                f"{where}: its mask-1 tokens are not the completion the target generated "
                f"({len(masked)} masked, {len(completion)} generated)"
            )
            continue
        found = split_completion(tokenizer, fmt, prompt, masked, stop_token_ids).reasoning_tokens
        recorded = min(int(source.get("usage", {}).get("reasoning_tokens", 0)), len(masked))
        if found != recorded:
            out.problems.append(
                f"{where}: {found} reasoning tokens in the mask, {recorded} generated as reasoning"
            )
        out.rows_with_reasoning += found > 0
        out.reasoning_tokens += found
    return out


def first_problems(coverage: ReasoningCoverage, limit: int = 20) -> list[str]:
    more = len(coverage.problems) - limit
    return coverage.problems[:limit] + ([f"… and {more} more"] if more > 0 else [])

