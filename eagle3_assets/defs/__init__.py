"""Dagster definitions, grouped by domain: `data/` (prompts … vocab_map), `shards/` (hidden states),
`drafter/`. Each domain has `assets.py` and, where it has them, `checks.py`, `partitions.py`,
`automation.py`. The logic they call lives in plain modules outside `defs/`."""

import warnings

from dagster import BetaWarning, PreviewWarning

# Two features Dagster marks beta and preview, chosen on purpose (docs/DESIGN.md §7): the sensors' conditions read the
# store, so they run in the code location (`use_user_code_server`), and the shard check is per partition. Said once
# there, not at the top of every process that loads the definitions (the start command printed each three times).
warnings.filterwarnings("ignore", r"Parameter `use_user_code_server` of initializer", BetaWarning)
warnings.filterwarnings("ignore", r"Specifying a partitions_def on an AssetCheckSpec", PreviewWarning)
# Dagster's own Pipes session calls a preview method of the message reader it is given: every training run's log
# opened with it, though the drafter asset calls nothing in preview (`defs/drafter/launch.py`).
warnings.filterwarnings("ignore", r"Function `PipesMessageReader.expected_writer_count`", PreviewWarning)
