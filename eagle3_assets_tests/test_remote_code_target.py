"""A target whose tokenizer is remote code and slow, as Kimi's is: refused naming the setting until
`trust_remote_code: true`, then the data graph runs on it end to end (no offset mapping needed)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from dagster import AssetKey

from eagle3_assets.chat import span_token_flags
from eagle3_assets.definitions import build_definitions
from eagle3_assets.project import Project
from eagle3_assets.responses import read_responses
from eagle3_assets.settings import GenerationSettings
from eagle3_assets.storage import ArtifactStore
from eagle3_assets.target import TargetModel, TargetModelError, load_tokenizer
from eagle3_assets.tokenized import TokenizedSet

from .conftest import tiny_settings
from .helpers import gpu_instance, tiny_llama

pytestmark = pytest.mark.slow  # generates with a model

SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<think>", "</think>"]
TOKENIZER_CODE = textwrap.dedent(
    '''
    """A character tokenizer in pure Python (a slow tokenizer: no offsets), shipped with the model."""
    from transformers import PreTrainedTokenizer

    SPECIALS = {specials!r}


    class CharTokenizer(PreTrainedTokenizer):
        vocab_files_names = {{}}
        model_input_names = ["input_ids", "attention_mask"]

        def __init__(self, **kwargs):
            chars = [chr(c) for c in range(32, 127)] + ["\\n"]
            self._vocab = {{t: i for i, t in enumerate(SPECIALS + chars)}}
            self._inverse = {{i: t for t, i in self._vocab.items()}}
            super().__init__(bos_token="<s>", eos_token="</s>", pad_token="<pad>", **kwargs)
            self.add_tokens(SPECIALS, special_tokens=True)

        @property
        def vocab_size(self):
            return len(self._vocab)

        def get_vocab(self):
            return dict(self._vocab)

        def _tokenize(self, text, **kwargs):
            return [c if c in self._vocab else "?" for c in text]

        def _convert_token_to_id(self, token):
            return self._vocab.get(token, self._vocab["?"])

        def _convert_id_to_token(self, index):
            return self._inverse.get(index, "?")

        def convert_tokens_to_string(self, tokens):
            return "".join(tokens)

        def save_vocabulary(self, save_directory, filename_prefix=None):
            return ()
    '''
).format(specials=SPECIALS)
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def remote_code_target(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("remote-code") / "target"
    tiny_llama(out, vocab=128, seed=1)
    (out / "tokenization_chars.py").write_text(TOKENIZER_CODE)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "CharTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_chars.CharTokenizer", None]},
        "chat_template": TEMPLATE,
    }))  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": SPECIALS.index("</s>")}))
    assert config["vocab_size"] == 128
    return out


def test_a_remote_code_tokenizer_is_refused_naming_the_setting(remote_code_target):
    with pytest.raises(TargetModelError) as e:
        load_tokenizer(TargetModel.read(remote_code_target, aux_layer_ids=[1, 2, 3]))
    assert str(e.value) == (
        f"{remote_code_target}: the tokenizer's code ships with the model; set `trust_remote_code: true` in the "
        "settings to run it (only for a model you trust)"
    )
    tok = load_tokenizer(TargetModel.read(remote_code_target, aux_layer_ids=[1, 2, 3], trust_remote_code=True))
    assert not tok.is_fast and type(tok).__name__ == "CharTokenizer"
    # Character spans map to tokens without an offset mapping.
    ids, flags = span_token_flags(tok, "It eats fish.", [(8, 12)])
    assert len(ids) == 13 and [i for i, f in enumerate(flags) if f] == [8, 9, 10, 11]


def test_the_data_graph_runs_on_a_slow_remote_code_tokenizer(remote_code_target, tmp_path):
    settings = tiny_settings(
        target_model=str(remote_code_target), trust_remote_code=True, draft_vocab_size=32,
        generation=GenerationSettings(max_new_tokens=6, batch_size=8, rows_per_part=16),
    )  # fmt: skip
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"What is {i} plus {i}?"}) + "\n" for i in range(5)))
    project = Project(settings.model_copy(update={"prompts": str(prompts)}), ArtifactStore(tmp_path / "store"))
    job = build_definitions(project).resolve_implicit_global_asset_job_def()
    keys = ["prompts", "target_model", "responses", "tokenized", "token_freq", "vocab_map"]
    with gpu_instance() as instance:
        result = job.execute_in_process(instance=instance, asset_selection=[AssetKey(k) for k in keys])
        assert result.success
        meta = instance.get_latest_materialization_event(AssetKey("target_model")).asset_materialization.metadata
        assert meta["slow_tokenizer"].value is True and meta["trust_remote_code"].value is True
    records = read_responses(project.store)
    tset = TokenizedSet.load(project.store)
    assert tset.num_rows == 5
    for r, record in enumerate(records):
        ids, mask = tset.row(r)
        assert ids.tolist() == record["prompt_token_ids"] + record["completion_token_ids"]
        assert mask.tolist() == [0] * len(record["prompt_token_ids"]) + [1] * len(record["completion_token_ids"])
    checks = [e for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"]
    assert {c.event_specific_data.check_name: c.event_specific_data.passed for c in checks} == {
        "reasoning_coverage": True, "vocab_map_invariant": True,
    }  # fmt: skip
