"""Draft models of every family (EAGLE-3, DFlash): models, training on stored hidden states, export, serving check.

family.py         what a family contributes (model, objective, export); its names are its spec's (../families.py)
model.py          EAGLE-3: one Llama-style layer over fused target features, unrolled by TTT
ttt.py            EAGLE-3's training-time-test objective (alignment, masking, loss, acc_k), the scoring both share
dflash_model.py   DFlash: Qwen3-style layers drafting a block of mask slots over the target's context
dflash_loss.py    DFlash's objective: blocks at sampled anchors, scored as TTT steps
target_head.py    the target's embedding / final norm / lm_head, and its distribution from stored states
data.py           shard guard, sample index, deterministic resumable batches
checkpoint.py     resumable training state in the store, no pickles
train.py          train_drafter(...): the run of any family (single process or torchrun data-parallel)
launch.py         the torchrun job a drafter asset starts: ranks per node, command, a failed rank named
report.py         where a rank reports: Dagster Pipes when the asset launched it, else stdout
export.py         EAGLE-3's servable export, checked against the names engines load
dflash_export.py  DFlash's servable export, checked against the names vLLM loads
vllm_eval.py      serve an export with its target in vLLM and read the acceptance
"""
