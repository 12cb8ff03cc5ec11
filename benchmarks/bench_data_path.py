"""The vLLM extraction data path: from a finished forward to a verified sample file in the store,
in bytes/s, over the raw write speed of the same bytes to the same disk, measured in one run.

    .venv/bin/python benchmarks/bench_data_path.py [--hidden 4096] [--tokens 2000] [--samples 12]

The states of a finished forward ([T, L, H] for the sorted layer ids, bf16, on the CPU) go
through the functions the two paths run, one sample after another:

- two writes (the path before, and still the one for stores the server cannot see): the
  connector saves vLLM's raw file in its own directory; the client reads it back, checks and
  splits it (`split_hidden_states`), encodes our sample file, validates it (`sample_problem`),
  writes it to the store, and deletes the raw file;
- one write (the connector writes into the store), as on the CPU build: the connector
  splits, checks the values (`tensor_problem`), encodes (`encode_hidden`) and streams the
  sample file atomically (`sample_buffers` + `write_atomically`); the client verifies its
  header, ids and mask (`written_sample_problem`);
- one write, host side: the same from the encoded tensors in host memory, which is what is
  left to the CPU on a GPU node (the split, checks and cast run on the device there, and
  the copy to pinned memory is asynchronous).

The baseline writes the final file's bytes with open/write/close, no encoding, same directory.
Page cache included on all three: the ratio is what the code costs, not what the disk does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle3_assets.hidden_states.vllm_extractor import split_hidden_states  # noqa: E402
from eagle3_assets.sample_file import (  # noqa: E402
    SampleSpec,
    encode_hidden,
    encode_sample,
    sample_buffers,
    sample_problem,
    tensor_problem,
    written_sample_problem,
)
from eagle3_assets.storage import ArtifactStore  # noqa: E402
from eagle3_assets.target import TargetModel  # noqa: E402
from eagle3_assets.vllm_server.connector import write_atomically  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    H, T, layers = args.hidden, args.tokens, [2, 16, 29, 32]
    config = {"num_hidden_layers": 32, "hidden_size": H, "vocab_size": 32000, "num_attention_heads": H // 128}
    target = TargetModel.from_config(config, path="bench", aux_layer_ids=(2, 16, 29))
    spec = SampleSpec(H, (2, 16, 29), args.dtype, "bench", "pre_norm")
    ids = np.arange(T, dtype=np.int32) % 32000
    mask = np.ones(T, np.uint8)
    states = [torch.randn(T, len(layers), H).to(torch.bfloat16) for _ in range(args.samples)]  # finished forwards

    with tempfile.TemporaryDirectory(dir=Path.cwd(), prefix=".bench-data-path-") as tmp:
        root = Path(tmp)
        store = ArtifactStore(root / "store")
        server_dir = root / "server"
        server_dir.mkdir()

        def final_bytes(i: int) -> bytes:
            aux, last = split_hidden_states(
                {"hidden_states": states[i], "token_ids": torch.from_numpy(ids.astype(np.int64))},
                row=i, input_ids=ids, target=target, where="bench",
            )  # fmt: skip
            return encode_sample(row=i, input_ids=ids, loss_mask=mask, aux_hidden_states=aux, last_hidden_state=last,
                                 spec=spec, backend="vllm")  # fmt: skip

        payloads = [final_bytes(i) for i in range(args.samples)]
        total = sum(map(len, payloads))

        def raw() -> None:
            for i, data in enumerate(payloads):
                with open(root / f"raw-{i}.safetensors", "wb") as f:
                    f.write(data)

        def two_writes() -> None:
            for i in range(args.samples):
                raw_file = server_dir / f"req-{i}.safetensors"
                save_file({"hidden_states": states[i], "token_ids": torch.from_numpy(ids.astype(np.int64))}, str(raw_file))
                tensors = st_load(raw_file.read_bytes())
                aux, last = split_hidden_states(tensors, row=i, input_ids=ids, target=target, where="bench")
                data = encode_sample(row=i, input_ids=ids, loss_mask=mask, aux_hidden_states=aux,
                                     last_hidden_state=last, spec=spec, backend="vllm")  # fmt: skip
                assert sample_problem(data, row=i, input_ids=ids, loss_mask=mask, spec=spec) is None
                store.write_bytes(f"two/{i}.safetensors", data)
                raw_file.unlink()

        index = {layer: j for j, layer in enumerate(layers)}

        def split(hs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """What the connector does with the cached layers of a finished request."""
            return hs[:, [index[j] for j in spec.aux_layer_ids], :].reshape(T, -1), hs[:, index[32], :]

        def write_and_verify(i: int, hidden: dict[str, torch.Tensor], where: str) -> None:
            path = str(store.local_path(f"{where}/{i}.safetensors"))
            write_atomically(sample_buffers(row=i, input_ids=ids, loss_mask=mask, hidden=hidden, spec=spec, backend="vllm"), path)
            assert written_sample_problem(path, row=i, input_ids=ids, loss_mask=mask, spec=spec) == (None, len(payloads[i]))

        def one_write() -> None:
            for i in range(args.samples):
                aux, last = split(states[i])
                assert tensor_problem("aux", aux) is None and tensor_problem("last", last) is None
                write_and_verify(i, encode_hidden(aux, last, spec.dtype), "one")

        encoded = [encode_hidden(*split(hs), spec.dtype) for hs in states]

        def host_side() -> None:
            for i in range(args.samples):
                write_and_verify(i, encoded[i], "host")

        paths = {"raw": raw, "two writes": two_writes, "one write": one_write, "host side": host_side}
        timings: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.repeat):
            for name, fn in paths.items():
                t0 = time.perf_counter()
                fn()
                timings[name].append(time.perf_counter() - t0)
    rates = {name: total / min(ts) for name, ts in timings.items()}
    print(f"{args.samples} samples of {T} tokens, H {H}, {args.dtype}: {total / 1e9:.2f} GB per pass, best of {args.repeat}")
    for name, rate in rates.items():
        print(f"  {name:<11} {rate / 1e9:7.2f} GB/s   ÷ raw {rate / rates['raw']:.2f}   (median {total / statistics.median(timings[name]) / 1e9:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
