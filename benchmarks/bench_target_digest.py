"""The target's content identity (`provenance.target_identity`, issue 44): what reading every file whole costs, and
what a look costs once the digests are cached.

Run: .venv/bin/python benchmarks/bench_target_digest.py [--gib 2] [--files 4] [--dir /tmp]
Writes a model directory of `--files` weight files (`--gib` GiB in all, random bytes) and a config, then reports:
- the digest rate (MB/s) of a first look with an empty cache, best of 2 (the page cache holds the files after they
  are written, so this is sha256 and the copy from memory, not the disk: a cold disk is slower when it reads
  slower than the digest), and the minutes per TB it implies;
- a cached re-check: a new `FileDigests` on the same cache directory (another process's view), best of 5;
- hashlib's bare sha256 on an in-memory buffer, the ceiling on this CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from eagle3_assets.file_digests import FileDigests
from eagle3_assets.provenance import target_identity


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-digest-", dir=args.dir))
    try:
        model = work / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
        per_file = int(args.gib * (1 << 30)) // args.files
        chunk = os.urandom(64 << 20)
        for i in range(args.files):
            with open(model / f"model-{i:05d}-of-{args.files:05d}.safetensors", "wb") as f:
                left = per_file
                while left:
                    f.write(chunk[: min(left, len(chunk))])
                    left -= min(left, len(chunk))
        total = sum(p.stat().st_size for p in model.iterdir())

        cold = []
        for n in range(2):
            digests = FileDigests(work / f"cache-{n}")
            t = time.perf_counter()
            identity = target_identity(str(model), digests=digests)
            cold.append(time.perf_counter() - t)
            assert digests.hashed_bytes == total
        warm = []
        for _ in range(5):
            digests = FileDigests(work / "cache-0")
            t = time.perf_counter()
            assert target_identity(str(model), digests=digests) == identity
            warm.append(time.perf_counter() - t)
            assert digests.hashed == 0
        buf = chunk * 4
        t = time.perf_counter()
        hashlib.sha256(buf).hexdigest()
        bare = len(buf) / (time.perf_counter() - t) / 1e6

        rate = total / min(cold) / 1e6
        print(f"{total / 1e9:.2f} GB in {args.files + 1} files, {os.cpu_count()} CPUs")
        print(f"first look (empty cache): {min(cold):.2f} s, {rate:,.0f} MB/s -> {1e6 / rate / 60:.1f} min per TB")
        print(f"cached re-check: {min(warm) * 1000:.1f} ms ({args.files + 1} files)")
        print(f"bare hashlib sha256 in memory: {bare:,.0f} MB/s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
