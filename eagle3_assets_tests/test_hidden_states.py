"""Hidden-state extraction: HF backend, per-sample file format, shard extraction, integrity check.

Everything runs a real tiny Llama (4 layers, hidden 64, head_dim 32) built in-process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_assets.hidden_states import ExtractionRequest, ExtractorConfigError, extract_in_order, open_extractor
from eagle3_assets.hidden_states.hf_extractor import HFExtractor, plan_batches
from eagle3_assets.hidden_states.integrity import check_shard, check_shards
from eagle3_assets.hidden_states.shard import (
    ExtractionProgress,
    InsufficientSpaceError,
    RowTooLongError,
    ShardExtractionError,
    StoreNotWritableError,
    extract_shard,
)
from eagle3_assets.sample_file import (
    FORMAT,
    SampleSpec,
    decode_hidden,
    manifest_path,
    encode_hidden,
    pack_sample,
    parse_header,
    sample_buffers,
    sample_path,
    sample_problem,
    shard_dir,
    tensor_problem,
    written_sample_problem,
)
from eagle3_assets.target import TargetModel, TargetModelError
from eagle3_assets.settings import ExtractionSettings, Settings
from eagle3_assets.shards import Shard, plan_shards
from eagle3_assets.storage import TMP_MARK, ArtifactStore
from eagle3_assets.tokenized import TokenizedSet

REPO = Path(__file__).resolve().parents[1]
AUX = [1, 2, 3]
H = 64
CONTEXT = 64
MODEL_NAME = "tiny-llama"
LENGTHS = [5, 17, 3, 30, 9, 12, 1, 25, 8, 14, 20, 6]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=H,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=CONTEXT,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def extractor(model_dir: Path) -> Iterator[HFExtractor]:
    ex = HFExtractor(TargetModel.read(model_dir, aux_layer_ids=AUX), batch_tokens=64, device="cpu")
    yield ex
    ex.close()


def make_tokenized(lengths: list[int], seed: int = 0) -> TokenizedSet:
    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        ids = rng.integers(0, 256, size=n).tolist()
        mask = [0] * (n // 3) + [1] * (n - n // 3)  # prompt, then assistant tokens
        rows.append((ids, mask))
    return TokenizedSet.from_rows(rows, list(range(len(lengths))))


def settings(**kw) -> ExtractionSettings:
    return ExtractionSettings(**{"batch_tokens": 64, **kw})


def memory_store() -> ArtifactStore:
    return ArtifactStore(f"memory://hs-test-{uuid.uuid4().hex[:8]}")


def sample_names(shard: Shard) -> set[str]:
    return {f"{r}.safetensors" for r in shard.rows}


def all_names_on_disk(store: ArtifactStore, shard: Shard) -> list[str]:
    """Every name in the shard directory, temporaries included (listdir hides them)."""
    return sorted(os.listdir(store.local_path(shard_dir(shard.key))))


def check(store: ArtifactStore, tok: TokenizedSet, shard: Shard, **kw):
    return check_shard(store, tok, shard, hidden_size=H, aux_layer_ids=AUX, dtype="bfloat16", **kw)


# -- batching and the HF backend ------------------------------------------------


def test_plan_batches_packs_longest_first_under_the_padded_budget():
    assert plan_batches([5, 17, 3, 30, 9], 40) == [[3], [1, 4], [0, 2]]
    assert plan_batches([5, 17, 3, 30, 9], 1) == [[3], [1], [4], [0], [2]]
    assert plan_batches([4, 4, 4], 12) == [[0, 1, 2]]
    assert plan_batches([50], 10) == [[0]]  # longer than the budget: alone


def test_batched_extraction_equals_batch_one_and_hf_hidden_states(model_dir: Path, extractor: HFExtractor):
    tok = make_tokenized(LENGTHS)
    requests = [ExtractionRequest(row=r, input_ids=tok.row(r)[0]) for r in range(tok.num_rows)]
    assert any(len(b) > 1 for b in plan_batches(LENGTHS, extractor.batch_tokens))  # really batched
    batched = extract_in_order(extractor, requests)
    one_by_one = HFExtractor(TargetModel.read(model_dir, aux_layer_ids=AUX), batch_tokens=1, device="cpu")
    single = extract_in_order(one_by_one, requests)

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    last_layer_out = {}
    model.model.layers[-1].register_forward_hook(
        lambda m, i, o: last_layer_out.update(h=o[0] if isinstance(o, tuple) else o)
    )
    for req, b, s in zip(requests, batched, single, strict=True):
        T = len(req.input_ids)
        assert b.row == s.row == req.row
        assert b.aux_hidden_states.shape == (T, 3 * H) and b.last_hidden_state.shape == (T, H)
        torch.testing.assert_close(b.aux_hidden_states, s.aux_hidden_states, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.last_hidden_state, s.last_hidden_state, atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            hs = model(torch.from_numpy(req.input_ids.astype(np.int64))[None], output_hidden_states=True).hidden_states
            post_norm = model.model.norm(last_layer_out["h"])[0]
        # aux = "input of layer i" = HF hidden_states[i], concatenated in ascending id order
        torch.testing.assert_close(s.aux_hidden_states, torch.cat([hs[i][0] for i in AUX], -1), atol=1e-6, rtol=1e-6)
        # last = the last layer's output where it enters the final norm (pre-norm), as vLLM extracts it
        torch.testing.assert_close(s.last_hidden_state, last_layer_out["h"][0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(model.model.norm(s.last_hidden_state), post_norm, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(s.last_hidden_state, post_norm, atol=1e-3)  # not post-norm
    assert extractor.last_hidden_state_norm == "pre_norm"
    assert (extractor.hidden_size, extractor.num_layers, extractor.max_context) == (H, 4, CONTEXT)


def test_aux_ids_outside_the_model_are_refused_naming_the_setting(model_dir: Path):
    with pytest.raises(TargetModelError) as e:
        TargetModel.read(model_dir, aux_layer_ids=[1, 2, 4])
    assert str(e.value) == (
        "aux_layer_ids: layer id(s) [4] outside the model, which has 4 layers (valid 'input of layer i' ids: 1..3)"
    )
    with pytest.raises(TargetModelError, match=r"aux_layer_ids: \[2, 2, 3\] appear twice"):
        TargetModel.read(model_dir, aux_layer_ids=[2, 2, 3])


def test_open_extractor_follows_the_settings(model_dir: Path):
    settings_ = Settings(aux_layer_ids=[3, 1, 2], extraction=settings(batch_tokens=99))
    ex = open_extractor(settings_, TargetModel.read(model_dir, aux_layer_ids=settings_.aux_layer_ids), device="cpu")
    assert (ex.backend, ex.aux_layer_ids, ex.batch_tokens) == ("hf", (1, 2, 3), 99)
    with pytest.raises(ExtractorConfigError, match=r"extraction.backend: 'tpu' is not one of 'hf', 'vllm'"):
        open_extractor(settings_.model_copy(update={"extraction": settings_.extraction.model_copy(update={"backend": "tpu"})}),
                       TargetModel.read(model_dir, aux_layer_ids=[1, 2, 3]))  # fmt: skip


# -- the per-sample file ----------------------------------------------------------


@pytest.mark.parametrize("where", ["file", "memory"])
def test_sample_file_has_exactly_the_spec(where: str, tmp_path: Path, extractor: HFExtractor):
    store = ArtifactStore(tmp_path / "store") if where == "file" else memory_store()
    tok = make_tokenized(LENGTHS)
    shard = Shard(4, 8)
    result = extract_shard(store, tok, shard, extractor, settings(), model_name=MODEL_NAME)
    assert (result.rows_total, result.rows_computed, result.rows_skipped) == (4, 4, 0)
    assert store.listdir(shard_dir(shard.key)) == sorted(sample_names(shard) | {"_SUCCESS.json"})
    assert sample_path(shard.key, 6) == "hidden_states/rows_4-8/6.safetensors"

    requests = [ExtractionRequest(r, tok.row(r)[0]) for r in shard.rows]
    expected = {s.row: s for s in extract_in_order(extractor, requests)}
    for row in shard.rows:
        T = tok.row_length(row)
        local = tmp_path / "copy.safetensors"
        local.write_bytes(store.read_bytes(sample_path(shard.key, row)))
        with safe_open(str(local), framework="pt") as f:  # how the drafter's loader reads it
            assert sorted(f.keys()) == ["aux_hidden_states", "input_ids", "last_hidden_state", "loss_mask"]
            assert f.metadata() == {
                "format": "eagle3-hidden-states/2",
                "aux_layer_ids": "[1, 2, 3]",
                "last_hidden_state_norm": "pre_norm",
                "model": MODEL_NAME,
                "dtype": "bfloat16",
                "hidden_size": "64",
                "row": str(row),
                "backend": "hf",
            }
            t = {k: f.get_tensor(k) for k in f.keys()}
        assert (t["input_ids"].dtype, list(t["input_ids"].shape)) == (torch.int32, [T])
        assert (t["loss_mask"].dtype, list(t["loss_mask"].shape)) == (torch.uint8, [T])
        assert (t["aux_hidden_states"].dtype, list(t["aux_hidden_states"].shape)) == (torch.bfloat16, [T, 3 * H])
        assert (t["last_hidden_state"].dtype, list(t["last_hidden_state"].shape)) == (torch.bfloat16, [T, H])
        assert t["input_ids"].tolist() == tok.row(row)[0].tolist()
        assert t["loss_mask"].tolist() == tok.row(row)[1].tolist()
        assert torch.equal(t["aux_hidden_states"], expected[row].aux_hidden_states.to(torch.bfloat16))
        assert torch.equal(t["last_hidden_state"], expected[row].last_hidden_state.to(torch.bfloat16))

    manifest = store.read_json(manifest_path(shard.key))
    assert {k: manifest[k] for k in manifest if k not in ("created", "seconds")} == {
        "format": FORMAT,
        "shard": "rows_4-8",
        "row_start": 4,
        "row_end": 8,
        "rows": 4,
        "tokens": 9 + 12 + 1 + 25,
        "bytes": sum(store.size(sample_path(shard.key, r)) for r in shard.rows),
        "aux_layer_ids": AUX,
        "hidden_size": H,
        "dtype": "bfloat16",
        "last_hidden_state_norm": "pre_norm",
        "model": MODEL_NAME,
        "backend": "hf",
        "rows_computed": 4,
        "rows_skipped": 0,
    }
    report = check(store, tok, shard, model=MODEL_NAME, last_hidden_state_norm="pre_norm")
    assert report.ok, report.summary()
    assert (report.rows_checked, report.rows_ok, report.tokens, report.bytes) == (4, 4, 47, manifest["bytes"])

    # Nothing left to do: nothing recomputed, the manifest of the run that made the files is kept.
    again = extract_shard(store, tok, shard, extractor, settings(), model_name=MODEL_NAME)
    assert (again.rows_computed, again.rows_skipped, again.bytes_written) == (0, 4, 0)
    assert store.read_json(manifest_path(shard.key)) == manifest


def test_float32_storage_roundtrips_exact_values(tmp_path: Path, extractor: HFExtractor):
    store = ArtifactStore(tmp_path)
    tok = make_tokenized(LENGTHS)
    shard = Shard(0, 3)
    extract_shard(store, tok, shard, extractor, settings(storage_dtype="float32"), model_name=MODEL_NAME)
    t = st_load(store.read_bytes(sample_path(shard.key, 1)))
    want = extract_in_order(extractor, [ExtractionRequest(1, tok.row(1)[0])])[0]
    assert t["aux_hidden_states"].dtype == torch.float32
    torch.testing.assert_close(t["aux_hidden_states"], want.aux_hidden_states, atol=1e-5, rtol=1e-5)
    assert check_shard(store, tok, shard, hidden_size=H, aux_layer_ids=AUX, dtype="float32").ok


def test_float8_storage_halves_the_hidden_bytes_and_decodes_within_e4m3_precision(
    tmp_path: Path, extractor: HFExtractor
):
    store = ArtifactStore(tmp_path)
    tok = make_tokenized(LENGTHS)
    shard = Shard(0, 4)
    result = extract_shard(store, tok, shard, extractor, settings(storage_dtype="float8_e4m3fn"), model_name=MODEL_NAME)
    report = check_shard(store, tok, shard, hidden_size=H, aux_layer_ids=AUX, dtype="float8_e4m3fn", model=MODEL_NAME)
    assert report.ok, report.summary()
    assert store.read_json(manifest_path(shard.key))["dtype"] == "float8_e4m3fn"
    fp8, bf16 = (SampleSpec(H, tuple(AUX), d, MODEL_NAME) for d in ("float8_e4m3fn", "bfloat16"))
    assert (fp8.hidden_bytes_per_token, bf16.hidden_bytes_per_token) == (4 * H + 8, 4 * H * 2)  # + two f32 scales
    tokens = sum(LENGTHS[:4])
    assert abs(result.bytes - sum(L * fp8.bytes_per_token + fp8.file_overhead(L) for L in LENGTHS[:4])) <= 4 * 8
    assert abs(result.bytes - fp8.projected_bytes(tokens, 4)) <= 4 * 16  # the preflight's figure

    t = st_load(store.read_bytes(sample_path(shard.key, 1)))
    assert t["aux_hidden_states"].dtype == torch.float8_e4m3fn and t["aux_hidden_states_scale"].shape == (LENGTHS[1],)
    want = extract_in_order(extractor, [ExtractionRequest(1, tok.row(1)[0])])[0]
    for name, ref in (("aux_hidden_states", want.aux_hidden_states), ("last_hidden_state", want.last_hidden_state)):
        got = decode_hidden(t, name).float()
        # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself (bf16 decoding adds 1/256), or
        # within the smallest normal step of its row's scale near zero.
        scale = t[name + "_scale"][:, None]
        assert bool(((got - ref).abs() <= ref.abs() * (1 / 16 + 1 / 256) + scale * 2**-6).all()), name
    # A check for another storage dtype names the difference.
    other = check_shard(store, tok, shard, hidden_size=H, aux_layer_ids=AUX, dtype="bfloat16")
    assert other.problems["rows_0-4/0.safetensors"].startswith("tensors [")
    # Bad scales are caught like bad values.
    t["aux_hidden_states_scale"][2] = float("nan")
    header, _ = parse_header(store.read_bytes(sample_path(shard.key, 1)))
    ids, mask = tok.row(1)
    data = st_save(t, metadata=header["__metadata__"])
    assert sample_problem(data, row=1, input_ids=ids, loss_mask=mask, spec=fp8) == (
        "aux_hidden_states_scale has non-finite or non-positive scales"
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float32"])
def test_the_streamed_file_is_a_safetensors_file_with_aligned_tensors(dtype: str):
    T = 7  # odd: the uint8 mask must not push a wider tensor off its alignment
    spec = SampleSpec(H, tuple(AUX), dtype, MODEL_NAME, "pre_norm")
    ids, mask = np.arange(T, dtype=np.int32) + 5, np.array([0, 0, 1, 1, 1, 0, 1], np.uint8)
    hidden = encode_hidden(torch.randn(T, 3 * H), torch.randn(T, H), dtype)
    buffers = sample_buffers(row=4, input_ids=ids, loss_mask=mask, hidden=hidden, spec=spec, backend="vllm")
    data = pack_sample(row=4, input_ids=ids, loss_mask=mask, hidden=hidden, spec=spec, backend="vllm")
    assert data == b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
    # safetensors reads it: the same tensors, bit for bit, and the metadata the format names.
    tensors = st_load(data)
    assert sorted(tensors) == sorted(["input_ids", "loss_mask", *hidden])
    assert tensors["input_ids"].tolist() == ids.tolist() and tensors["loss_mask"].tolist() == mask.tolist()
    for name, t in hidden.items():
        assert tensors[name].dtype == t.dtype and torch.equal(tensors[name].view(torch.uint8), t.view(torch.uint8)), name
    header, problem = parse_header(data)
    assert problem is None and header["__metadata__"] == {
        "format": FORMAT, "aux_layer_ids": "[1, 2, 3]", "last_hidden_state_norm": "pre_norm", "model": MODEL_NAME,
        "dtype": dtype, "hidden_size": str(H), "row": "4", "backend": "vllm",
    }  # fmt: skip
    start = 8 + int.from_bytes(data[:8], "little")
    assert start % 8 == 0
    for name, t in tensors.items():
        assert header[name]["data_offsets"][0] % t.element_size() == 0, name
    with safe_open_bytes(data) as f:  # the memory-mapped reader too
        assert torch.equal(f.get_tensor("input_ids"), tensors["input_ids"])
    assert sample_problem(data, row=4, input_ids=ids, loss_mask=mask, spec=spec) is None


@contextmanager
def safe_open_bytes(data: bytes) -> Iterator:
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as tmp:
        tmp.write(data)
        tmp.flush()
        with safe_open(tmp.name, framework="pt") as f:
            yield f


def test_a_file_written_by_the_server_is_verified_from_its_header_ids_and_mask(tmp_path: Path):
    T = 9
    spec = SampleSpec(H, tuple(AUX), "bfloat16", MODEL_NAME, "pre_norm")
    ids, mask = np.arange(T, dtype=np.int32), np.ones(T, np.uint8)
    data = pack_sample(
        row=2, input_ids=ids, loss_mask=mask, hidden=encode_hidden(torch.randn(T, 3 * H), torch.randn(T, H), "bfloat16"),
        spec=spec, backend="vllm",
    )  # fmt: skip
    path = tmp_path / "2.safetensors"

    def problem(content: bytes, **row) -> str | None:
        path.write_bytes(content)
        got, size = written_sample_problem(str(path), **({"row": 2, "input_ids": ids, "loss_mask": mask} | row), spec=spec)
        assert size == len(content)
        return got

    assert problem(data) is None
    assert problem(data[:-3]) == f"truncated ({len(data) - 3} bytes, header describes {len(data)})"
    assert problem(data, row=3) == "metadata row is '2', expected '3'"
    other = ids.copy()
    other[[1, 4]] = 200
    assert problem(data, input_ids=other) == "input_ids differ from tokenized row 2 at 2 of 9 positions"
    assert problem(data, loss_mask=np.zeros(T, np.uint8)) == "loss_mask differs from tokenized row 2 at 9 of 9 positions"
    assert problem(data, input_ids=ids[:8], loss_mask=mask[:8]) == (
        "holds 9 tokens x 64 in bfloat16, expected 8 x 64 in bfloat16 (tokenized row 2)"
    )
    assert problem(b"\x01") == "truncated, not a safetensors file"


def test_tensor_problem_finds_non_finite_and_all_zero_values_whatever_their_sum():
    x = torch.randn(5, 8).to(torch.bfloat16)
    assert tensor_problem("x", x) is None
    assert tensor_problem("x", torch.tensor([[1.0, -1.0]])) is None  # sums to zero, not all zero
    assert tensor_problem("x", torch.zeros(3, 4)) == "x all zero"
    nan, inf = x.clone(), x.clone()
    nan[1, 2], inf[0, 0], inf[4, 7] = float("nan"), float("inf"), float("-inf")
    assert tensor_problem("x", nan) == "x has 1 non-finite values"
    assert tensor_problem("x", inf) == "x has 2 non-finite values"


def test_the_connector_writes_no_sample_whose_values_it_finds_bad():
    from eagle3_assets.vllm_server.connector import _flags_problem, _value_flags

    aux, last = torch.randn(4, 3 * H), torch.randn(4, H)
    assert _flags_problem(_value_flags(aux, last)) is None
    aux[2, 5] = float("nan")
    assert _flags_problem(_value_flags(aux, last)) == "aux_hidden_states has non-finite values"
    assert _flags_problem(_value_flags(torch.randn(4, 3 * H), torch.zeros(4, H))) == "last_hidden_state all zero"


# -- progress -----------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class TickingExtractor:
    """The real HF backend; each sample it returns advances a test clock by one second."""

    def __init__(self, inner: HFExtractor, clock: FakeClock):
        self._inner, self._clock = inner, clock

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def extract(self, requests, spec=None):
        for sample in self._inner.extract(requests, spec):
            self._clock.t += 1.0
            yield sample


def test_progress_reported_at_the_interval_and_at_the_end(tmp_path: Path, extractor: HFExtractor):
    store = ArtifactStore(tmp_path)
    tok = make_tokenized(LENGTHS)
    shard = Shard(0, 7)  # lengths 5, 17, 3, 30, 9, 12, 1
    clock = FakeClock()
    seen: list[ExtractionProgress] = []
    extract_shard(
        store,
        tok,
        shard,
        TickingExtractor(extractor, clock),
        settings(progress_interval_s=2.5),
        model_name=MODEL_NAME,
        on_progress=seen.append,
        free_bytes=10**12,
        clock=clock,
    )
    assert [(p.samples_done, p.seconds, p.final) for p in seen] == [(3, 3.0, False), (6, 6.0, False), (7, 7.0, True)]
    first = seen[0]
    done_rows = [3, 1, 5]  # longest first: 30, 17, 12 tokens
    done_bytes = sum(store.size(sample_path(shard.key, r)) for r in done_rows)
    assert first.samples_per_s == 1.0
    assert first.tokens_done == 59 and first.tokens_per_s == 59 / 3
    assert first.bytes_written == done_bytes
    assert first.bytes_per_sample == done_bytes / 3
    assert first.bytes_per_token == done_bytes / 59
    assert first.eta_s == (77 - 59) / (59 / 3)
    assert first.projected_bytes_all_shards == round(tok.num_tokens * done_bytes / 59)
    assert first.free_bytes == 10**12
    last = seen[-1]
    all_bytes = sum(store.size(sample_path(shard.key, r)) for r in shard.rows)
    assert (last.samples_done, last.samples_total, last.tokens_done, last.eta_s) == (7, 7, 77, 0.0)
    assert last.bytes_written == all_bytes
    assert last.as_metadata() == {
        "samples_done": 7,
        "samples_total": 7,
        "samples_skipped": 0,
        "tokens_done": 77,
        "tokens_total": 77,
        "seconds": 7.0,
        "samples_per_s": 1.0,
        "tokens_per_s": 11.0,
        "bytes_written": all_bytes,
        "bytes_per_sample": all_bytes / 7,
        "bytes_per_token": all_bytes / 77,
        "eta_s": 0.0,
        "projected_bytes_all_shards": round(tok.num_tokens * all_bytes / 77),
        "free_bytes": 10**12,
        "final": 1,
    }
    assert all(isinstance(v, int | float) for v in last.as_metadata().values())


# -- crash and resume -------------------------------------------------------------------

CRASH_SCRIPT = """
import sys, time
import torch
torch.set_num_threads(1)
from eagle3_assets.hidden_states.shard import extract_shard
from eagle3_assets.hidden_states.hf_extractor import HFExtractor
from eagle3_assets.settings import ExtractionSettings, Settings
from eagle3_assets.shards import Shard
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel
from eagle3_assets.tokenized import TokenizedSet


class SlowExtractor(HFExtractor):
    # slowed so the test can kill it mid-shard
    def extract(self, requests, spec=None):
        for sample in super().extract(requests, spec):
            time.sleep(0.05)
            yield sample


root, model_dir, start, end = sys.argv[1:]
store = ArtifactStore(root)
extractor = SlowExtractor(TargetModel.read(model_dir, aux_layer_ids=[1, 2, 3]), batch_tokens=1, device="cpu")
extract_shard(store, TokenizedSet.load(store), Shard(int(start), int(end)), extractor,
              ExtractionSettings(batch_tokens=1), model_name="tiny-llama")
"""


def test_killed_extraction_resumes_without_recomputing_finished_rows(
    tmp_path: Path, model_dir: Path, extractor: HFExtractor
):
    store = ArtifactStore(tmp_path / "store")
    lengths = [4 + (7 * i) % 17 for i in range(80)]
    tok = make_tokenized(lengths, seed=1)
    tok.save(store)
    shard = Shard(10, 70)
    script = tmp_path / "extract_one_shard.py"
    script.write_text(CRASH_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), store.url, str(model_dir), "10", "70"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    shard_path = tmp_path / "store" / shard_dir(shard.key)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if shard_path.exists() and len(list(shard_path.glob("*.safetensors"))) >= 5:
                break
            time.sleep(0.01)
        assert proc.poll() is None, f"extraction ended before it could be killed:\n{proc.stdout.read().decode()}"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not store.exists(manifest_path(shard.key))

    # What a writer killed mid-write leaves behind (a kill may or may not have hit one).
    (shard_path / f".12.safetensors{TMP_MARK}deadbeef0000").write_bytes(b"\0" * 100)
    after_kill = check(store, tok, shard, require_manifest=False)
    valid_after_kill = {
        int(name.split(".")[0]): (shard_path / name).read_bytes()
        for name in os.listdir(shard_path)
        if name.endswith(".safetensors") and not name.startswith(".")
        and f"{shard.key}/{name}" not in after_kill.problems
    }
    assert 5 <= after_kill.rows_ok == len(valid_after_kill) < len(shard)

    result = extract_shard(store, tok, shard, extractor, settings(), model_name=MODEL_NAME)
    assert result.rows_skipped == len(valid_after_kill)
    assert result.rows_computed == len(shard) - len(valid_after_kill)
    assert result.temporaries_removed >= 1
    assert all_names_on_disk(store, shard) == sorted(sample_names(shard) | {"_SUCCESS.json"})
    for row, data in valid_after_kill.items():  # finished rows were kept, not redone
        assert store.read_bytes(sample_path(shard.key, row)) == data
    assert check(store, tok, shard, model=MODEL_NAME).ok


# -- corruption and repair ---------------------------------------------------------------


def rewrite_tensor(store: ArtifactStore, rel: str, name: str, change) -> None:
    data = store.read_bytes(rel)
    n = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8 : 8 + n])["__metadata__"]
    tensors = st_load(data)
    change(tensors[name])
    store.write_bytes(rel, st_save(tensors, metadata=metadata))


@pytest.mark.parametrize("where", ["file", "memory"])
def test_check_names_corrupt_files_and_rerun_repairs_exactly_those(where: str, tmp_path: Path, extractor: HFExtractor):
    store = ArtifactStore(tmp_path / "store") if where == "file" else memory_store()
    tok = make_tokenized(LENGTHS)
    shard = Shard(0, 6)
    extract_shard(store, tok, shard, extractor, settings(), model_name=MODEL_NAME)
    assert check(store, tok, shard).ok

    truncated_from = store.read_bytes(sample_path(shard.key, 1))
    store.write_bytes(sample_path(shard.key, 1), truncated_from[:-100])
    rewrite_tensor(store, sample_path(shard.key, 3), "last_hidden_state", lambda t: t.view(-1)[:12].fill_(float("nan")))
    rewrite_tensor(store, sample_path(shard.key, 4), "aux_hidden_states", lambda t: t.zero_())

    truncation = f"truncated ({len(truncated_from) - 100} bytes, header describes {len(truncated_from)})"
    report = check(store, tok, shard)
    assert not report.ok
    assert report.problems == {
        "rows_0-6/1.safetensors": truncation,
        "rows_0-6/3.safetensors": "last_hidden_state has 12 non-finite values",
        "rows_0-6/4.safetensors": "aux_hidden_states all zero",
    }
    assert report.rows_ok == 3
    assert "rows_0-6: 3 of 6 rows bad, 3 problems" in report.summary()

    manifest_seen_during_rerun = []
    result = extract_shard(
        store,
        tok,
        shard,
        extractor,
        settings(progress_interval_s=1e-9),
        model_name=MODEL_NAME,
        on_progress=lambda p: manifest_seen_during_rerun.append((p.final, store.exists(manifest_path(shard.key)))),
    )
    assert (result.rows_computed, result.rows_skipped) == (3, 3)
    assert result.repaired == {
        1: truncation,
        3: "last_hidden_state has 12 non-finite values",
        4: "aux_hidden_states all zero",
    }
    assert manifest_seen_during_rerun[0] == (False, False)  # the stale _SUCCESS.json went first
    assert check(store, tok, shard).ok
    repaired, original = st_load(store.read_bytes(sample_path(shard.key, 1))), st_load(truncated_from)
    for name in original:  # same values (batched differently this time: bf16 rounding may differ by an ulp)
        torch.testing.assert_close(repaired[name].float(), original[name].float(), atol=2e-2, rtol=1e-2)


def test_files_of_another_model_or_tokenization_are_redone(extractor: HFExtractor):
    store = memory_store()
    tok = make_tokenized(LENGTHS)
    shard = Shard(0, 4)
    extract_shard(store, tok, shard, extractor, settings(), model_name="other-model")
    result = extract_shard(store, tok, shard, extractor, settings(), model_name=MODEL_NAME)
    assert result.rows_computed == 4
    assert result.repaired[0] == "metadata model is 'other-model', expected 'tiny-llama'"

    changed = TokenizedSet(tok.input_ids.copy(), tok.loss_mask, tok.offsets, tok.row_ids)
    changed.input_ids[5 + 2 : 5 + 5] = (changed.input_ids[5 + 2 : 5 + 5] + 1) % 256  # three tokens of row 1
    result = extract_shard(store, changed, shard, extractor, settings(), model_name=MODEL_NAME)
    assert (result.rows_computed, result.repaired) == (1, {1: "input_ids differ from tokenized row 1 at 3 of 17 positions"})
    assert check(store, changed, shard, model=MODEL_NAME).ok


def test_check_reports_missing_rows_manifest_and_strays(tmp_path: Path, extractor: HFExtractor):
    store = ArtifactStore(tmp_path)
    tok = make_tokenized(LENGTHS)
    shards = plan_shards(tok.num_rows, 5)  # rows_0-5, rows_5-10, rows_10-12
    for s in shards[:2]:
        extract_shard(store, tok, s, extractor, settings(), model_name=MODEL_NAME)
    store.remove(sample_path(shards[1].key, 7))
    store.write_bytes(f"{shard_dir(shards[1].key)}/99.safetensors", b"x")
    reports = check_shards(store, tok, shards, hidden_size=H, aux_layer_ids=AUX, dtype="bfloat16")
    assert [r.shard for r in reports] == ["rows_0-5", "rows_5-10", "rows_10-12"]
    assert reports[0].ok
    assert reports[1].problems == {
        "rows_5-10/7.safetensors": "missing",
        "rows_5-10/99.safetensors": "unexpected file (not a row of this shard)",
    }
    assert reports[2].problems == {
        "rows_10-12/10.safetensors": "missing",
        "rows_10-12/11.safetensors": "missing",
        "rows_10-12/_SUCCESS.json": "missing (the shard never completed)",
    }
    # a shard extracted with other aux ids does not pass for this configuration
    other = check_shard(store, tok, shards[0], hidden_size=H, aux_layer_ids=[1, 2], dtype="bfloat16")
    assert other.problems["rows_0-5/0.safetensors"] == "metadata aux_layer_ids is [1, 2, 3], expected [1, 2]"
    assert reports[0].as_metadata() == {
        "rows_expected": 5,
        "rows_ok": 5,
        "problems": 0,
        "tokens": sum(LENGTHS[:5]),
        "bytes": reports[0].bytes,
    }


def test_invalid_sample_from_the_backend_is_not_written(tmp_path: Path, extractor: HFExtractor):
    class NaNOnRow2:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def extract(self, requests, spec=None):
            for s in self._inner.extract(requests, spec):
                if s.row == 2:
                    s = dataclasses.replace(s, last_hidden_state=s.last_hidden_state.clone())
                    s.last_hidden_state[0, :5] = float("inf")
                yield s

    store = ArtifactStore(tmp_path)
    tok = make_tokenized(LENGTHS)
    with pytest.raises(ShardExtractionError) as e:
        extract_shard(store, tok, Shard(0, 4), NaNOnRow2(extractor), settings(), model_name=MODEL_NAME)
    assert str(e.value) == (
        "shard rows_0-4 row 2: the hf backend produced an invalid sample, not written: "
        "last_hidden_state has 5 non-finite values"
    )
    assert not store.exists(sample_path(Shard(0, 4), 2))
    assert not store.exists(manifest_path(Shard(0, 4)))


# -- preflight ----------------------------------------------------------------------------------


def test_disk_preflight_refuses_with_both_figures_and_projects_what_is_written(tmp_path: Path, extractor: HFExtractor):
    store = ArtifactStore(tmp_path)
    tok = make_tokenized(LENGTHS)
    shard = Shard(0, 4)  # 5 + 17 + 3 + 30 = 55 tokens
    spec = SampleSpec(H, tuple(AUX), "bfloat16", MODEL_NAME)
    per_token, header = spec.bytes_per_token, spec.file_overhead(55 // 4)
    assert per_token == 4 * H * 2 + 4 + 1  # hidden states, input id, loss mask
    projected = 55 * per_token + 4 * header
    needed = projected + math.ceil(projected * Fraction(1, 20))
    with pytest.raises(InsufficientSpaceError) as e:
        extract_shard(store, tok, shard, extractor, settings(disk_margin=0.05), model_name=MODEL_NAME, free_bytes=1000)
    assert str(e.value) == (
        f"shard rows_0-4: not enough free space on {store.url_of('hidden_states/rows_0-4')}: "
        f"needs 0.00 GB ({needed:,} bytes: 55 remaining tokens x {per_token} bytes (4 x hidden 64 in bfloat16, ids, "
        f"mask) + 4 files x {header} header bytes = {projected:,} bytes, plus 5% margin), free 0.00 GB (1,000 bytes)"
    )
    assert store.listdir(shard_dir(shard.key)) == []

    # What the projection says is what lands on disk, headers included (within the few bytes a row
    # number's digits change): with margin 0 a disk of exactly that size is enough.
    result = extract_shard(store, tok, shard, extractor, settings(disk_margin=0.0), model_name=MODEL_NAME, free_bytes=projected)
    written = sum(store.size(sample_path(shard.key, r)) for r in shard.rows)
    assert result.bytes_written == written and abs(written - projected) <= 4 * 8, (written, projected)

    # Only what is left to compute counts: with 3 rows valid, 30 tokens in 1 file remain.
    store.remove(sample_path(shard.key, 3))
    left = 30 * per_token + spec.file_overhead(30)
    with pytest.raises(InsufficientSpaceError, match=rf"needs 0\.00 GB \({left:,} bytes: 30 remaining tokens"):
        extract_shard(store, tok, shard, extractor, settings(disk_margin=0.0), model_name=MODEL_NAME, free_bytes=left - 1)
    result = extract_shard(store, tok, shard, extractor, settings(disk_margin=0.0), model_name=MODEL_NAME, free_bytes=left)
    assert (result.rows_skipped, result.rows_computed) == (3, 1)
    assert result.notes == [f"disk preflight ok: needs 0.00 GB ({left:,} bytes), free 0.00 GB ({left:,} bytes)"]


def test_disk_preflight_skipped_with_a_note_on_memory_store(extractor: HFExtractor):
    store = memory_store()
    tok = make_tokenized(LENGTHS)
    result = extract_shard(store, tok, Shard(0, 2), extractor, settings(), model_name=MODEL_NAME)
    spec = SampleSpec(H, tuple(AUX), "bfloat16", MODEL_NAME)
    projected = spec.projected_bytes(22, 2)
    needed = projected + math.ceil(projected * Fraction(1, 20))
    assert result.notes == [
        f"disk preflight skipped: free space is unknown on {store.url_of('hidden_states/rows_0-2')} "
        f"(needs 0.00 GB ({needed:,} bytes: 22 remaining tokens x {spec.bytes_per_token} bytes (4 x hidden 64 in "
        f"bfloat16, ids, mask) + 2 files x {spec.file_overhead(11)} header bytes = {projected:,} bytes, plus 5% margin))"
    ]
    assert check(store, tok, Shard(0, 2)).ok


# -- refusals that name the shard and row --------------------------------------------------------


def test_row_longer_than_the_context_is_refused_before_any_work(tmp_path: Path, extractor: HFExtractor):
    store = ArtifactStore(tmp_path)
    tok = make_tokenized([5, CONTEXT + 6, 3, CONTEXT + 1])
    with pytest.raises(RowTooLongError) as e:
        extract_shard(store, tok, Shard(0, 4), extractor, settings(), model_name=MODEL_NAME)
    assert str(e.value) == (
        "shard rows_0-4: row 1 has 70 tokens, more than the model context of 64 tokens "
        "(2 rows of the shard are too long: [1, 3])"
    )
    assert not store.exists("hidden_states")


@contextmanager
def read_only(path: Path) -> Iterator[None]:
    """`path` made read-only; as root (who ignores permission bits) also drop to `nobody` meanwhile."""
    path.chmod(0o555)
    try:
        if os.geteuid() == 0:
            try:
                os.setegid(65534)
                os.seteuid(65534)
            except PermissionError:
                os.setegid(0)
                pytest.skip("root here cannot drop privileges, and root ignores a read-only directory")
            try:
                yield
            finally:
                os.seteuid(0)
                os.setegid(0)
        else:
            yield
    finally:
        path.chmod(0o755)


def test_read_only_store_is_refused_and_nothing_written_is_lost(extractor: HFExtractor):
    base = Path(tempfile.mkdtemp(prefix="eagle3-ro-"))  # outside pytest's 0700 tmp dir: `nobody` can reach it
    try:
        base.chmod(0o755)
        store = ArtifactStore(base / "store")
        tok = make_tokenized(LENGTHS)
        shard = Shard(0, 4)
        extract_shard(store, tok, shard, extractor, settings(), model_name=MODEL_NAME)
        store.remove(sample_path(shard.key, 2))  # work to do on the rerun
        before = {n: store.read_bytes(f"{shard_dir(shard.key)}/{n}") for n in store.listdir(shard_dir(shard.key))}
        with read_only(base / "store" / shard_dir(shard.key)):
            with pytest.raises(StoreNotWritableError) as e:
                extract_shard(store, tok, shard, extractor, settings(), model_name=MODEL_NAME)
        assert str(e.value).startswith(f"shard rows_0-4: cannot write to file://{base}/store/hidden_states/rows_0-4: ")
        assert "Permission denied" in str(e.value)
        after = {n: store.read_bytes(f"{shard_dir(shard.key)}/{n}") for n in store.listdir(shard_dir(shard.key))}
        assert after == before and "_SUCCESS.json" in after
        assert all_names_on_disk(store, shard) == sorted(before)  # no probe or temporary left
    finally:
        shutil.rmtree(base)


def test_shard_past_the_tokenized_set_is_refused(extractor: HFExtractor):
    with pytest.raises(ShardExtractionError, match=r"^shard rows_10-20 ends past the tokenized set of 12 rows$"):
        extract_shard(memory_store(), make_tokenized(LENGTHS), Shard(10, 20), extractor, settings(), model_name="m")


def test_a_stale_shard_key_is_a_refusal_that_says_to_re_tokenize():
    from eagle3_assets.errors import Refusal
    from eagle3_assets.hidden_states.integrity import StaleShardKeyError

    with pytest.raises(StaleShardKeyError, match=r"shard rows_0-400 ends past the tokenized set of 3 rows: .* re-materialize tokenized") as e:
        check(memory_store(), make_tokenized([5, 6, 7]), Shard.parse("rows_0-400"))
    assert isinstance(e.value, Refusal)
