"""A change of release makes every other family's eval due, never the eval it was promoted on (issue 52, item 1),
and the start command decides the release again once they are served beside it, then stops.

The reverted first try of item 1 made the promoting eval due by its own release: the start command stopped after the
first release with `not made, each waiting on an input not current or not checked sound: drafter_eval: made from other
inputs: input release: none -> <sha>`, with one family too, and every later start did the same.

The start command runs here on the graph's drafter end: the real `drafter_release` and the real conditions, with the
trainer and the vLLM eval stood in for by assets that write what theirs write (an export; a report of it served beside
the release, and the eval's record as `drafter_eval` writes it). Serving in vLLM is tested in
`test_drafter_eval_beside.py` and, through the start command, in `test_demo_quality.py`; here it would cost minutes.
"""

from __future__ import annotations

from collections.abc import Sequence

from dagster import AssetCheckKey, AssetRecordsFilter, Definitions, MaterializeResult, asset

from eagle3_assets.defs.drafter.assets import (
    DRAFTER_RELEASE,
    RELEASE_CHECK,
    drafter_key,
    drafter_release_asset,
    eval_key,
)
from eagle3_assets.defs.drafter.automation import drafter_eval_condition, drafter_release_condition
from eagle3_assets.defs.provenance import Staleness, StartDoor, materialized
from eagle3_assets.drafter.eval_report import EVAL_REPORT_FILE
from eagle3_assets.drafter.release import EVALUATED_SHA256, RELEASED, export_digest, release_digest
from eagle3_assets.release_record import RELEASE_RECORD
from eagle3_assets.families import FamilySpec, family_spec
from eagle3_assets.project import Project
from eagle3_assets.start import GraphStart
from eagle3_assets.storage import ArtifactStore

from .conftest import tiny_settings
from .helpers import gpu_instance
from .test_drafter_release import report_json, write_export


class Served:
    """Each family's export (its weights' scale) and the figures it serves at, beside whichever drafter."""

    def __init__(self, figures: dict[str, tuple[float, float]]):
        self.figures = figures
        self.scales = {f: float(i + 1) for i, f in enumerate(figures)}

    def figures_of(self, store: ArtifactStore, digest: str) -> tuple[float, float]:
        return next(self.figures[f] for f in self.figures if export_digest(store.child(family_spec(f).root)) == digest)


def stand_ins(project: Project, served: Served, family: FamilySpec) -> list:
    """The family's drafter (an export of its scale) and its eval (a report of it served beside the release, recorded
    as `drafter_eval` records it: `defs/drafter/assets.py`)."""
    out = project.store.child(family.root)

    @asset(key=drafter_key(family))
    def trained() -> MaterializeResult:
        want = Staleness(project).expected(family.drafter_asset)
        write_export(out, served.scales[family.name])
        return MaterializeResult(**materialized(project, want))

    @asset(key=eval_key(family), deps=[drafter_key(family)])
    def evaluated() -> MaterializeResult:
        want = Staleness(project).expected(family.eval_asset)
        digest, released = export_digest(out), release_digest(project.store)
        beside = {}
        if released is not None:
            figures = served.figures_of(project.store, released)
            beside = {"beside": {RELEASED: report_json(*figures, export_sha256=released)}}
        out.write_json(EVAL_REPORT_FILE, report_json(*served.figures[family.name], export_sha256=digest, **beside))
        return MaterializeResult(**materialized(project, want, extra={EVALUATED_SHA256: digest}))

    return [trained, evaluated]


def definitions(served: Served):
    def build(project: Project, door: StartDoor) -> Definitions:
        families = project.settings.drafters
        assets = [
            a.with_attributes(automation_condition=drafter_eval_condition(project, door))
            for f in families
            for a in stand_ins(project, served, family_spec(f))
        ]
        release = drafter_release_asset(families).with_attributes(
            automation_condition=drafter_release_condition(project, door)
        )
        return Definitions(assets=[*assets, release], resources={"project": project})

    return build


def start(instance, project: Project, served: Served) -> tuple[bool, list[str]]:
    lines: list[str] = []
    ok = GraphStart(instance, project, build=definitions(served), log=lines.append).run()
    return ok, [line.split(" in ")[0] for line in lines if not line.endswith(": starting")][1:]


def release_events(instance) -> list[dict]:
    records = instance.fetch_materializations(AssetRecordsFilter(asset_key=DRAFTER_RELEASE), limit=10).records
    return [
        {k: v.value for k, v in r.event_log_entry.asset_materialization.metadata.items() if k in ("promoted", "family")}
        for r in reversed(records)
    ]


def check_passed(instance) -> bool:
    gate = AssetCheckKey(DRAFTER_RELEASE, RELEASE_CHECK)
    return instance.event_log_storage.get_latest_asset_check_execution_by_key([gate])[gate].status.value == "SUCCEEDED"


def project_of(tmp_path, families: Sequence[str]) -> Project:
    return Project(tiny_settings(drafters=list(families)), ArtifactStore(tmp_path / "store"))


def test_one_family_releases_its_first_drafter_and_the_next_start_has_nothing_due(tmp_path):
    project = project_of(tmp_path, ["eagle3"])
    served = Served({"eagle3": (2.5, 2.9)})
    with gpu_instance() as instance:
        ok, lines = start(instance, project, served)
        assert ok, lines
        assert lines == [
            "drafter: to run (never materialized)", "drafter: ok",
            "drafter_eval: to run (never materialized)", "drafter_eval: ok",
            "drafter_release: to run (never materialized)", "drafter_release: ok",
        ]  # fmt: skip
        assert release_digest(project.store) == export_digest(project.store)
        # Its own promotion leaves the eval it was promoted on current: served beside nothing, as the record says.
        assert Staleness(project).problem("drafter_eval") is None
        assert project.store.read_json(RELEASE_RECORD)["judged"]["release"] == "none"
        again, lines = start(instance, project, served)
        assert (again, lines) == (True, [])
        assert release_events(instance) == [{"promoted": True, "family": "eagle3"}] and check_passed(instance)


def test_two_families_the_other_eval_is_served_beside_the_new_release_then_the_release_is_decided_again(tmp_path):
    project = project_of(tmp_path, ["eagle3", "dflash"])
    served = Served({"eagle3": (2.5, 2.9), "dflash": (2.6, 2.8)})
    with gpu_instance() as instance:
        ok, lines = start(instance, project, served)
        e1 = release_digest(project.store)
        assert ok, lines
        assert e1 == export_digest(project.store)  # EAGLE-3 serves best at k=7
        assert lines == [
            "drafter: to run (never materialized)", "drafter_dflash: to run (never materialized)",
            "drafter,drafter_dflash: ok",
            "drafter_eval: to run (never materialized)", "drafter_eval_dflash: to run (never materialized)",
            "drafter_eval,drafter_eval_dflash: ok",
            "drafter_release: to run (never materialized)", "drafter_release: ok",
            # DFlash was served beside no release: beside E1 now, it is judged against it, every k and bin.
            f"drafter_eval_dflash: to run (made from other inputs: input release: none -> {e1})",
            "drafter_eval_dflash: ok",
            "drafter_release: to run (made from other inputs: input drafter_eval_dflash: "
            + lines[-2].split("input drafter_eval_dflash: ")[1],
            "drafter_release: ok",
        ]  # fmt: skip
        assert release_events(instance) == [
            {"promoted": True, "family": "eagle3"}, {"promoted": False, "family": "eagle3"}
        ]  # fmt: skip
        assert check_passed(instance)  # the release, the best, stays: no regression
        reason = instance.get_latest_materialization_event(DRAFTER_RELEASE).asset_materialization.metadata["reason"]
        assert reason.value == (
            f"the eagle3 export is the release (sha256 {e1}): it stays, released on k=3 2.500, k=7 2.900; the new "
            "export serves at mean acceptance length 2.800 at k=7, the released drafter at 2.900 (same prompts, k and "
            "engine): not promoted, the released drafter stays"
        )
        again, lines = start(instance, project, served)
        assert (again, lines) == (True, [])


def test_on_a_tie_the_release_changes_hands_once_and_the_start_command_ends(tmp_path):
    """The same figures: DFlash served beside E1 is at least as good, so it replaces it; EAGLE-3 served beside D1 is at
    least as good too and takes it back; DFlash's eval was served beside E1 already, so nothing more is due."""
    project = project_of(tmp_path, ["eagle3", "dflash"])
    served = Served({"eagle3": (2.5, 2.9), "dflash": (2.5, 2.9)})
    with gpu_instance() as instance:
        ok, lines = start(instance, project, served)
        assert ok, lines
        assert [line for line in lines if line.endswith(": ok")] == [
            "drafter,drafter_dflash: ok", "drafter_eval,drafter_eval_dflash: ok", "drafter_release: ok",
            "drafter_eval_dflash: ok", "drafter_release: ok", "drafter_eval: ok", "drafter_release: ok",
        ]  # fmt: skip
        assert [e["family"] for e in release_events(instance)] == ["eagle3", "dflash", "eagle3"]
        assert release_digest(project.store) == export_digest(project.store) and check_passed(instance)
        assert Staleness(project).problem("drafter_eval") is None
        assert Staleness(project).problem("drafter_eval_dflash") is None
        assert start(instance, project, served) == (True, [])


def test_a_promotion_on_a_report_its_eval_record_is_not_of_leaves_that_eval_due(tmp_path):
    """The promotion keeps the eval's inputs only when the eval's record is of the report it acted on (one that failed
    after writing its report left the record before it): otherwise that eval is served again beside the release."""
    from dagster import DagsterInstance, materialize

    project = project_of(tmp_path, ["eagle3"])
    store = project.store
    with DagsterInstance.ephemeral() as instance:
        materialized(project, Staleness(project).expected("drafter_eval"), extra={EVALUATED_SHA256: "an-older-export"})
        e1 = write_export(store, 1.0)
        store.write_json(EVAL_REPORT_FILE, report_json(2.5, 2.9, export_sha256=e1))
        release = drafter_release_asset(["eagle3"])
        assert materialize([release], resources={"project": project}, instance=instance).success
        assert release_digest(store) == e1 and store.read_json(RELEASE_RECORD)["judged"] == {}
        assert Staleness(project).problem("drafter_eval") == f"made from other inputs: input release: none -> {e1}"
