"""Two ways of doing one thing, timed in alternation in the same run (best of `repeat` each), their outputs compared."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any


def best_of_alternating(
    ways: Mapping[str, Callable[[], tuple[float, Any]]], repeat: int
) -> tuple[dict[str, float], bool]:
    """Each way's best seconds over `repeat` rounds, each round running every way once in turn (so a machine that
    slows down mid-run slows both alike), and whether their outputs (the last round's) were all identical."""
    best = dict.fromkeys(ways, float("inf"))
    outputs: dict[str, str] = {}
    for _ in range(repeat):
        for name, run in ways.items():
            seconds, output = run()
            best[name], outputs[name] = min(best[name], seconds), json.dumps(output)
    return best, len(set(outputs.values())) == 1
