"""Generation with HF transformers: batched (left-padded), prompts grouped by length."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from eagle3_assets.generation.base import Completion, Message, split_reasoning
from eagle3_assets.settings import GenerationSettings
from eagle3_assets.target_model import load_tokenizer

REASONING_TAGS = ("<think>", "</think>")


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class HFGenerator:
    """The target in this process; `generate` never raises for one bad row."""

    name = "hf"

    def __init__(self, model_dir: str | Path, settings: GenerationSettings, *, device: torch.device | None = None):
        self.settings = settings
        self.device = device or pick_device()
        self.tokenizer = load_tokenizer(model_dir)
        self.tokenizer.padding_side = "left"
        dtype = torch.float32 if self.device.type == "cpu" else "auto"
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(self.device).eval()
        cfg = self.model.generation_config
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        tags = {self.tokenizer.convert_tokens_to_ids(t) for t in REASONING_TAGS}
        # Special tokens are dropped from the text, except reasoning tags that some tokenizers mark special.
        self.drop_ids = set(self.tokenizer.all_special_ids) - tags
        self.close_tag_id = self.tokenizer.convert_tokens_to_ids(REASONING_TAGS[1])

    def _prompt_ids(self, messages: list[Message]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _completion(self, prompt_len: int, generated: list[int]) -> Completion:
        stop = next((i for i, t in enumerate(generated) if t in self.eos_ids), None)
        kept = generated if stop is None else generated[: stop + 1]
        text = self.tokenizer.decode([t for t in kept if t not in self.drop_ids])
        reasoning, content = split_reasoning(text, *REASONING_TAGS)
        if self.close_tag_id in kept:
            reasoning_tokens = kept.index(self.close_tag_id) + 1
        else:
            reasoning_tokens = len(self.tokenizer(reasoning, add_special_tokens=False)["input_ids"]) if reasoning else 0
        return Completion(
            reasoning=reasoning,
            content=content,
            finish_reason="length" if stop is None else "stop",
            prompt_tokens=prompt_len,
            completion_tokens=len(kept),
            reasoning_tokens=reasoning_tokens,
        )

    @torch.inference_mode()
    def _generate_batch(self, prompts: list[list[int]]) -> list[Completion]:
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
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_id,
        )
        return [self._completion(len(p), out[i, width:].tolist()) for i, p in enumerate(prompts)]

    def generate(self, conversations: list[list[Message]]) -> list[Completion]:
        results: list[Completion | None] = [None] * len(conversations)
        prompts: dict[int, list[int]] = {}
        for i, messages in enumerate(conversations):
            try:
                ids = self._prompt_ids(messages)
            except Exception as e:  # noqa: BLE001 - a template error belongs to its row
                results[i] = Completion.failed(f"cannot render prompt: {e}")
                continue
            if len(ids) >= self.max_context:
                results[i] = Completion.failed(
                    f"prompt has {len(ids)} tokens; the model context is {self.max_context}"
                )
                continue
            prompts[i] = ids
        if self.settings.temperature > 0:
            torch.manual_seed(self.settings.seed)
        order = sorted(prompts, key=lambda i: len(prompts[i]))
        for start in range(0, len(order), self.settings.batch_size):
            idx = order[start : start + self.settings.batch_size]
            try:
                done = self._generate_batch([prompts[i] for i in idx])
            except Exception:  # noqa: BLE001 - retry alone so one bad row cannot sink its batch
                done = [self._generate_one(prompts[i]) for i in idx]
            for i, c in zip(idx, done, strict=True):
                results[i] = c
        return [r if r is not None else Completion.failed("not generated") for r in results]

    def _generate_one(self, prompt: list[int]) -> Completion:
        try:
            return self._generate_batch([prompt])[0]
        except Exception as e:  # noqa: BLE001
            return Completion.failed(f"{type(e).__name__}: {e}")

    def close(self) -> None:
        del self.model
