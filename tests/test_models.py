"""Model sources: tiny models, paths, configs, compatibility, loading, hashing, adapters, the bundled SmolLM2."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from darts_dist.errors import DartsError
from darts_dist.sources.demo.tiny import FamilyShape, build_tiny_tokenizer, make_tiny_family
from darts_dist.plan.shapes import BUNDLED_CONFIG
from darts_dist.sources.models import (
    gguf_progress,
    BUNDLED_MODEL,
    BUNDLED_TOKENIZER,
    ModelInfo,
    bundled_model_dir,
    check_compatible,
    content_hash,
    load_causal_lm,
    load_tokenizer,
    materialize_adapter,
    read_model_info,
    resolve_path,
)


def _config_variant(source: Path, target: Path, **changes) -> Path:
    """A folder whose config.json is `source`'s with `changes`: enough for config-only checks."""
    target.mkdir()
    config = json.loads((source / "config.json").read_text()) | changes
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_tiny_tokenizer_is_chatml_and_deterministic(tiny_tokenizer):
    assert len(tiny_tokenizer) == 512
    assert tiny_tokenizer.pad_token == tiny_tokenizer.eos_token == "<|im_end|>"
    prompt = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    text = "def add(a, b):\n    return a + b"
    ids = tiny_tokenizer(text)["input_ids"]
    assert tiny_tokenizer.decode(ids) == text
    assert build_tiny_tokenizer()(text)["input_ids"] == ids


def test_tiny_experts_differ_from_the_base_only_in_top_layers(tiny_family):
    base = load_file(tiny_family.base / "model.safetensors")
    code = load_file(tiny_family.experts["code"] / "model.safetensors")
    math = load_file(tiny_family.experts["math"] / "model.safetensors")
    changed = {name for name in base if not torch.equal(base[name], code[name])}
    assert changed == {name for name in base if name.startswith(("model.layers.2.", "model.layers.3.", "model.norm."))}
    assert not torch.equal(code["model.norm.weight"], math["model.norm.weight"])


def test_make_tiny_family_reuses_a_finished_family(tiny_family):
    weights = tiny_family.base / "model.safetensors"
    written = weights.stat().st_mtime_ns
    again = make_tiny_family(tiny_family.base.parent)
    assert again == tiny_family and weights.stat().st_mtime_ns == written


def test_read_model_info_of_the_tiny_base(tiny_family):
    info = read_model_info(tiny_family.base)
    assert info == ModelInfo(
        path=tiny_family.base, architecture="LlamaForCausalLM", model_type="llama",
        hidden_size=64, num_layers=4, vocab_size=512, max_positions=512,
    )


def test_read_model_info_refuses_what_is_not_a_model(tmp_path):
    with pytest.raises(DartsError, match="not a model folder"):
        read_model_info(tmp_path)
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(DartsError, match="config.json"):
        read_model_info(tmp_path)


def test_missing_path_is_named(tmp_path):
    with pytest.raises(DartsError, match="no/such/model"):
        resolve_path("no/such/model", relative_to=tmp_path)
    assert resolve_path(".", relative_to=tmp_path) == tmp_path


def test_check_compatible_names_each_mismatched_field(tiny_family, tmp_path):
    base = read_model_info(tiny_family.base)
    check_compatible(base, {task: read_model_info(path) for task, path in tiny_family.experts.items()})

    # More rows than the base's are the base's tokens and some an expert added (VOCABULARY_POLICY); fewer are refused.
    check_compatible(base, {"wide": read_model_info(_config_variant(tiny_family.base, tmp_path / "wide", vocab_size=600))})
    other_vocab = read_model_info(_config_variant(tiny_family.base, tmp_path / "vocab", vocab_size=400))
    with pytest.raises(DartsError, match=r"'narrow' \(.*vocab\): vocab_size is 400, below the base's 512"):
        check_compatible(base, {"narrow": other_vocab, "code": read_model_info(tiny_family.experts["code"])})

    smaller = make_tiny_family(tmp_path / "small", tasks=("math",), shape=FamilyShape(hidden_size=32, num_layers=2))
    with pytest.raises(DartsError) as error:
        check_compatible(base, {"small": read_model_info(smaller.experts["math"])})
    assert "hidden_size is 32, base has 64" in str(error.value)
    assert "num_layers is 2, base has 4" in str(error.value)

    other_arch = read_model_info(
        _config_variant(tiny_family.base, tmp_path / "arch", architectures=["MistralForCausalLM"], model_type="mistral")
    )
    with pytest.raises(DartsError, match="architecture"):
        check_compatible(base, {"mistral": other_arch})


def test_content_hash_follows_the_weights(tiny_family, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_family.base, copy)
    assert content_hash(copy) == content_hash(tiny_family.base)
    (copy / "tokenizer_config.json").write_text("{}")  # not part of the model's identity
    assert content_hash(copy) == content_hash(tiny_family.base)

    state = load_file(copy / "model.safetensors")
    state["model.norm.weight"][0] += 1e-3
    save_file(state, copy / "model.safetensors", metadata={"format": "pt"})
    assert content_hash(copy) != content_hash(tiny_family.base)


def test_content_hashes_are_remembered_by_path_size_and_mtime(tiny_family, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_family.base, copy)
    weights = copy / "model.safetensors"
    fresh = content_hash(copy)
    weights.write_bytes(weights.read_bytes()[:-1] + bytes([weights.read_bytes()[-1] ^ 0xFF]))
    assert content_hash(copy) != fresh  # files written just now are hashed each time: a rewrite may keep the mtime
    weights.write_bytes(weights.read_bytes()[:-1] + bytes([weights.read_bytes()[-1] ^ 0xFF]))
    hour_ago = time.time_ns() - 3600 * 10**9
    for file in copy.iterdir():
        os.utime(file, ns=(hour_ago, hour_ago))
    first = content_hash(copy)
    assert first == fresh
    stat = weights.stat()
    # The same size and mtime with other bytes: the remembered hash comes back, so the files were not read again.
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert content_hash(copy) == first
    # A new mtime: hashed afresh, and the bytes' hash again equals an uncached computation's.
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert content_hash(copy) != first
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert content_hash(copy) == first


def test_load_causal_lm_is_frozen_and_runs(tiny_family, tiny_tokenizer):
    model = load_causal_lm(tiny_family.base)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    logits = model(**tiny_tokenizer(["a + b"], return_tensors="pt")).logits
    assert logits.shape[-1] == 512
    assert load_tokenizer(tiny_family.base).pad_token == "<|im_end|>"


def test_load_causal_lm_explains_corrupt_and_incomplete_weights(tiny_family, tmp_path):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_family.base, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(DartsError, match="cannot load the weights"):
        load_causal_lm(corrupt)

    incomplete = tmp_path / "incomplete"
    shutil.copytree(tiny_family.base, incomplete)
    state = load_file(incomplete / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, incomplete / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(DartsError, match="model.layers.1.mlp.up_proj.weight"):
        load_causal_lm(incomplete)


def test_load_tokenizer_sets_a_missing_pad_token(tiny_family, tmp_path):
    folder = tmp_path / "tok"
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(folder)
    assert load_tokenizer(folder).pad_token == "<|im_end|>"


def test_materialized_lora_adapter_equals_base_plus_scaled_product(tiny_family, tmp_path):
    from peft import LoraConfig, get_peft_model

    rank, alpha = 4, 8
    peft_model = get_peft_model(
        load_causal_lm(tiny_family.base), LoraConfig(r=rank, lora_alpha=alpha, target_modules=["q_proj", "v_proj"])
    )
    generator = torch.Generator().manual_seed(0)
    for name, parameter in peft_model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero, which would make the adapter a no-op
            parameter.data = torch.randn(parameter.shape, generator=generator) * 0.1
    adapter_dir = tmp_path / "adapter"
    peft_model.save_pretrained(adapter_dir)

    info = read_model_info(adapter_dir)
    assert info.is_adapter and info.hidden_size == 64 and info.path == adapter_dir

    merged_dir = materialize_adapter(adapter_dir, tiny_family.base)
    assert merged_dir.is_relative_to(Path(os.environ["DARTS_DIST_CACHE"]))
    assert materialize_adapter(adapter_dir, tiny_family.base) == merged_dir  # cached

    name = "model.layers.2.self_attn.q_proj.weight"
    lora = load_file(adapter_dir / "adapter_model.safetensors")
    lora_a = lora["base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight"]
    lora_b = lora["base_model.model.model.layers.2.self_attn.q_proj.lora_B.weight"]
    expected = load_file(tiny_family.base / "model.safetensors")[name] + (alpha / rank) * lora_b @ lora_a
    merged = load_file(merged_dir / "model.safetensors")
    torch.testing.assert_close(merged[name], expected)
    assert (merged_dir / "tokenizer.json").is_file()


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("DARTS_DIST_TEST_BUNDLED") != "1", reason="set DARTS_DIST_TEST_BUNDLED=1 (downloads ~93 MB)"
)
def test_bundled_smollm2_is_converted_once():
    started = time.monotonic()
    folder = resolve_path(BUNDLED_MODEL)
    assert folder == bundled_model_dir()
    info = read_model_info(folder)
    shape = (info.architecture, info.num_layers, info.hidden_size, info.vocab_size)
    assert shape == ("LlamaForCausalLM", 30, 576, 49152)
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    tokenizer = load_tokenizer(folder)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    for name in ("tokenizer.json", "chat_template.jinja"):  # the shipped copy is what the conversion writes
        assert (folder / name).read_bytes() == (BUNDLED_TOKENIZER / name).read_bytes(), name
    model = load_causal_lm(folder)
    assert model.config.tie_word_embeddings
    first = time.monotonic() - started
    started = time.monotonic()
    bundled_model_dir()
    assert time.monotonic() - started < 0.1 < first


def test_the_shipped_tokenizer_is_the_bundled_models() -> None:
    """The bundled SmolLM2's tokenizer, shipped: its vocabulary fits the bundled config's embedding rows and its
    chat template ends turns with the model's end-of-sequence token."""
    tokenizer = load_tokenizer(BUNDLED_TOKENIZER)
    config = json.loads(BUNDLED_CONFIG.read_text())
    assert len(tokenizer) == config["vocab_size"] and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == config["eos_token_id"]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "named SmolLM" in chat and chat.endswith("<|im_start|>assistant\n")  # its own default system turn
    assert chat.count("<|im_end|>") == chat.count("<|im_start|>") - 1  # every turn closed but the reply's


def test_a_bug_while_loading_is_not_reported_as_corrupt_weights(tiny_family, monkeypatch) -> None:
    """Unreadable weights are the user's to fix (error:/fix:); any other exception is a bug and keeps its traceback."""
    def broken(*args, **kwargs):
        raise TypeError("a bug, not a corrupt file")

    monkeypatch.setattr("darts_dist.sources.models.AutoModelForCausalLM.from_pretrained", broken)
    with pytest.raises(TypeError, match="a bug"):
        load_causal_lm(tiny_family.base)


def test_a_family_of_a_wide_shape_has_its_config_dtype_and_untied_head(tmp_path):
    """The thin shapes' settings on a small width: a vocabulary beyond the tokenizer's, GQA heads, an untied
    head, bf16 weights; the experts differ from the base only in the top half of the layers and the final norm."""
    shape = FamilyShape(hidden_size=128, num_layers=2, intermediate_size=344, num_heads=4, num_kv_heads=2,
                        vocab_size=1000, max_positions=2048, tie_embeddings=False, dtype="bfloat16")
    family = make_tiny_family(tmp_path / "thin", tasks=("code",), shape=shape)
    config = json.loads((family.base / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"]) == (128, 344, 2)
    assert (config["vocab_size"], config["max_position_embeddings"], config["tie_word_embeddings"]) == (1000, 2048, False)
    base, expert = (load_causal_lm(folder, dtype=torch.bfloat16) for folder in (family.base, family.experts["code"]))
    assert next(base.parameters()).dtype == torch.bfloat16
    assert base.lm_head.weight.data_ptr() != base.model.embed_tokens.weight.data_ptr()
    changed = {name for name, tensor in expert.state_dict().items() if not torch.equal(tensor, base.state_dict()[name])}
    assert changed and all(name.startswith(("model.layers.1.", "model.norm.")) for name in changed)
    assert AutoTokenizer.from_pretrained(family.base).model_max_length == 2048


def test_thin_references_name_a_shape_and_a_task():
    from darts_dist.sources.references import resolve_model

    for reference in ("thin:llama3-8b", "thin:llama2-7b/poetry"):
        with pytest.raises(DartsError, match="thin:mistral-7b/code"):
            resolve_model(reference)


def test_a_gguf_loads_with_darts_dists_progress_lines_outside_a_terminal(tiny_family, tmp_path, capfd) -> None:
    """The bundled model's conversion reads its GGUF with transformers' loader, whose plain tqdm bar would put one
    line of redraws thousands of characters long in a log: with darts-dist's bar swapped in, short lines."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map, load_gguf_checkpoint

    model = load_causal_lm(tiny_family.base)
    weights = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    for gguf_name, name in get_gguf_hf_weights_map(model, TensorProcessor()).items():
        if name in weights:
            writer.add_tensor(gguf_name, weights.pop(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    capfd.readouterr()
    with gguf_progress():
        loaded = load_gguf_checkpoint(str(tmp_path / "tiny.gguf"), return_tensors=True, model_to_load=model)
    err = capfd.readouterr().err
    assert len(loaded["tensors"]) == len(model.state_dict()) - len(weights)  # every tensor written came back
    assert "Converting and de-quantizing GGUF tensors" in err and "\r" not in err
    assert max(map(len, err.splitlines())) <= 300

