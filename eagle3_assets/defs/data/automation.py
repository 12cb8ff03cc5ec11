"""The data assets follow their inputs: `responses` … `vocab_map` run as soon as what they read has
materialized and passed its blocking checks (the daemon's `pipeline` sensor evaluates this).

The roots, `prompts` and `target_model`, have no condition: a person starts the graph by
materializing them (or with `python -m eagle3_assets.start`), never the daemon by finding them missing.
"""

from __future__ import annotations

from dagster import AutomationCondition


def data_condition() -> AutomationCondition:
    return (AutomationCondition.eager() & AutomationCondition.all_deps_blocking_checks_passed()).with_label(
        "inputs updated and their blocking checks passed"
    )
