"""Medusa-2 training (peft LoRA on the target + heads): the loss goes down, the folder holds exactly the heads and
peft's adapter, load_medusa2 merges it into a plain transformers model, speculation on it stays lossless, and
checkpoints resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cli.main import main
from hf_specdec.heads import MedusaHeads, load_medusa2
from hf_specdec.training.medusa import LLAMA_LORA_MODULES, MedusaTrainConfig
from tests.training.test_medusa_training import DATA, _args, base  # noqa: F401  (base is a fixture)

STAGE_2 = ["--stage", "2", "--lora-r", "4", "--lora-alpha", "8", "--lora-dropout", "0.0", "--data-source", "text"]


@pytest.fixture(scope="module")
def trained(base, tmp_path_factory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("medusa2")
    assert main(_args(base, out, steps=20, extra=[*STAGE_2, "--medusa-lr-multiplier", "2"])) == 0
    return out


def test_stage_2_lowers_the_loss_and_writes_heads_and_peft_adapter(trained):
    history = json.loads((trained / "train_metrics.json").read_text())["loss_history"]
    assert len(history) == 20 and sum(history[-4:]) / 4 < sum(history[:4]) / 4 - 0.3
    assert sorted(p.name for p in trained.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "checkpoint", "lora", "train_metrics.json"]
    assert sorted(p.name for p in (trained / "lora").iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors"]
    lora = json.loads((trained / "lora" / "adapter_config.json").read_text())
    assert lora["peft_type"] == "LORA" and lora["r"] == 4
    assert sorted(lora["target_modules"]) == sorted(LLAMA_LORA_MODULES)


def test_load_medusa2_merges_the_saved_lora_and_stays_lossless(base, trained):  # noqa: F811
    plain = LlamaForCausalLM.from_pretrained(base)
    model, heads = load_medusa2(trained, LlamaForCausalLM.from_pretrained(base))
    assert type(model) is LlamaForCausalLM and not any("lora" in name for name, _ in model.named_parameters())
    saved = load_file(str(trained / "lora" / "adapter_model.safetensors"))
    a = saved["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]  # [r, in]
    b = saved["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]  # [out, r]
    assert b.abs().sum() > 0, "the LoRA was trained"
    expected = plain.model.layers[1].mlp.down_proj.weight + (8 / 4) * b @ a
    torch.testing.assert_close(model.model.layers[1].mlp.down_proj.weight, expected)
    for name, tensor in load_file(str(trained / "adapter_model.safetensors")).items():
        assert torch.equal(heads.state_dict()[name], tensor), name

    ids = torch.tensor([[5, 9, 17, 5, 9, 17, 5], [3, 3, 8, 3, 3, 8, 3]])
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=1)
    reference = model.generate(ids, **kwargs)
    for tree in (None, [(0,), (1,), (0, 0), (1, 0)]):
        config = SpeculativeConfig(method="medusa", heads=heads, num_speculative_tokens=2, tree_paths=tree)
        assert torch.equal(hf_specdec.generate(model, ids, speculative=config, **kwargs), reference)


def test_stage_2_self_distillation_resumes_from_its_checkpoint(base, tmp_path):  # noqa: F811
    extra = [*STAGE_2, "--self-distillation", "--save-every", "2"]
    main(_args(base, tmp_path / "two", steps=2, extra=extra))
    first = json.loads((tmp_path / "two" / "train_metrics.json").read_text())["loss_history"][0]
    main(_args(base, tmp_path / "two", steps=3, extra=extra))
    history = json.loads((tmp_path / "two" / "train_metrics.json").read_text())["loss_history"]
    assert len(history) == 3 and history[0] == first, "the rerun did not go on from step 2"
    assert MedusaHeads.from_pretrained(tmp_path / "two").config.num_heads == 2
    # at step 0 the LoRA is the identity (B = 0), so the KL from the target is 0 and the loss is the heads' alone:
    # heads_coef times stage 1's first loss on the same windows with the same initial heads
    main(_args(base, tmp_path / "one", steps=1, extra=["--data-source", "text"]))
    stage_1 = json.loads((tmp_path / "one" / "train_metrics.json").read_text())["loss_history"][0]
    assert first == pytest.approx(0.2 * stage_1, rel=1e-5)


def test_load_medusa2_and_stage_2_options_are_checked(base, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="load_medusa2: folder: no LoRA adapter at"):
        load_medusa2(tmp_path, LlamaForCausalLM.from_pretrained(base))
    with pytest.raises(ValueError, match="MedusaTrainConfig.self_distillation: only stage 2"):
        MedusaTrainConfig(base=base, data=DATA, out=tmp_path, self_distillation=True)
    with pytest.raises(ValueError, match="MedusaTrainConfig.stage: expected 1 or 2"):
        MedusaTrainConfig(base=base, data=DATA, out=tmp_path, stage=3)
    with pytest.raises(ValueError, match="MedusaTrainConfig.lora_dropout: expected a value in"):
        MedusaTrainConfig(base=base, data=DATA, out=tmp_path, stage=2, lora_dropout=1.5)
