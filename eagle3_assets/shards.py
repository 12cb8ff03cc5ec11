"""Hidden-state shards: row ranges and their partition keys (`rows_0-2000`, …)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_KEY = re.compile(r"^rows_(\d+)-(\d+)$")


@dataclass(frozen=True, order=True)
class Shard:
    """Rows [start, end) of the tokenized set; its key is also its directory name."""

    start: int
    end: int

    @property
    def key(self) -> str:
        return f"rows_{self.start}-{self.end}"

    @property
    def rows(self) -> range:
        return range(self.start, self.end)

    def __len__(self) -> int:
        return self.end - self.start

    @classmethod
    def parse(cls, key: str) -> Shard:
        m = _KEY.match(key)
        if not m or int(m.group(1)) >= int(m.group(2)):
            raise ValueError(f"not a shard key: {key!r} (expected rows_<start>-<end> with start < end)")
        return cls(int(m.group(1)), int(m.group(2)))


def plan_shards(num_rows: int, shard_size: int) -> list[Shard]:
    """Consecutive shards of `shard_size` rows; the last one holds the remainder."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    return [Shard(s, min(s + shard_size, num_rows)) for s in range(0, num_rows, shard_size)]
