"""The EAGLE-3 drafter: model, training on stored hidden states, export, serving check.

model.py        the draft network (one Llama-style layer over fused target features)
target_head.py  the target's embedding / final norm / lm_head, and its distribution from stored states
ttt.py          the training-time-test objective (alignment, masking, loss, acc_k)
data.py         shard guard, sample index, deterministic resumable batches
checkpoint.py   resumable training state in the store, no pickles
train.py        train_drafter(...): the run (single process or torchrun data-parallel)
launch.py       the torchrun job the `drafter` asset starts: ranks per node, command, a failed rank named
report.py       where a rank reports: Dagster Pipes when the asset launched it, else stdout
export.py       the servable export, checked against the names engines load
vllm_eval.py    serve the export with its target in vLLM and read the acceptance
"""
