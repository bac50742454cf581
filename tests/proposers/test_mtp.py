"""method='mtp': the target's own MTP layers draft, on tiny random models of every architecture in transformers that
declares MTP layers and that hf_specdec runs (DeepSeek-V3, GLM-4.5 MoE, Mellum); built from configs, no downloads.

Architectures with MTP layers that hf_specdec does not run, by any method (their layers keep states a KV cache
cannot hold, or mix masks it does not build): Bailing-hybrid (linear attention), Nemotron-H (Mamba), Inkling (hybrid
sliding layers); Step-3.5/3.7 and Kimi-K2.5 have no text-only causal LM class.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
from transformers.modeling_layers import MtpModel

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.proposers import mtp as mtp_proposer
from tests.conftest import PAD, SPECIAL, VOCAB, make_model, padded_batch
from tests.decoding import test_sampling_lossless as law_test

DECODER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "max_position_embeddings": 256}
MOE = {"moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
       "first_k_dense_replace": 1, "n_shared_experts": 1}
MTP_ARCHITECTURES = {
    # multi-head latent attention (keys and values of different widths), MoE MTP block
    "deepseek_v3": {**DECODER, **MOE, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8},
    "glm4_moe": {**DECODER, **MOE, "num_key_value_heads": 2},
    # a sliding-window MTP layer (window 5, shorter than the prompts) after full and sliding layers
    "mellum": {**DECODER, "num_key_value_heads": 2, "head_dim": 8, "moe_intermediate_size": 16, "num_experts": 4,
               "num_experts_per_tok": 2, "layer_types": ["full_attention", "sliding_attention"],
               "mtp_layer_types": ["sliding_attention"], "sliding_window": 5},
}
LENGTHS = [12, 7, 10]  # batch 3, left padded
NEW_TOKENS = 20


def mtp_target(arch: str, num_layers: int = 1, vocab: int = VOCAB, seed: int = 0) -> torch.nn.Module:
    """A tiny random model of `arch` whose config declares `num_layers` MTP layers."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(arch, vocab_size=vocab, num_nextn_predict_layers=num_layers,
                                  **MTP_ARCHITECTURES[arch], **SPECIAL)
    model = AutoModelForCausalLM.from_config(config).eval()
    for name, value in SPECIAL.items():
        setattr(model.generation_config, name, value)
    return model


def mtp_layers(target: torch.nn.Module, seed: int = 1) -> MtpModel:
    """Random MTP layers for `target`, built as transformers builds them for `generate(use_mtp=True)`."""
    torch.manual_seed(seed)
    return MtpModel(target, target.config.num_mtp_layers).eval()


def _configs(mtp: MtpModel) -> dict[str, SpeculativeConfig]:
    return {
        "chain_k1": SpeculativeConfig(method="mtp", heads=mtp, num_speculative_tokens=1),
        "chain_k3": SpeculativeConfig(method="mtp", heads=mtp, num_speculative_tokens=3),  # layers reused
        "tree": SpeculativeConfig(method="mtp", heads=mtp, num_speculative_tokens=3, tree_width=2),
        "dynamic_tree": SpeculativeConfig(method="mtp", heads=mtp, top_k=2, depth=3, total_tokens=5),
    }


@pytest.mark.parametrize(("arch", "num_layers"), [("deepseek_v3", 1), ("deepseek_v3", 2), ("glm4_moe", 1),
                                                  ("mellum", 1)])
def test_greedy_matches_plain_generate(arch, num_layers):
    target = mtp_target(arch, num_layers)
    ids, mask = padded_batch(LENGTHS, seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    for name, config in _configs(mtp_layers(target)).items():
        out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, expected), f"{arch}/{num_layers}/{name}"
        assert out.spec_stats.num_draft_tokens > 0, name


def test_static_shapes_match_plain_generate():
    """Static shapes (`cache_implementation="static"`): the MTP layers' cache of fixed capacity, fixed widths."""
    target = mtp_target("deepseek_v3", num_layers=2)
    ids, mask = padded_batch(LENGTHS, seed=7, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    config = SpeculativeConfig(method="mtp", heads=mtp_layers(target), num_speculative_tokens=3)
    out = hf_specdec.generate(target, ids, speculative=config, cache_implementation="static", **kwargs)
    assert torch.equal(out, expected)


def test_drafts_follow_the_mtp_layers(monkeypatch):
    """Layer d mod n reads the token after the one drafted at depth d: with two layers and k = 3, each step's feed
    of committed tokens and depth 2 read layer 0, depth 1 layer 1; every layer runs at every forward."""
    target = mtp_target("deepseek_v3", num_layers=2)
    mtp = mtp_layers(target)
    ran, outputs, read = [], {}, []
    for index, layer in enumerate(mtp.layers):
        def hook(module, args, output, index=index):
            ran.append(index)
            outputs[index] = output
        layer.register_forward_hook(hook)
    select = mtp_proposer.select_positions

    def recording(hidden, positions):  # the drafter picks the positions to project from one layer's output
        read.append(next(i for i, out in outputs.items() if out is hidden))
        return select(hidden, positions)

    monkeypatch.setattr(mtp_proposer, "select_positions", recording)
    ids, mask = padded_batch([6, 4], seed=1)
    out = hf_specdec.generate(target, ids, attention_mask=mask, max_new_tokens=9, do_sample=False, eos_token_id=None,
                              speculative=SpeculativeConfig(method="mtp", heads=mtp, num_speculative_tokens=3),
                              return_dict_in_generate=True)
    assert out.spec_stats.target_forward_passes >= 3
    assert ran == [0, 1] * (len(ran) // 2)
    # the prompt's feed (layer 0); then per step: the feed (layer 0), depth 1 (layer 1), depth 2 (layer 0)
    assert read[:7] == [0] + [0, 1, 0] * 2, read


def test_patched_generate_and_spec_method():
    """`model.generate(spec_method='mtp', assistant=mtp_layers)`; `use_mtp=True` beside hf_specdec is refused."""
    target = mtp_target("glm4_moe")
    mtp = mtp_layers(target)
    ids, mask = padded_batch(LENGTHS, seed=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    hf_specdec.enable()
    try:
        assert torch.equal(target.generate(ids, spec_method="mtp", assistant=mtp, **kwargs), expected)
        assert torch.equal(target.generate(ids, assistant=mtp, **kwargs), expected)  # the method follows the layers
        with pytest.raises(ValueError, match="use_mtp"):
            target.generate(ids, spec_method="mtp", assistant=mtp, use_mtp=True, **kwargs)
    finally:
        hf_specdec.disable()


def test_layers_load_from_the_checkpoint(tmp_path):
    """Without `heads`, the MTP layers come from the folder the target was loaded from (Mellum's published layout:
    `mtp.*` keys beside the model's), as transformers loads them for `use_mtp`; they draft what the same layers
    passed in draft."""
    target = mtp_target("mellum")
    mtp = mtp_layers(target)
    target.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    for name, tensor in mtp.layers.state_dict().items():
        index, rest = name.split(".", 1)
        weights[f"mtp.layers.{index}.{rest.removeprefix('mtp_block.')}"] = tensor.contiguous()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids, mask = padded_batch(LENGTHS, seed=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None,
                  return_dict_in_generate=True)
    given = hf_specdec.generate(target, ids, speculative=SpeculativeConfig(method="mtp", heads=mtp), **kwargs)
    read = hf_specdec.generate(loaded, ids, speculative=SpeculativeConfig(method="mtp"), **kwargs)
    assert torch.equal(read.sequences, given.sequences)
    assert read.spec_stats.num_draft_tokens == given.spec_stats.num_draft_tokens > 0


def test_model_without_mtp_layers_is_refused():
    ids, mask = padded_batch([5, 3])
    with pytest.raises(ValueError, match=r"LlamaForCausalLM has no multi-token-prediction layers.*method='draft'"):
        hf_specdec.generate(make_model("llama"), ids, attention_mask=mask, max_new_tokens=4,
                            speculative=SpeculativeConfig(method="mtp"))
    assert isinstance(make_model("llama"), LlamaForCausalLM)
    built = mtp_target("deepseek_v3")  # declares MTP layers, but was built from a config: no checkpoint to read
    with pytest.raises(ValueError, match="not loaded with from_pretrained"):
        hf_specdec.generate(built, ids, attention_mask=mask, max_new_tokens=4,
                            speculative=SpeculativeConfig(method="mtp"))
    other = mtp_layers(mtp_target("deepseek_v3", num_layers=2))
    with pytest.raises(ValueError, match="2 MTP layers, but DeepseekV3ForCausalLM declares 1"):
        hf_specdec.generate(built, ids, attention_mask=mask, max_new_tokens=4,
                            speculative=SpeculativeConfig(method="mtp", heads=other))
    with pytest.raises(ValueError, match="SpeculativeConfig.heads: method='mtp' takes"):
        SpeculativeConfig(method="mtp", heads=make_model("llama"))
    with pytest.raises(ValueError, match="SpeculativeConfig.draft_model: .* an MtpModel holds a target's MTP layers"):
        SpeculativeConfig(method="draft", draft_model=other)


# ---- MTP layers that copy the target: the drafter sees what the target saw ----


def copy_target(vocab: int = VOCAB, lm_head_scale: float = 1.0) -> torch.nn.Module:
    """A one-layer DeepSeek-V3 (MoE layer) with two declared MTP layers, embedding rows of unit RMS (so an MTP
    layer's `enorm` leaves them as they are)."""
    config = AutoConfig.for_model("deepseek_v3", vocab_size=vocab, num_nextn_predict_layers=2, **SPECIAL,
                                  **{**MTP_ARCHITECTURES["deepseek_v3"], "num_hidden_layers": 1,
                                     "first_k_dense_replace": 0})
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
        embeddings = model.model.embed_tokens.weight
        embeddings.div_(embeddings.pow(2).mean(-1, keepdim=True).add(config.rms_norm_eps).sqrt())
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


def copying_layers(target, noise: float) -> MtpModel:
    """MTP layers that are the target's own layer and final norm, fed the token's embedding (`eh_proj` = [I, 0]):
    each computes the target's next-token distribution from its own KV history of the text. `noise` mixes in the
    hidden state before the token (a random map of that scale), so drafts differ from the target's choice."""
    torch.manual_seed(12)
    mtp = MtpModel(target, target.config.num_mtp_layers).eval()
    hidden = target.config.hidden_size
    with torch.no_grad():
        for layer in mtp.layers:
            layer.mtp_block.load_state_dict(target.model.layers[0].state_dict())
            layer.post_norm.load_state_dict(target.model.norm.state_dict())
            layer.enorm.weight.fill_(1.0)
            weight = torch.zeros_like(layer.eh_proj.weight)
            weight[:, :hidden] = torch.eye(hidden)
            weight[:, hidden:] = torch.randn(hidden, hidden) * noise / hidden**0.5
            layer.eh_proj.weight.copy_(weight)
    return mtp


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_layers_copying_the_target_are_always_accepted(shape):
    """The committed tokens reach the MTP layers at the right positions with the right features: layers that
    compute the target's own distribution have every greedy draft accepted (batch 3, left padded; a row's first
    token, which has no hidden state before it, is the only one they never see)."""
    target = copy_target()
    ids, mask = padded_batch(LENGTHS, seed=6)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    config = SpeculativeConfig(method="mtp", heads=copying_layers(target, noise=0.0), num_speculative_tokens=3,
                               tree_width=1 if shape == "chain" else 2)
    out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected)
    if shape == "chain":
        assert out.spec_stats.acceptance_rate == 1.0
    # every step takes k + 1 tokens (the top branch): 1 prefill + ceil((NEW_TOKENS - 1) / 4) verify steps
    assert out.spec_stats.target_forward_passes == 1 + -(-(NEW_TOKENS - 1) // 4)


# ---- sampling: the exact target law (the harness: tests/decoding/test_sampling_lossless.py) ----


@pytest.fixture(scope="module")
def sampling_target():
    """Peaked logits over the sampling test's 8 tokens."""
    return copy_target(vocab=law_test.VOCAB, lm_head_scale=60.0)


def test_sampling_test_has_power(sampling_target):
    law = law_test.exact_law(sampling_target, law_test.TEMPERATURE)
    assert all(int((law_test.marginal(law, pair) > 0).sum()) >= 6 for pair in law_test.MARGINALS)
    power = law_test._power(law, law_test.exact_law(sampling_target, law_test.TEMPERATURE + 0.1))
    assert power > 0.99, power


@pytest.mark.parametrize("shape", ["chain", "dynamic_tree"])
def test_sampling_matches_exact_target_law(sampling_target, shape):
    """Drafts from noisy copying layers (two of them: depth 1 reads layer 1), accepted and rejected at depths 1
    and 2."""
    target = sampling_target
    mtp = copying_layers(target, noise=0.3)
    config = (SpeculativeConfig(method="mtp", heads=mtp, num_speculative_tokens=3, seed=21) if shape == "chain" else
              SpeculativeConfig(method="mtp", heads=mtp, top_k=3, depth=2, total_tokens=4, seed=22))
    law_test.assert_exact_law_with_drafts(target, config)
