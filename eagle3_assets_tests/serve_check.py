"""Serve a drafter export beside its target in vLLM and record what vLLM's loader loaded into the drafter.

`python serve_check.py request.json result.json`: request {"target", "draft", "prompts" (token ids), "max_tokens"};
result {"draft_class", "unloaded" (the drafter's parameters no checkpoint tensor filled), "mean_acceptance_length"}.
vLLM's loader raises on a checkpoint name it has no parameter for, so "unloaded" empty but for the embedding
(shared from the target) means every weight vLLM builds came from the export and none of the export was left over.
The loader is wrapped, not replaced: vLLM loads exactly as it would, and this script notes what it returned.
Each load is recorded in `result.json.loads.jsonl` by the process that loads: this one, run with
VLLM_ENABLE_V1_MULTIPROCESSING=0 (a vision-language wrapper's too, as drafter_eval runs it: `text_only_engine`).
"""

from __future__ import annotations

import json
import os
import sys

from vllm.model_executor.models import utils

LOADS_ENV = "SERVE_CHECK_LOADS"
_load_weights = utils.AutoWeightsLoader.load_weights


def _recorded(self, weights, *, mapper=None):
    names = [name for name, _ in self.module.named_parameters()]
    loaded = _load_weights(self, weights, mapper=mapper)
    with open(os.environ[LOADS_ENV], "a") as f:
        f.write(json.dumps([type(self.module).__name__, names, sorted(loaded)]) + "\n")
    return loaded


# At the top, not under the main guard: an engine core the CPU platform spawns imports this module again (as
# `__mp_main__`), and so loads through the recording loader too.
utils.AutoWeightsLoader.load_weights = _recorded

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ[LOADS_ENV] = loads_file = sys.argv[2] + ".loads.jsonl"
    from eagle3_assets.target import TargetModel, read_config
    from eagle3_assets.drafter.vllm_eval import text_only_engine
    from eagle3_assets.vllm_server.command import compilation_config

    request = json.loads(open(sys.argv[1]).read())
    target = TargetModel.from_config(read_config(request["target"]), path=request["target"])
    engine_args = {"skip_tokenizer_init": True} | text_only_engine(target.wrapped)  # as drafter_eval starts it
    llm = LLM(
        model=request["target"],
        speculative_config={"method": "eagle3", "model": request["draft"], "num_speculative_tokens": 3},
        dtype="auto", enforce_eager=True, max_model_len=512, seed=0, disable_log_stats=False,
        # as the pipeline's engines; the shape alone (a tiny target's default aux ids may collide)
        compilation_config=compilation_config(target), **engine_args,
    )  # fmt: skip
    loads = [json.loads(line) for line in open(loads_file)]
    draft_class, names, loaded = next(r for r in reversed(loads) if r[0].startswith("Eagle3"))
    llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]],
        SamplingParams(temperature=0.0, max_tokens=request["max_tokens"]),
        use_tqdm=False,
    )
    counters = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    drafts = counters["vllm:spec_decode_num_drafts"]
    result = {
        "draft_class": draft_class,
        "unloaded": sorted(set(names) - set(loaded)),
        "mean_acceptance_length": 1 + counters["vllm:spec_decode_num_accepted_tokens"] / max(drafts, 1),
    }
    open(sys.argv[2], "w").write(json.dumps(result))
