"""Write an EAGLE-3 drafter with speculators' own classes, as its trainer builds and saves one; runs INSIDE a venv with
speculators 0.9.0 (`benchmarks/peer/setup_speculators_venv.sh`). The import test (`test_drafter_import.py`, marked
`peer`) imports the result: a checkpoint written by the real package, not from our reading of its format.

    .peer/speculators/bin/python benchmarks/peer/write_speculators_drafter.py \\
        --target DIR --out DIR --d2t d2t.npy --t2d t2d.npy --aux-layer-ids 1 2 3

The decoder layer's config comes from speculators' `create_transformer_layer_config` (its trainer's default path: one
layer shaped by the verifier, its default 2048-token sliding window), the model from `Eagle3DraftModel.from_training_args`
(the verifier's embedding and lm_head rows loaded by speculators), every trainable weight then drawn at random (norms
away from 1, so a dropped or swapped one shows), and `save_pretrained` writes it. Prints the saved tensors' names. With `--reference T`, also what its forward drafts
on random inputs (`reference.safetensors`), which our drafter loaded from the imported release must draft too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

STEPS = 3


@torch.no_grad()
def reference(model, path: Path, tokens: int, seed: int) -> None:
    """What speculators' own forward drafts on random inputs, for our model to draft the same: `input_ids` [T + 1] and
    `aux` [T, 3H] in our alignment (index t reads the features of t and the embedding of token t + 1), and its
    `draft_tokens` [STEPS, T] (draft-vocab ids). speculators' data pipeline shifts the tokens one left before its
    forward, so it is given tokens 1..T; its TTT steps feed the ground-truth tokens after, as ours do."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    vocab, hidden = model.config.transformer_layer_config.vocab_size, model.hidden_size
    input_ids = torch.randint(3, vocab, (tokens + 1,), generator=g)
    aux = torch.randn(tokens, 3 * hidden, generator=g)
    drafts = model.eval()(
        hidden_states=aux[None], input_ids=input_ids[None, 1:], document_ids=torch.zeros(1, tokens, dtype=torch.long),
        position_ids=torch.arange(tokens)[None], ttt_steps=STEPS,
    )  # fmt: skip
    save_file({"input_ids": input_ids, "aux": aux, "draft_tokens": torch.cat(drafts)}, str(path))


if __name__ == "__main__":
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True, help="the verifier: a local HF model directory")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--d2t", help=".npy d2t (int64 [draft]); with --t2d; none: the full vocab")
    ap.add_argument("--t2d", help=".npy t2d (bool [target vocab])")
    ap.add_argument("--aux-layer-ids", type=int, nargs="+", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference", type=int, default=0, help="also write reference.safetensors over this many tokens")
    args = ap.parse_args()

    layer = create_transformer_layer_config(
        verifier_name_or_path=args.target, num_layers=1, draft_arch="llama", hidden_act=None, sliding_window=2048,
        full_attention_indices=[],
    )  # fmt: skip
    d2t = torch.from_numpy(np.load(args.d2t)) if args.d2t else None
    t2d = torch.from_numpy(np.load(args.t2d)) if args.t2d else None
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=d2t, draft_vocab_size=len(d2t) if d2t is not None else layer.vocab_size,
        norm_before_residual=True, norm_before_fc=True, norm_output=True, ttt_steps=3,
        verifier_name_or_path=args.target, target_layer_ids=args.aux_layer_ids, draft_attn_impl="sdpa",
    )  # fmt: skip
    torch.manual_seed(args.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("embed_tokens.", "verifier_", "lm_head.")):
                continue  # the verifier's, as speculators loaded them
            p.copy_(torch.rand_like(p) + 0.5 if p.dim() == 1 else torch.randn_like(p) * 0.05)
    model.save_pretrained(str(args.out))
    if args.reference:
        reference(model, args.out / "reference.safetensors", args.reference, args.seed)
    from safetensors import safe_open

    with safe_open(str(args.out / "model.safetensors"), framework="pt") as f:
        print(json.dumps(sorted(f.keys())))
