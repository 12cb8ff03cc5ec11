"""Dagster definitions, grouped by domain: `data/` (prompts … vocab_map), `shards/` (hidden states),
`drafter/`. Each domain has `assets.py` and, where it has them, `checks.py`, `partitions.py`,
`automation.py`. The logic they call lives in plain modules outside `defs/`."""
