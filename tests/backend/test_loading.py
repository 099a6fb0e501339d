"""backend/loading.py: HF folders (Llama, Qwen3, the Qwen3.5-MoE multimodal checkpoint layout), GGUF errors, the
embedded model's location, device/dtype resolution. (The embedded model's conversion and cache are exercised once, end
to end, in test_server.py.)"""
import pytest
import torch

from backend import loading
from backend.loading import ModelLoadError, load_model
from tests.conftest import TEMPLATES, build_tokenizer


def test_device_and_dtype_resolution():
    assert loading.resolve_device("cpu") == "cpu"
    assert loading.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert loading.resolve_dtype("auto", "cpu") == (torch.bfloat16 if loading.cpu_has_bf16_matmul() else torch.float32)
    assert loading.resolve_dtype("auto", "cuda") == torch.bfloat16
    assert loading.resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ModelLoadError, match="--dtype"):
        loading.resolve_dtype("float8", "cpu")
    with pytest.raises(ModelLoadError, match="--device"):
        loading.resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA"):
            loading.resolve_device("cuda")


def test_bad_model_specs_fail_with_clear_messages(tmp_path):
    with pytest.raises(ModelLoadError, match="model not found"):
        loading.check_model_spec(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        loading.check_model_spec(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        loading.check_model_spec(str(tmp_path / "weights.bin"))


def test_corrupt_gguf_is_a_clear_error_and_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REVIEWER_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="cannot read the GGUF file"):
        load_model(str(bad), device="cpu")
    models = tmp_path / "cache" / "models"
    assert not models.exists() or list(models.iterdir()) == []


def test_embedded_gguf_is_found_inside_the_wheel():
    path = loading.embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert loading._gguf_cache_dir(path, "SmolLM2-135M-Instruct").name.startswith("SmolLM2-135M-Instruct-")


def test_cache_root_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("REVIEWER_CACHE_DIR", str(tmp_path / "a"))
    assert loading.cache_root() == tmp_path / "a"
    monkeypatch.delenv("REVIEWER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loading.cache_root() == tmp_path / "xdg" / "reviewer"


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_5_moe"])
def test_hf_folder_loads_with_name_context_and_tokenizer(tiny_model, kind):
    path = tiny_model(kind)
    loaded = load_model(str(path), device="cpu", dtype="auto")
    auto = "bfloat16" if loading.cpu_has_bf16_matmul() else "float32"
    assert loaded.name == path.name and loaded.device == "cpu" and loaded.dtype == auto
    assert loaded.max_context == 2048  # the config's max_position_embeddings
    assert loaded.tokenizer.chat_template
    assert not loaded.model.training
    assert load_model(str(path), device="cpu", max_context=512).max_context == 512
    assert load_model(str(path), device="cpu", max_context=10**6).max_context == 2048  # never past the model's own
    with pytest.raises(ModelLoadError, match="too small"):
        load_model(str(path), device="cpu", max_context=4)


def test_qwen3_5_moe_multimodal_checkpoint_loads_as_a_causal_lm(tmp_path):
    """Released Qwen3.5/3.6 MoE checkpoints are `qwen3_5_moe` (vision + text, weights under model.language_model.):
    we load the text model and it computes the same logits."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATES["qwen35"]
    text = dict(vocab_size=len(tokenizer), hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
                linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
                num_experts_per_tok=2, max_position_embeddings=1024)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    full = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=vision)).eval()
    full.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    assert type(loaded.model).__name__ == "Qwen3_5MoeForCausalLM"
    assert loaded.max_context == 1024
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(input_ids=ids).logits, full(input_ids=ids).logits)
