"""The architecture matrix's figures (BENCHMARKS.md `architectures`), from legs `make bench-arch` ran and kept.

`make bench-arch` runs `eagle3_assets_tests/test_architectures.py` at the bench size (every architecture the CPU
build serves, the same assertions as `make test`) with its stores kept under `benchmarks/out/arch/`, then this
script over each leg. Per architecture it reports:
- served mean acceptance length at k=3 and k=7 (`drafter_eval`'s report), and with the features zeroed;
- the cost of capturing hidden states: the shard's extraction samples/s (vLLM, `extract_hidden_states` and the
  connector writing every sample) against plain prefill of the same rows (`max_tokens` 1, nothing captured) in an
  engine of the same model, dtype and eager mode, timed here: plain ÷ extraction, goal ≤ 1.1;
- stored bytes per token ÷ the format's projection (`SampleSpec.bytes_per_token`: 3H aux + H last + id + mask).

    .venv/bin/python benchmarks/bench_arch.py benchmarks/out/arch/arch-deepseek_v30 ...
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from dagster import AssetKey, AssetRecordsFilter, DagsterInstance

from eagle3_assets.drafter.eval_report import EVAL_REPORT_FILE
from eagle3_assets.project import Project
from eagle3_assets.sample_file import SampleSpec
from eagle3_assets.settings import Settings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel
from eagle3_assets.tokenized import TokenizedSet
from eagle3_assets.vllm_server.command import compilation_config


def plain_prefill_samples_per_s(target: TargetModel, rows: list[list[int]], dtype: str) -> float:
    """Samples/s of a prefill of each row (one token generated, nothing captured), after one warm-up request, in an
    engine started as the pipeline starts one for `target` (text-only for a wrapper, MLA's native rotary)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(target.path), dtype=dtype, enforce_eager=True, max_model_len=1024, seed=0, skip_tokenizer_init=True,
        language_model_only=target.wrapped, compilation_config=compilation_config(target),
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([TokensPrompt(prompt_token_ids=rows[0])], params, use_tqdm=False)
    started = time.perf_counter()
    for row in rows:  # one request at a time, as the extraction backend sends them (`batch_tokens` 1 on CPU)
        llm.generate([TokensPrompt(prompt_token_ids=row)], params, use_tqdm=False)
    return len(rows) / (time.perf_counter() - started)


def leg_figures(leg: Path) -> dict[str, object]:
    settings = Settings.model_validate_json((leg / "eagle3.yaml").read_text())
    project = Project(settings, ArtifactStore(leg / "store"))
    target = project.target()
    report = project.store.read_json(EVAL_REPORT_FILE)
    rows = TokenizedSet.load(project.store)
    with DagsterInstance.from_config(str(leg / "home")) as instance:
        record = instance.fetch_materializations(
            AssetRecordsFilter(asset_key=AssetKey("hidden_states")), limit=1
        ).records[0]
        shard = {k: v.value for k, v in record.event_log_entry.asset_materialization.metadata.items()}
    spec = SampleSpec(target.hidden_size, target.aux_layer_ids, settings.extraction.storage_dtype)
    plain = plain_prefill_samples_per_s(
        target, [rows.row(r)[0].tolist() for r in range(rows.num_rows)], settings.vllm.dtype
    )
    return {
        "architecture": settings.demo.architecture,
        "rows": rows.num_rows,
        "k3": report["mean_acceptance_length_k3"],
        "k7": report["mean_acceptance_length_k7"],
        "k3_features_zeroed": report["mean_acceptance_length_k3_features_zeroed"],
        "k7_features_zeroed": report["mean_acceptance_length_k7_features_zeroed"],
        "extraction_samples_per_s": shard["samples_per_s"],
        "plain_prefill_samples_per_s": round(plain, 2),
        "capture_cost": round(plain / shard["samples_per_s"], 3),
        "bytes_per_token": shard["bytes_per_token"],
        "bytes_over_projection": round(shard["bytes_per_token"] / spec.bytes_per_token, 4),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("legs", nargs="+", type=Path, help="leg directories `make bench-arch` kept")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # The engine core in a process of its own, as in the server that extracted.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    for leg in args.legs:
        print(json.dumps(leg_figures(leg)), flush=True)
