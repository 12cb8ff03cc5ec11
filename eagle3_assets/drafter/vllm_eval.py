"""Serve an exported drafter with its target in vLLM, generate greedily, read the acceptance.

`generate(...)` builds an `LLM` in this process: vLLM starts worker processes, so the
calling script needs an `if __name__ == "__main__":` guard (docs/DESIGN.md §6).
`generate_in_subprocess(...)` runs the same in a fresh interpreter
(`python -m eagle3_assets.drafter.vllm_eval request.json result.json`), which is what a
Dagster asset or a test should call; `generate_runs_in_subprocess(...)` runs several
settings there one after another, paying for vLLM's import once (~14 s on CPU).

Acceptance (vLLM's spec-decode counters): mean acceptance length = 1 + accepted /
drafts (tokens produced per target forward that drafted), and per position i the share
of drafts whose i-th draft token was accepted. `tokens_per_forward` also counts the
forwards that drafted nothing (the prefill, and every step n-gram lookup finds no match).

`zero_fc=True` serves a copy of the export with `fc.weight` zeroed: the drafter then
sees no target features at all, the baseline that shows what the features buy.
`method="ngram"` drafts by prompt lookup instead (vLLM's `ngram` proposer: the k tokens
that followed the latest earlier occurrence of the longest suffix n-gram, n between
`prompt_lookup_min` and `prompt_lookup_max`), the floor that costs no training.

`groups` (one label per prompt) decodes each group with its own `generate` call on the
same engine and reads the counters per group (`by_group`): acceptance per serving mode and context bin.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from eagle3_assets.crash_points import crash_point
from eagle3_assets.drafter.errors import EvaluationError
from eagle3_assets.families import EAGLE3
from eagle3_assets.processes import signal_group, terminate_with_parent
from eagle3_assets.vllm_server.cores import engine_claim, pin_to_claim

_SPEC_PREFIX = "vllm:spec_decode_"


@dataclass
class GenerationResult:
    outputs: list[list[int]]  # generated token ids, one list per prompt
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    by_group: dict[str, GenerationResult] = field(default_factory=dict)  # label -> that group's prompts alone
    seconds: float = 0.0  # wall time of the generate calls alone (no engine start)
    # Per prompt, per generated token: its logprob minus the runner-up's (asked with `margins=True`), how near a tie
    # each greedy choice was.
    margins: list[list[float]] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens generated per target forward, steps without a draft included: every forward yields one token plus
        the drafts it accepted. A method that drafts only sometimes (ngram) is compared on this, not on the mean
        acceptance length, which counts the steps that drafted."""
        served = sum(map(len, self.outputs))
        return served / (served - self.num_accepted_tokens) if served > self.num_accepted_tokens else 1.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second of decoding (prefill included, engine start not): the figure a speedup over
        plain decoding is the ratio of, measured in the same engine process."""
        return sum(map(len, self.outputs)) / self.seconds if self.seconds else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position]

    def to_json(self) -> dict:
        return {
            **{k: v for k, v in asdict(self).items() if k != "by_group"},
            "by_group": {label: g.to_json() for label, g in self.by_group.items()},
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_per_position": self.acceptance_per_position,
            "tokens_per_forward": self.tokens_per_forward,
            "decode_tokens_per_s": self.decode_tokens_per_s,
        }

    @classmethod
    def from_json(cls, d: dict) -> GenerationResult:
        return cls(
            outputs=d["outputs"],
            num_drafts=d["num_drafts"],
            num_draft_tokens=d["num_draft_tokens"],
            num_accepted_tokens=d["num_accepted_tokens"],
            accepted_per_position=d["accepted_per_position"],
            by_group={label: cls.from_json(g) for label, g in d.get("by_group", {}).items()},
            seconds=float(d.get("seconds", 0.0)),
            margins=d.get("margins", []),
        )

    @classmethod
    def merged(cls, parts: Sequence[GenerationResult]) -> GenerationResult:
        """The counters of several groups' runs added (they are counts), their outputs one after another: the
        figures of the groups' prompts together."""
        per_position = [sum(p.accepted_per_position[i] for p in parts if i < len(p.accepted_per_position))
                        for i in range(max((len(p.accepted_per_position) for p in parts), default=0))]  # fmt: skip
        return cls(
            outputs=[o for p in parts for o in p.outputs],
            num_drafts=sum(p.num_drafts for p in parts),
            num_draft_tokens=sum(p.num_draft_tokens for p in parts),
            num_accepted_tokens=sum(p.num_accepted_tokens for p in parts),
            accepted_per_position=per_position,
            seconds=sum(p.seconds for p in parts),
            margins=[m for p in parts for m in p.margins],
        )

    @classmethod
    def from_counters(cls, outputs: list[list[int]], counters: dict[str, object]) -> GenerationResult:
        return cls(
            outputs=outputs,
            num_drafts=int(counters.get("num_drafts", 0)),  # type: ignore[arg-type]
            num_draft_tokens=int(counters.get("num_draft_tokens", 0)),  # type: ignore[arg-type]
            num_accepted_tokens=int(counters.get("num_accepted_tokens", 0)),  # type: ignore[arg-type]
            accepted_per_position=[int(x) for x in counters.get("num_accepted_tokens_per_pos", [])],  # type: ignore[union-attr]
        )


def top_two_gap(logprobs: dict) -> float:
    """The chosen token's logprob minus the runner-up's, from one position's top-2 logprobs (vLLM's `Logprob`s)."""
    ranked = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    return ranked[0] - ranked[1] if len(ranked) > 1 else float("inf")


def engine_version() -> str:
    """"vllm <version>", read without importing vLLM (seconds): what a report says it was served with."""
    try:
        return f"vllm {importlib.metadata.version('vllm')}"
    except importlib.metadata.PackageNotFoundError:
        return "vllm (not installed)"


def zero_fc_copy(export_dir: str | Path, out_dir: str | Path) -> Path:
    """A copy of an export whose `fc.weight` is all zeros (the "features zeroed" drafter)."""
    # Here, not at the top: the engine's interpreter imports this module before it pins itself to its cores, and
    # torch loaded before the pin computes several times slower on them (`main`).
    import torch
    from safetensors.torch import load_file, save_file

    export_dir, out_dir = Path(export_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for other in export_dir.iterdir():  # config.json, and a block drafter's mask_embedding.pt
        if other.name != "model.safetensors" and other.is_file():
            shutil.copy(other, out_dir / other.name)
    tensors = load_file(str(export_dir / "model.safetensors"))
    if "fc.weight" not in tensors:
        raise EvaluationError(f"{export_dir}/model.safetensors has no fc.weight to zero: not a drafter export")
    tensors["fc.weight"] = torch.zeros_like(tensors["fc.weight"])
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _counter_delta(after: dict[str, object], before: dict[str, object]) -> dict[str, object]:
    """`after - before` per counter: counters live in a process-wide registry, so an earlier
    engine in the same process may have left counts behind."""
    out: dict[str, object] = {}
    for key, value in after.items():
        prev = before.get(key)
        if isinstance(value, list):
            out[key] = [a - b for a, b in zip(value, prev or [0] * len(value))]  # type: ignore[arg-type]
        else:
            out[key] = value - (prev or 0)  # type: ignore[operator]
    return out


def _spec_counters(metrics: list) -> dict[str, object]:
    """vLLM's spec-decode counters by short name, summed over engines/labels."""
    out: dict[str, object] = {}
    for m in metrics:
        if not m.name.startswith(_SPEC_PREFIX):
            continue
        key = m.name[len(_SPEC_PREFIX) :]
        if hasattr(m, "values"):
            prev = out.get(key, [0] * len(m.values))
            out[key] = [a + b for a, b in zip(prev, m.values)]  # type: ignore[arg-type]
        elif hasattr(m, "value"):
            out[key] = out.get(key, 0) + m.value  # type: ignore[operator]
    return out


def text_only_engine(target_wrapped: bool) -> dict[str, Any]:
    """The `vllm.LLM` arguments that serve a vision-language wrapper's text model (Kimi-K2.5) with the engine core in
    this process, this process made ready for them; none for a plain text model.

    vLLM 0.32 imports numba (so llvmlite) with Kimi-K2.5's model module, in the front end, before the core's CPU worker
    scans every loaded module for Triton kernels to override; the scan trips on an llvmlite object (`'_lib_fn_wrapper'
    object has no attribute 'get'`, docs/DESIGN.md §6). So numba is hidden from this process (vLLM then imports none:
    its fused image processor is for images, never served here), and the engine gets no tokenizer, whose init would
    load the image processor: prompts go in and answers come out as token ids, and the caller passes what ends a
    completion (`target.py: stop_token_ids`, where the generation backends stop) as `stop_token_ids`.
    Without this the core needs a process of its own, two more interpreters importing vLLM for every engine."""
    if not target_wrapped:
        return {}
    sys.modules.setdefault("numba", None)  # an import of numba now fails, and vLLM's probe for it says False
    return {"language_model_only": True, "skip_tokenizer_init": True}


def generate(
    target_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    draft_dir: str | Path | None = None,
    num_speculative_tokens: int = 3,
    max_tokens: int = 32,
    zero_fc: bool = False,
    method: str = EAGLE3.vllm_method,
    prompt_lookup_min: int | None = None,
    prompt_lookup_max: int | None = None,
    groups: Sequence[str] | None = None,
    dtype: str = "float32",
    max_model_len: int | None = None,
    ignore_eos: bool = True,
    enforce_eager: bool = True,
    margins: bool = False,
    language_model_only: bool = False,
    compilation_config: dict[str, Any] | None = None,
    stop_token_ids: Sequence[int] = (),
) -> GenerationResult:
    """Greedy generation from token-id prompts, with the EAGLE-3 drafter when `draft_dir` is given, or
    n-gram prompt lookup with `method="ngram"`. `language_model_only`: the target is a vision-language wrapper,
    served text-only (`text_only_engine`); `stop_token_ids`: what ends a completion, beside vLLM's own."""
    engine_args = text_only_engine(language_model_only)  # before vLLM resolves the model's class
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory(prefix="drafter-zero-fc-") as tmp:
        spec = None
        if method == "ngram":
            spec = {
                "method": "ngram",
                "num_speculative_tokens": num_speculative_tokens,
                "prompt_lookup_min": prompt_lookup_min,
                "prompt_lookup_max": prompt_lookup_max,
            }
        elif draft_dir is not None:
            model_dir = zero_fc_copy(draft_dir, tmp) if zero_fc else Path(draft_dir)
            spec = {"method": method, "model": str(model_dir), "num_speculative_tokens": num_speculative_tokens}
        llm = LLM(
            model=str(target_dir),
            speculative_config=spec,
            dtype=dtype,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            compilation_config=compilation_config,
            disable_log_stats=False,
            seed=0,
            **engine_args,
        )
        try:
            params = SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, logprobs=2 if margins else None,
                stop_token_ids=None if ignore_eos else list(stop_token_ids) or None,  # vLLM stops at these even with ignore_eos
            )
            token_prompts = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts]
            labels = list(groups) if groups is not None else [""] * len(prompts)
            if len(labels) != len(prompts):
                raise ValueError(f"{len(labels)} group labels for {len(prompts)} prompts")
            outputs, gaps, by_group = _generate_by_group(llm, token_prompts, labels, params, margins)
        finally:
            # Stop the engine's worker process now, so the next engine in this process gets the CPU and memory.
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
    whole = GenerationResult.merged(list(by_group.values()))
    return replace(
        whole, outputs=outputs, margins=gaps if margins else [], by_group=by_group if groups is not None else {}
    )


def _generate_by_group(
    llm: Any, prompts: list[Any], labels: list[str], params: Any, margins: bool
) -> tuple[list[list[int]], list[list[float]], dict[str, GenerationResult]]:
    """Each group of prompts generated apart, so its acceptance is read from the engine's counters around it alone:
    every prompt's output ids and top-two logprob gaps (`margins`), and each group's result."""
    outputs: list[list[int]] = [[] for _ in prompts]
    gaps: list[list[float]] = [[] for _ in prompts]
    by_group: dict[str, GenerationResult] = {}
    for label in dict.fromkeys(labels):
        members = [i for i, g in enumerate(labels) if g == label]
        before = _spec_counters(llm.get_metrics())
        started = time.perf_counter()
        outs = llm.generate([prompts[i] for i in members], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        counters = _counter_delta(_spec_counters(llm.get_metrics()), before)
        by_group[label] = GenerationResult.from_counters([list(o.outputs[0].token_ids) for o in outs], counters)
        by_group[label].seconds = seconds
        for i, o in zip(members, outs, strict=True):
            outputs[i] = list(o.outputs[0].token_ids)
            gaps[i] = [top_two_gap(lp) for lp in o.outputs[0].logprobs or []] if margins else []
    return outputs, gaps, by_group


def generate_in_subprocess(
    target_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    timeout_s: float = 900,
    env: dict[str, str] | None = None,
    cpu_cores: int | None = None,
    **kwargs,
) -> GenerationResult:
    """`generate(...)` in a fresh interpreter; raises RuntimeError with the tail of its output on failure."""
    return generate_runs_in_subprocess(target_dir, prompts, [kwargs], timeout_s=timeout_s, env=env, cpu_cores=cpu_cores)[0]


def generate_runs_in_subprocess(
    target_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    runs: Sequence[dict[str, Any]],
    *,
    common: dict[str, Any] | None = None,
    timeout_s: float = 1800,
    env: dict[str, str] | None = None,
    on_result: Callable[[int, GenerationResult], None] | None = None,
    cpu_cores: int | None = None,
) -> list[GenerationResult]:
    """One `generate(target_dir, prompts, **common, **run)` per run, in order, all in one fresh interpreter;
    `on_result(i, result)` as each run finishes. Past `timeout_s` the interpreter and its workers are killed.
    On the CPU build the engine runs on cores of its own (`cpu_cores` of them, as `vllm.cpu_cores`)."""
    with tempfile.TemporaryDirectory(prefix="drafter-vllm-") as tmp:
        request = Path(tmp) / "request.json"
        result = Path(tmp) / "result.jsonl"
        output = Path(tmp) / "output.log"
        runs = [{k: str(v) if isinstance(v, Path) else v for k, v in {**(common or {}), **run}.items()} for run in runs]
        token_prompts = [list(map(int, p)) for p in prompts]
        request.write_text(json.dumps({"target_dir": str(target_dir), "prompts": token_prompts, "runs": runs}))
        result.touch()
        run_env = {**os.environ, **(env or {})}
        # A small KV cache: these machines are shared, and eval prompts are short.
        run_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # The engine core in this interpreter, not a process of its own: the interpreter is already one, and each
        # pass starts an engine; a core process per pass would start Python and import vLLM again. Same outputs
        # and counters (benchmarks/bench_eval_engines.py: 2.2x faster over three passes on two CPU cores).
        run_env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        results: list[GenerationResult] = []

        def collect() -> None:
            for line in result.read_text().splitlines()[len(results) :]:
                results.append(GenerationResult.from_json(json.loads(line)))
                if on_result is not None:
                    on_result(len(results) - 1, results[-1])

        cores = engine_claim(cpu_cores, environ=run_env)
        with output.open("w") as out:
            try:
                # The interpreter pins itself (so the engine) to the claimed cores, and holds the claim too:
                # it outlives a caller killed outright.
                proc = subprocess.Popen(
                    [sys.executable, "-m", "eagle3_assets.drafter.vllm_eval", str(request), str(result)],
                    stdout=out, stderr=subprocess.STDOUT, env=run_env | (cores.env() if cores else {}),
                    start_new_session=True, pass_fds=(cores.fd,) if cores else (),
                    preexec_fn=terminate_with_parent(),  # a drafter_eval run killed outright takes its engine with it
                )  # fmt: skip
            except BaseException:
                if cores is not None:
                    cores.release()
                raise
            deadline = time.monotonic() + timeout_s
            try:
                while proc.poll() is None:
                    collect()
                    if time.monotonic() > deadline:
                        raise EvaluationError(
                            f"drafter_eval: vLLM generation timed out after {timeout_s:.0f}s with {len(results)} of {len(runs)} "
                            f"runs done:\n{output.read_text()[-4000:]}"
                        )
                    time.sleep(0.5)
            finally:
                if proc.poll() is None:
                    signal_group(proc, signal.SIGKILL)
                    proc.wait()
                if cores is not None:
                    cores.release()
        collect()
        if proc.returncode != 0 or len(results) != len(runs):
            raise EvaluationError(
                f"drafter_eval: vLLM generation of {len(runs)} run(s) over {len(token_prompts)} prompts failed "
                f"(exit {proc.returncode}; target {target_dir}); its output ends:\n{output.read_text()[-4000:]}"
            )
        return results


def main(argv: Sequence[str]) -> int:
    # Before torch, vLLM or anything else numeric loads (this module imports none at the top), and before vLLM starts
    # its engine's processes, which inherit the cores: torch loaded first and pinned after ran drafter_eval's passes
    # 2.6x slower on a one-core claim (a DeepSeek-V3 miniature, plain + k=3: 54 s against 21 s).
    pin_to_claim()
    crash_point("vllm_eval:started")
    request_path, result_path = argv
    req = json.loads(Path(request_path).read_text())
    with Path(result_path).open("a") as out:
        for run in req["runs"]:
            # One line per run as it finishes: the caller reports each pass without waiting for the last.
            out.write(json.dumps(generate(req["target_dir"], req["prompts"], **run).to_json()) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
