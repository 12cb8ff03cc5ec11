"""The data assets follow their inputs: `responses` … `vocab_map` run when they are due (never materialized, or
made from other settings or inputs: `defs/provenance.py`), once every input is current and has passed its
blocking checks (the daemon's `pipeline` sensor evaluates this, in the code location).

The roots, `prompts` and `target_model`, are never started by the daemon for being missing: a person
starts the graph by materializing them, or with `python -m eagle3_assets.start`, whose conditions (`door`) make
what is missing. Once made, they are made
again when what they read changed (`defs/provenance.py: root_condition`).
"""

from __future__ import annotations

from dagster import AutomationCondition

from eagle3_assets.defs.due import follows, inputs_current
from eagle3_assets.defs.provenance import StartDoor
from eagle3_assets.project import Project


def data_condition(project: Project, door: StartDoor | None = None) -> AutomationCondition:
    ready = inputs_current(project) & AutomationCondition.all_deps_blocking_checks_passed()
    return follows(project, ready, door).with_label(
        "due, with every input current and its blocking checks passed"
    )
