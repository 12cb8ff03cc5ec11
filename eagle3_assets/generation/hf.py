"""Generation with HF transformers: batched (left-padded), prompts grouped by length."""

from __future__ import annotations

import torch

from eagle3_assets.generation.base import Generated
from eagle3_assets.settings import GenerationSettings
from eagle3_assets.target import TargetModel, load_hf_model, stop_token_ids


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class HFGenerator:
    """The target in this process; `generate` never raises for one bad row."""

    name = "hf"

    def __init__(self, target: TargetModel, settings: GenerationSettings, *, device: torch.device | None = None):
        self.settings = settings
        self.device = device or pick_device()
        dtype = torch.float32 if self.device.type == "cpu" else "auto"
        self.model = load_hf_model(target, dtype).to(self.device).eval()
        self.stop_token_ids = stop_token_ids(target)
        # Any id: padding is masked out and cut off the results.
        self.pad_id = min(self.stop_token_ids) if self.stop_token_ids else 0
        self.max_context = target.max_context or 1 << 30

    def _completion(self, generated: list[int], budget: int) -> Generated:
        stop = next((i for i, t in enumerate(generated) if t in self.stop_token_ids), None)
        if stop is not None:
            return Generated(generated[: stop + 1], "stop")
        return Generated(generated[:budget], "length")

    @torch.inference_mode()
    def _generate_batch(self, prompts: list[list[int]]) -> list[Generated]:
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        budget = min(self.settings.max_new_tokens, self.max_context - width)
        sampling = self.settings.temperature > 0
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=attn.to(self.device),
            max_new_tokens=budget,
            do_sample=sampling,
            temperature=self.settings.temperature if sampling else None,
            top_p=self.settings.top_p if sampling else None,
            top_k=None,
            eos_token_id=sorted(self.stop_token_ids) or None,
            pad_token_id=self.pad_id,
        )
        return [self._completion(out[i, width:].tolist(), budget) for i in range(len(prompts))]

    def generate(self, prompts: list[list[int]]) -> list[Generated]:
        results: list[Generated | None] = [None] * len(prompts)
        todo = []
        for i, p in enumerate(prompts):
            if len(p) >= self.max_context:
                results[i] = Generated.failed(f"prompt has {len(p)} tokens; the model context is {self.max_context}")
            else:
                todo.append(i)
        if self.settings.temperature > 0:
            torch.manual_seed(self.settings.seed)
        order = sorted(todo, key=lambda i: len(prompts[i]))
        for start in range(0, len(order), self.settings.batch_size):
            idx = order[start : start + self.settings.batch_size]
            try:
                done = self._generate_batch([prompts[i] for i in idx])
            except Exception:  # noqa: BLE001 - retry alone so one bad row cannot sink its batch
                done = [self._generate_one(prompts[i]) for i in idx]
            for i, g in zip(idx, done, strict=True):
                results[i] = g
        return [r if r is not None else Generated.failed("not generated") for r in results]

    def _generate_one(self, prompt: list[int]) -> Generated:
        try:
            return self._generate_batch([prompt])[0]
        except Exception as e:  # noqa: BLE001
            return Generated.failed(f"{type(e).__name__}: {e}")

    def close(self) -> None:
        del self.model
