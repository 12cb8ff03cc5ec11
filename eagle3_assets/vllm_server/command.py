"""What a `vllm serve` for the target looks like: the engine settings passed through, plus a role's flags.

Roles, because the phases need different flags: `generate` serves completions;
`extract` adds the `extract_hidden_states` speculative method and our hidden-states
KV connector (`connector.py`). `both` has both flag sets: it generates correctly too,
but every request then also writes hidden states (which the generator deletes) and the
hidden-state cache takes KV-cache memory, so a phase = one server is the recommended
setup. An `extract` server records what it extracts in `<storage dir>/eagle3_server.json`
(`protocol.ServerPlan`), so a client can check the layer ids before it writes any shard.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_assets.settings import VllmSettings
from eagle3_assets.target import TargetModel
from eagle3_assets.vllm_server.cores import cpu_build
from eagle3_assets.vllm_server.protocol import ServerPlan

CONNECTOR_MODULE = "eagle3_assets.vllm_server.connector"
CONNECTOR_CLASS = "SampleFileConnector"


# vLLM 0.32's CPU rotary kernel (`RotaryEmbedding.forward_cpu`) rotates a 3-D [tokens, heads, dim] query wrongly once
# it has more than one head, and only MLA passes its query so (DeepSeek-V2/V3, Kimi-K2; its drafter too): every head's
# rotary part, so every attention score, was off (docs/DESIGN.md §6). The op's native torch path is right.
MLA_CPU_COMPILATION: dict[str, Any] = {"custom_ops": ["-rotary_embedding"]}


def compilation_config(target: TargetModel) -> dict[str, Any] | None:
    """The engine's `compilation_config` for `target`: None (vLLM's own) but for an MLA target on the CPU build."""
    return MLA_CPU_COMPILATION if target.config.get("kv_lora_rank") and cpu_build() else None


def speculative_config(layer_ids: Sequence[int]) -> dict[str, Any]:
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }


def kv_transfer_config(storage_dir: str | Path, write_roots: Sequence[str | Path] = ()) -> dict[str, Any]:
    """The connector and where it may write: its storage dir, and sample files under `write_roots` (stores)."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "shared_storage_path": str(storage_dir),
            # Requests name their file; the connector refuses any path outside these roots.
            "allow_custom_save_path": True,
            "write_roots": [str(r) for r in write_roots],
        },
    }


def serve_args(
    target: TargetModel,
    vllm: VllmSettings,
    plan: ServerPlan,
    *,
    host: str,
    port: int,
    storage_dir: str | Path | None = None,
    write_roots: Sequence[str | Path] = (),
) -> list[str]:
    """Arguments after `vllm serve`."""
    args = [
        str(target.path),
        "--host", host,
        "--port", str(port),
        "--tensor-parallel-size", str(vllm.tensor_parallel_size),
        "--dtype", vllm.dtype,
        "--gpu-memory-utilization", str(vllm.gpu_memory_utilization),
        # ~one access-log line per request otherwise: millions over an extraction phase
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if target.trust_remote_code:
        args.append("--trust-remote-code")
    if target.wrapped:
        args.append("--language-model-only")
    if (compilation := compilation_config(target)) is not None:
        args += ["--compilation-config", json.dumps(compilation)]
    if vllm.max_model_len is not None:
        args += ["--max-model-len", str(vllm.max_model_len)]
    if plan.layer_ids:
        if storage_dir is None:
            raise ValueError("an extraction server needs a storage directory")
        args += ["--speculative-config", json.dumps(speculative_config(plan.layer_ids))]
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config(storage_dir, write_roots))]
    return args + list(vllm.extra_args)
