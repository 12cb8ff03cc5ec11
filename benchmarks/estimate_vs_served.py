"""The held-out estimate against served acceptance, before and after calibration (issue 43, item 5).

Reads JSON lines, one per drafter served, with `drafter`, `family`, `estimate_k3`, `estimate_k7`, `served_k3`,
`served_k7` (what `bench_checkpoint_choice.py` and `bench_families.py` print), and prints, per k, over all drafters:
Spearman's rank correlation and the mean ratio estimate / served of the raw estimate, and of the calibrated one
(`drafter/calibration.py`) judged leave-one-out: each drafter calibrated by the other drafters of its family only,
as drafter_eval calibrates a new export by the store's past evaluations.

    .venv/bin/python benchmarks/estimate_vs_served.py rows.jsonl [more.jsonl ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eagle3_assets.drafter.acceptance import SPECULATIVE_TOKENS
from eagle3_assets.drafter.calibration import EstimatePoint, leave_one_out, mean_ratio, spearman


def main(paths: list[str]) -> int:
    lines = [line for p in paths for line in Path(p).read_text().splitlines()]
    rows = [json.loads(line) for line in lines if line.strip().startswith("{")]
    rows = [r for r in rows if "served_k3" in r]
    out: dict[str, object] = {"drafters": len(rows), "families": sorted({r["family"] for r in rows})}
    for k in SPECULATIVE_TOKENS:
        points = [EstimatePoint(r["family"], k, r[f"estimate_k{k}"], r[f"served_k{k}"], r["drafter"]) for r in rows]
        loo = leave_one_out(points)
        est, served = [p.estimate for p in points], [p.served for p in points]
        judged = [(c, p.served) for c, p in zip(loo, points) if c is not None]
        out[f"k{k}"] = {
            "raw": {"spearman": round(spearman(est, served), 3), "mean_ratio": round(mean_ratio(est, served), 3)},
            "calibrated_leave_one_out": {
                "drafters": len(judged),
                "spearman": round(spearman([c for c, _ in judged], [s for _, s in judged]), 3),
                "mean_ratio": round(mean_ratio([c for c, _ in judged], [s for _, s in judged]), 3),
                "mean_abs_error": round(sum(abs(c - s) for c, s in judged) / len(judged), 3),
            },
            "per_drafter": [
                {
                    "drafter": p.export_sha256,
                    "estimate": p.estimate,
                    "calibrated": None if c is None else round(c, 3),
                    "served": p.served,
                }
                for p, c in zip(points, loo)
            ],
        }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
