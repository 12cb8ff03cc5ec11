"""What made each artifact: a record beside it in the store, and the record the current settings would make.

Every asset's artifact is tied to exactly what determines its content (docs/DESIGN.md §9):
- the settings fields that determine its content (`artifacts.py`, each asset's `reads`), and nothing else;
- its inputs' versions: each parent's recorded data version, and for the roots (and `traffic_prompts`) the content
  of what they read from outside (the prompt files; the request log; the target's content identity,
  `target_identity`: the sha256 of every file that determines what it computes and how it tokenizes);
- a code revision (its `code` there), raised when a change of code changes what the asset makes.

`Provenance.made_from` hashes those; the record beside the artifact (`_PROVENANCE.json`) keeps the
whole provenance and the artifact's data version (a digest of its content where that is cheap,
`made_from` where it is not), so it survives a lost Dagster instance and names what changed
(`Provenance.changes`). An artifact is current when its record's `made_from` equals what `expected`
computes now from the settings, the outside files and the parents' records.

Partial work is reused only under the provenance it was made with: a shard directory keeps the
record it was extracted under (`claim_dir`), a response part stamps each row, a checkpoint holds the
drafter's provenance in its run fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from eagle3_assets.artifacts import ARTIFACTS, RECORDED_SINCE, RELEASE_DIR
from eagle3_assets.errors import Eagle3Error
from eagle3_assets.file_digests import DIGESTS, FileDigests
from eagle3_assets.release_record import RELEASE_RECORD_FILE, ReleaseRecord
from eagle3_assets.settings import Settings
from eagle3_assets.storage import ArtifactStore, StoreError

RECORD_NAME = "_PROVENANCE.json"
# A record's `extra` entry for work its artifact left undone that the next materialization does (responses' failed
# rows): the artifact is due though made as the settings say, and this is why.
RETRY = "retry"

class ProvenanceError(Eagle3Error, RuntimeError):
    """A provenance record or an input it needs cannot be read; the message names the file."""


def digest(obj: Any) -> str:
    """A short, stable hash of a JSON-able value (keys sorted)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def bytes_digest(*chunks: bytes) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(len(chunk).to_bytes(8, "little"))
        h.update(chunk)
    return h.hexdigest()[:16]


def _field(settings: Settings, path: str) -> Any:
    value: Any = settings
    for part in path.split("."):
        value = getattr(value, part)
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value


def settings_read(asset: str, settings: Settings) -> dict[str, Any]:
    """The settings fields that determine `asset`'s content (`artifacts.py`), by dotted name, with their values; a
    field recorded only since a later version is left out at the value artifacts made before it had (`RECORDED_SINCE`),
    so their records stay current."""
    values = {f: _field(settings, f) for f in ARTIFACTS[asset].reads(settings)}
    return {f: v for f, v in values.items() if f not in RECORDED_SINCE or v != RECORDED_SINCE[f]}


@dataclass(frozen=True)
class Provenance:
    """What an artifact is made from. Equal `made_from` means the same content, by construction."""

    asset: str
    settings: dict[str, Any]
    inputs: dict[str, str]  # input name -> version (a parent's data version, an outside file's digest)
    code: int

    @property
    def made_from(self) -> str:
        return digest(asdict(self))

    def changed_settings(self, now: Provenance) -> dict[str, tuple[Any, Any]]:
        """Each setting whose value differs between this (recorded) provenance and `now`, by dotted name: (then, now),
        `UNSET` where one side does not record it."""
        names = sorted(set(self.settings) | set(now.settings))
        pairs = {name: (self.settings.get(name, UNSET), now.settings.get(name, UNSET)) for name in names}
        return {name: (a, b) for name, (a, b) in pairs.items() if a != b}

    def changes(self, now: Provenance) -> list[str]:
        """What differs between this (recorded) provenance and `now`, one phrase each, settings first."""
        out = [setting_change(name, a, b) for name, (a, b) in self.changed_settings(now).items()]
        for name in sorted(set(self.inputs) | set(now.inputs)):
            a, b = self.inputs.get(name, "none"), now.inputs.get(name, "none")
            if a != b:
                out.append(f"input {name}: {a} -> {b}")
        if self.code != now.code:
            out.append(f"code revision {self.code} -> {now.code}")
        return out


UNSET = object()  # a field one side does not record (at its `RECORDED_SINCE` value, or not read then)


def setting_change(name: str, then: Any, now: Any) -> str:
    """A changed setting as every message says it: "setting shard_size: 20 -> 15"."""
    return f"setting {name}: {_short(then)} -> {_short(now)}"


def _short(value: Any) -> str:
    if value is UNSET:
        return "(unset)"
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class Record:
    """The provenance of an artifact and its data version, as kept beside it."""

    provenance: Provenance
    version: str  # the data version: Dagster's, and what children record as this input
    extra: dict[str, Any] = field(default_factory=dict)  # tokenized: each shard's rows digest

    @property
    def made_from(self) -> str:
        return self.provenance.made_from

    def as_json(self) -> dict[str, Any]:
        return {"made_from": self.made_from, "version": self.version, **asdict(self.provenance), "extra": self.extra}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Record:
        p = Provenance(body["asset"], dict(body["settings"]), dict(body["inputs"]), int(body["code"]))
        return cls(p, str(body["version"]), dict(body.get("extra") or {}))


def record_path(asset: str, partition: str | None = None) -> str:
    base = ARTIFACTS[asset].record_dir
    return f"{base}/{partition}/{RECORD_NAME}" if partition else f"{base}/{RECORD_NAME}"


def read_record(store: ArtifactStore, asset: str, partition: str | None = None) -> Record | None:
    """The record beside the artifact, None when there is none (never made, or made before records were kept)."""
    rel = record_path(asset, partition)
    if not store.exists(rel):
        return None
    try:
        return Record.from_json(store.read_json(rel))
    except (ValueError, KeyError, TypeError):
        return None  # unreadable is as good as absent: the artifact is redone, never trusted


def write_record(store: ArtifactStore, record: Record, partition: str | None = None) -> None:
    store.write_json(record_path(record.provenance.asset, partition), record.as_json())


def mark_replacing(store: ArtifactStore, asset: str, what: str) -> None:
    """Before `asset`'s artifact (`what`, a URL) is replaced in place, ahead of its new record: the old record says so
    (`RETRY`). A kill in between then leaves it due; without the mark, the old record would call the new artifact
    current once the settings the old one was made with came back."""
    record = read_record(store, asset)
    if record is not None and RETRY not in record.extra:
        why = f"{what} was being replaced when its last run ended, before its record: made again"
        write_record(store, Record(record.provenance, record.version, {**record.extra, RETRY: why}))


def judged(record: Record) -> dict[str, Any]:
    """What a promotion keeps of the eval whose report it acts on (`release.json`'s `judged`): the eval, the inputs its
    record was made from but the release, and the release it was served beside (`Inputs.release` matches on them)."""
    inputs = dict(record.provenance.inputs)
    return {"asset": record.provenance.asset, "release": inputs.pop("release", "none"), "inputs": inputs}


# --- the outside inputs -------------------------------------------------------------------------

# The files a model is made of: only these are the target's content (issue 52, item 5). A list of what to leave out
# made every stray file a new target (`nohup.out`, `notes.txt`, `training_args.bin`, `config.json.bak`): every
# response was generated again. The kinds issue 44 found missing from an earlier list of what to keep are kept: new
# tokenizer formats (`tekken.json`, `*.tiktoken`, sentencepiece `*.model`), remote code (`*.py`), every chat template
# (`*.jinja`, `additional_chat_templates/`). Any other file is named (`unknown_target_files`), never counted.
WEIGHT_SUFFIXES = (".safetensors", ".gguf")
WEIGHT_PREFIXES = ("pytorch_model", "model", "consolidated", "adapter_model")  # `.bin`/`.pt`/`.pth` weights
CONTENT_NAMES = frozenset({
    "config.json", "params.json", "tokenizer.json", "tokenizer.model", "tekken.json", "tiktoken.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.json",
})  # fmt: skip
CONTENT_SUFFIXES = ("_config.json", ".index.json", ".tiktoken", ".model", ".jinja", ".py")
CONTENT_DIRS = ("additional_chat_templates",)
# Files known to be no part of the model: left out without a word.
NOT_CONTENT_DIRS = ("original", "__pycache__")  # `original/`: Meta's consolidated copies, loaded by neither engine
NOT_CONTENT_SUFFIXES = (".md", ".pyc", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".pdf")
NOT_CONTENT_PREFIXES = ("LICENSE", "NOTICE", "USE_POLICY")
NOT_CONTENT_NAMES = ("demo_target.json",)  # what the demo's builder says it built with (`demo/target.py`)
IDENTITY_PREFIX = "content-"  # a target's version: its content identity, never a digest of where it lies


def _is_known_other(rel: str) -> bool:
    parts = rel.split("/")
    name = parts[-1]
    if any(p.startswith(".") for p in parts):  # .git/, .cache/ (huggingface_hub's local-dir metadata), .gitattributes
        return True
    if parts[0] in NOT_CONTENT_DIRS or "__pycache__" in parts:
        return True
    return (
        name in NOT_CONTENT_NAMES
        or name.lower().endswith(NOT_CONTENT_SUFFIXES)
        or name.upper().startswith(NOT_CONTENT_PREFIXES)
    )


def _is_content(rel: str) -> bool:
    if _is_known_other(rel):
        return False
    name = rel.rsplit("/", 1)[-1]
    if name in CONTENT_NAMES or name.endswith(CONTENT_SUFFIXES + WEIGHT_SUFFIXES):
        return True
    if name.endswith((".bin", ".pt", ".pth")) and name.startswith(WEIGHT_PREFIXES):
        return True
    return rel.split("/")[0] in CONTENT_DIRS


def _listed(url: str) -> tuple[fsspec.AbstractFileSystem, str, dict[str, dict[str, Any] | None]]:
    """Every file of the model directory at `url`, by its path inside it, with the store's info when it gave one."""
    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    if isinstance(fs, LocalFileSystem):
        # Walked by hand to follow symlinks: a Hugging Face snapshot is a directory of links into `blobs/`.
        found: dict[str, dict[str, Any] | None] = {}
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            dirnames.sort()
            for name in filenames:
                found[os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")] = None
        return fs, root, found
    listed = fs.find(root, detail=True)
    return fs, root, {p[len(root) + 1 :]: info for p, info in listed.items() if p.startswith(root + "/")}


def unknown_target_files(url: str) -> list[str]:
    """The files of the target at `url` that are neither what a model is made of nor known to be no part of it: named
    where the target is validated (`target_model`'s log and metadata), never part of its identity."""
    try:
        found = _listed(url)[2]
    except OSError as e:
        raise ProvenanceError(f"target model {url}: cannot be read: {e}") from None
    return sorted(r for r in found if not _is_content(r) and not _is_known_other(r))


def target_files(url: str, digests: FileDigests | None = None) -> dict[str, str]:
    """Each content file of the target model at `url` (local path or fsspec URL), by its path inside the model
    directory, with the sha256 of its whole bytes (`file_digests.py`: read once, then cached)."""
    digests = digests if digests is not None else DIGESTS
    try:
        fs, root, found = _listed(url)
        rels = sorted(r for r in found if _is_content(r))
        if not rels:
            raise ProvenanceError(f"target model {url}: no model files there")
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:  # hashlib reads without the GIL
            shas = list(pool.map(lambda r: digests.sha256(fs, f"{root}/{r}", found[r]), rels))
    except OSError as e:
        raise ProvenanceError(f"target model {url}: cannot be read: {e}") from None
    return dict(zip(rels, shas, strict=True))


def has_remote_code(url: str, files: Mapping[str, str]) -> bool:
    """Whether the target brings code of its own for transformers to run under `trust_remote_code`: a `*.py` in its
    directory, or an `auto_map` in its config or tokenizer config (code named in another repository)."""
    if any(rel.endswith(".py") for rel in files):
        return True
    fs, root = fsspec.core.url_to_fs(url)
    for name in ("config.json", "tokenizer_config.json"):
        if name in files:
            try:
                body = json.loads(fs.cat_file(f"{root.rstrip('/')}/{name}"))
            except (OSError, ValueError):
                continue
            if isinstance(body, dict) and body.get("auto_map"):
                return True
    return False


def target_identity(url: str, trust_remote_code: bool = False, *, digests: FileDigests | None = None) -> str:
    """The target model's content identity: a digest of the sha256 of each of its content files (`_is_content`:
    weights, configs, generation config, tokenizer files, chat templates, remote code; no other file), by their paths
    inside the model directory, never the directory's own path. The same bytes moved, linked, copied or named as
    `file://` keep it; any changed byte changes it. A 1 TB checkpoint is read whole once (`file_digests.py`; the
    cost per TB in BENCHMARKS.md, `digest`); after that a look stats each file.

    `trust_remote_code` is part of it only when the target has code of its own (`has_remote_code`): then the flag
    decides which code runs (the target's modeling and tokenizer, or transformers' and vLLM's own classes), so its
    outputs and tokens may differ. Without such code the flag changes nothing the target computes: a flip is the
    same target."""
    files = target_files(url, digests)
    parts: dict[str, Any] = {"files": files}
    if has_remote_code(url, files):
        parts["trust_remote_code"] = trust_remote_code
    return IDENTITY_PREFIX + digest(parts)


# --- before targets were known by their bytes (issue 44) -----------------------------------------------------------


def sampled_version(want: Provenance, url: str) -> str:
    """The version a `target_model` record made under `want` held before issue 44: `made_from` of its provenance with
    the sampled identity of the files at `url` (config, generation config and tokenizer files whole; each
    `*.safetensors` file's size, header and three 64 KiB blocks; `.bin`/`.pt`/`.gguf` by size). A release made then
    names its target so; the asset keeps this beside the content identity (its record's `extra`) so that release is
    still recognised as this target's (`drafter/release.py: other_target`), never dropped by the upgrade."""
    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    texts = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "tokenizer.model",
             "tiktoken.model", "vocab.json", "merges.txt", "added_tokens.json")  # fmt: skip
    parts: dict[str, str] = {}
    try:
        for name in sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)):
            path = f"{root}/{name}"
            if name in texts:
                parts[name] = bytes_digest(fs.cat_file(path))
            elif name.endswith(".safetensors"):
                size = fs.size(path)
                head = fs.cat_file(path, 0, min(size, 8))
                start = min(size, 8 + (int.from_bytes(head, "little") if len(head) == 8 else 0))
                span = size - start
                blocks = [
                    fs.cat_file(path, at, min(size, at + (64 << 10)))
                    for at in (start + (span - (64 << 10)) * i // 2 if span > 64 << 10 else start for i in range(3))
                ]
                parts[name] = bytes_digest(str(size).encode(), fs.cat_file(path, 0, start), *blocks)
            elif name.endswith((".bin", ".pt", ".gguf")):
                parts[name] = f"size {fs.size(path)}"
    except OSError as e:
        raise ProvenanceError(f"target model {url}: cannot be read: {e}") from None
    return Provenance(want.asset, want.settings, {**want.inputs, "target files": digest(parts)}, want.code).made_from


# Digests of outside files by what their store says of them (size, mtime or ETag): the daemon looks every tick,
# and a prompt file of gigabytes is read again only when it changed.
_DIGESTS: dict[tuple[str, str], str] = {}


def _stat(fs: fsspec.AbstractFileSystem, path: str) -> str:
    info = fs.info(path)
    return json.dumps([info.get(k) for k in ("size", "mtime", "ETag", "LastModified", "created")], default=str)


def source_digest(url: str | None) -> str:
    """The digest of an outside file's bytes (a prompt file), or 'none' when none is configured."""
    if url is None:
        return "none"
    try:
        fs, path = fsspec.core.url_to_fs(url)
        key = (url, _stat(fs, path))
        if key not in _DIGESTS:
            _DIGESTS[key] = bytes_digest(fs.cat_file(path))
        return _DIGESTS[key]
    except OSError as e:
        raise ProvenanceError(f"{url}: cannot be read: {e}") from None


# --- what the current settings would make -------------------------------------------------------


@dataclass
class Inputs:
    """Where `expected` finds the versions of what it depends on; `outside` digests are computed once."""

    settings: Settings
    store: ArtifactStore
    _outside: dict[str, str] = field(default_factory=dict)

    def outside(self, name: str) -> str:
        if name not in self._outside:
            s = self.settings
            if name == "prompts file":
                self._outside[name] = source_digest(s.prompts)
            elif name == "eval prompts file":
                self._outside[name] = source_digest(s.eval_prompts)
            elif name == "traffic log":
                from eagle3_assets.traffic import log_digest  # it reads records through this module

                self._outside[name] = log_digest(s.traffic.log) if s.traffic is not None else "none"
            elif name == "target files":
                # The demo target is made from its settings alone (`settings_read`).
                self._outside[name] = target_identity(s.target_model, s.trust_remote_code) if s.target_model else "demo"
            else:
                raise KeyError(name)
        return self._outside[name]

    _records: dict[str, Record | None] = field(default_factory=dict)
    _judged: dict[str, Any] = field(default_factory=dict)  # release.json's `judged`, read with the release

    def _record(self, asset: str) -> Record | None:
        # Parents' records are read once per look: the drafter's shards all read tokenized's.
        if asset not in self._records:
            self._records[asset] = read_record(self.store, asset)
        return self._records[asset]

    def parent(self, asset: str) -> str:
        record = self._record(asset)
        return record.version if record is not None else "none"

    def release(self, asset: str, parents: Mapping[str, str]) -> str:
        """Which drafter is released, as `asset` (an eval served beside it, made from `parents`) is judged against:
        its weights' digest (`release.json`'s `export_sha256`; a digest of the record for a release made before it named
        them), as it is once settled; 'none' when nothing is released. A release that is the promotion of this very
        eval (`judged`, the same eval made from the same inputs) is the one that eval was served beside: its own
        promotion never makes it due, only another family's promotion, or another eval's, does."""
        if "release" not in self._outside:
            rel = f"{self.store.settled_rel(RELEASE_DIR)}/{RELEASE_RECORD_FILE}"
            try:
                body = self.store.read_bytes(rel)
                record = ReleaseRecord.from_json(json.loads(body))
                self._outside["release"] = record.export_sha256 or bytes_digest(body)
                self._judged = record.judged
            except StoreError:
                self._outside["release"] = "none"
            except (ValueError, AttributeError, TypeError):
                raise ProvenanceError(f"{self.store.url_of(rel)} is not a release record") from None
        if self._judged.get("asset") == asset and self._judged.get("inputs") == dict(parents):
            return str(self._judged.get("release", "none"))
        return self._outside["release"]

    def shard_rows(self, partition: str) -> str:
        record = self._record("tokenized")
        return str(record.extra.get("shard_rows", {}).get(partition, "none")) if record is not None else "none"


def data_version(want: Provenance) -> str | None:
    """The data version an artifact made under `want` gets when it is not a digest of its own content: for a
    configured target, its content identity. Its record keeps where it was found (`target_model`, a setting), so a
    move re-validates it, but its version, the one every child and the release record, is the bytes alone: a
    target moved, linked or named as `file://` is the same target (issue 44). None: `made_from` stands for it."""
    return want.inputs.get("target files") if want.asset == "target_model" else None


def expected(asset: str, inputs: Inputs, partition: str | None = None) -> Provenance:
    """The provenance `asset` (or one shard) would have if made now from the current settings and inputs."""
    s = inputs.settings
    artifact = ARTIFACTS[asset]
    versions: dict[str, str] = {p: inputs.parent(p) for p in artifact.parents_under(s)}
    if asset == "prompts" and s.prompts is not None:
        versions["prompts file"] = inputs.outside("prompts file")
        versions["eval prompts file"] = inputs.outside("eval prompts file")
    elif asset == "prompts" and s.eval_prompts is not None:  # the demo's prompts, held-out ones of one's own
        versions["eval prompts file"] = inputs.outside("eval prompts file")
    elif asset == "target_model" and not s.is_demo:
        versions["target files"] = inputs.outside("target files")
    elif asset == "traffic_prompts":
        versions["traffic log"] = inputs.outside("traffic log")
    elif artifact.beside_release and (release := inputs.release(asset, versions)) != "none":
        # Nothing released: no input, so stores made before releases were inputs stay current.
        versions["release"] = release
    elif asset == "hidden_states":
        if partition is None:
            raise ValueError("hidden_states provenance is per shard")
        versions["rows"] = inputs.shard_rows(partition)
    return Provenance(asset, settings_read(asset, s), versions, artifact.code)


def current_problem(store: ArtifactStore, want: Provenance, partition: str | None = None) -> str | None:
    """Why the artifact in the store is not what `want` would make, or None when it is."""
    record = read_record(store, want.asset, partition)
    if record is None:
        return "no provenance record (never made, or made before provenance was kept)"
    if record.made_from == want.made_from:
        return record.extra.get(RETRY)
    changes = record.provenance.changes(want)
    return "made from other inputs: " + "; ".join(changes) if changes else "made from other inputs"


def claim_dir(store: ArtifactStore, rel_dir: str, want: Provenance, *, keep: Callable[[str], bool] = lambda _: False) -> list[str]:
    """Make `rel_dir` hold only work made under `want`: when its record differs (or is missing while files are
    there), every file in it goes first; then the record is written. Returns the changes that caused a wipe
    (empty when the directory was current or empty). `keep(name)` spares files that are not the work."""
    rel = f"{rel_dir}/{RECORD_NAME}"
    record = None
    if store.exists(rel):
        try:
            record = Record.from_json(store.read_json(rel))
        except (ValueError, KeyError, TypeError):
            record = None
    if record is not None and record.made_from == want.made_from:
        return []
    names = [n for n in store.listdir(rel_dir) if n != RECORD_NAME and not keep(n)]
    causes: list[str] = []
    if names:
        if record is not None:
            causes = record.provenance.changes(want)
        else:  # what made it is unknown: never trusted, and the cost said
            size = sum(store.sizes(rel_dir).values())
            causes = [
                f"made before provenance was kept (no record of what made it): its {len(names)} file(s), "
                f"{size:,} bytes, are made again"
            ]
        for name in names:
            store.remove(f"{rel_dir}/{name}", recursive=True)
    store.write_json(rel, Record(want, want.made_from).as_json())
    return causes or ([] if not names else ["made from other inputs"])
