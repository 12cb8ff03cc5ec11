"""`release.json`, read and written by one record (`release_record.py`): what it holds, and what a release written
before a field existed reads as."""

import hashlib

from eagle3_assets.drafter.eval_report import ContextBins
from eagle3_assets.drafter.release import other_target, release_digest
from eagle3_assets.release_record import RELEASE_RECORD, ReleasedOn, ReleaseRecord, read_release_record
from eagle3_assets.storage import ArtifactStore

BINS = ContextBins({"0-1024": 8}, {"0-1024": {"k3": 2.5}})


def test_a_record_is_written_as_the_file_holds_it_and_read_back_whole(tmp_path):
    record = ReleaseRecord(
        target="t1", family="dflash", released_on=ReleasedOn({"k3": 2.5, "k7": 2.9}, BINS),
        sets={"traffic": ReleasedOn({"k3": 2.4}, BINS)}, replaced={"k3": 2.1}, reason="beats it", export="file:///e",
        export_sha256="a" * 64, report={"prompts": 8}, judged={"asset": "drafter_eval_dflash"},
        imported={"source": "s", "format": "eagle3", "sha256": "b" * 64},
    )  # fmt: skip
    record.write(tmp_path)
    body = ArtifactStore(tmp_path).read_json("release.json")
    assert body == {
        "target": "t1", "family": "dflash", "acceptance": {"k3": 2.5, "k7": 2.9},
        "prompts_by_context_bin": {"0-1024": 8}, "acceptance_by_context_bin": {"0-1024": {"k3": 2.5}},
        "prompt_sets": {"traffic": {"acceptance": {"k3": 2.4}, "prompts_by_context_bin": {"0-1024": 8},
                                    "acceptance_by_context_bin": {"0-1024": {"k3": 2.5}}}},
        "replaced": {"k3": 2.1}, "reason": "beats it", "export": "file:///e", "export_sha256": "a" * 64,
        "report": {"prompts": 8}, "judged": {"asset": "drafter_eval_dflash"},
        "imported": {"source": "s", "format": "eagle3", "sha256": "b" * 64},
    }  # fmt: skip
    assert ReleaseRecord.from_json(body) == record


def test_a_release_from_before_a_field_existed_reads_as_it_was_released(tmp_path):
    """The oldest releases held their figures alone: EAGLE-3's, for whichever target (the baseline of any), their
    weights named by their digest, nothing per bin or prompt set, trained here."""
    store = ArtifactStore(tmp_path)
    store.write_json(RELEASE_RECORD, {"acceptance": {"k3": 2.0}})
    store.write_bytes("drafter/release/model.safetensors", b"weights")
    record = read_release_record(store)
    assert record == ReleaseRecord(released_on=ReleasedOn({"k3": 2.0}))
    assert (record.family, record.target, record.reason, record.imported) == ("eagle3", None, "no reason recorded", {})
    assert other_target(store, "any-target") is None
    assert release_digest(store) == hashlib.sha256(b"weights").hexdigest()


def test_nothing_released_reads_as_none(tmp_path):
    assert read_release_record(ArtifactStore(tmp_path)) is None
