"""EAGLE heads inside generate: lossless with chains, branch trees and dynamic trees on several architectures, and
fed exactly the target features EAGLE defines (the feature before each token, from the verify forward)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    BloomConfig,
    FalconConfig,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    MptConfig,
    OPTConfig,
)

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.heads import EagleConfig, EagleHead
from hf_specdec.heads.eagle import export_speculators
from hf_specdec.proposers.eagle import EagleDrafter, EagleProposer
from hf_specdec.schedule import controller
from tests.conftest import DECODER, SPECIAL, VOCAB, make_model, padded_batch, record_eagle_guesses

SHAPES = {
    "chain": dict(num_speculative_tokens=3),
    "branches": dict(num_speculative_tokens=3, tree_width=2),
    "dynamic": dict(top_k=3, depth=3, total_tokens=6),
}


def eagle_head(target: torch.nn.Module, version: str = "eagle", seed: int = 0, **overrides) -> EagleHead:
    """A random head: its drafts are almost never accepted."""
    torch.manual_seed(seed)
    return EagleHead(EagleConfig.for_target(target, version, **overrides)).eval()


def trained_head(
    target: torch.nn.Module,
    version: str,
    # [B, L]: sequences the head learns to continue (the test's own expected outputs: drafts are then often right)
    sequences: torch.Tensor,
    steps: int = 60,
) -> EagleHead:
    """A head fitted for a few steps to the target's choices on `sequences`, teacher-forced with the target's
    features as EAGLE is trained, so drafts are accepted often, rejected sometimes, and span several tokens."""
    head = eagle_head(target, version).train()
    with torch.no_grad():
        hidden_states = target(sequences, output_hidden_states=True).hidden_states
    features = torch.cat([hidden_states[i] for i in head.target_feature_layers(target)], dim=-1)
    embeds = target.get_input_embeddings()(sequences[:, 1:]).detach()
    positions = torch.arange(sequences.shape[1] - 1).expand(sequences.shape[0], -1)
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(steps):
        logits = head.logits(head(embeds, features[:, :-1], positions, None), target.get_output_embeddings())
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), sequences[:, 2:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


def _generate(target, ids, mask, config, **kwargs):
    return hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, return_dict_in_generate=True,
                               max_new_tokens=20, do_sample=False, eos_token_id=None, **kwargs)


@pytest.mark.parametrize("version", ["eagle", "eagle3"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_eagle_greedy_matches_plain_generate(version, shape):
    target = make_model("llama")
    ids, mask = padded_batch([12, 5, 9], seed=4, repeat_period=2)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    for head in (eagle_head(target, version), trained_head(target, version, expected)):
        out = _generate(target, ids, mask, SpeculativeConfig(method="eagle", heads=head, **SHAPES[shape]))
        assert torch.equal(out.sequences, expected)
        stats = out.spec_stats
        assert stats.num_draft_tokens > 0
    assert stats.accepted_per_position[1] > 0  # the trained head's drafts are accepted, several at a time
    assert stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gemma2", "phi3", "gpt2", "opt"])
def test_eagle_dynamic_tree_matches_plain_generate_on_other_architectures(arch):
    target = make_model(arch)
    ids, mask = padded_batch([11, 6, 9], seed=2, repeat_period=3)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    for version in ("eagle", "eagle3"):
        head = trained_head(target, version, expected)
        out = _generate(target, ids, mask, SpeculativeConfig(method="eagle", heads=head, **SHAPES["dynamic"]))
        assert torch.equal(out.sequences, expected), version
        assert out.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize(("config", "width", "positions"), [
    (GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128), 128, 128),  # n_inner None: 4 x the width
    (GPT2Config(n_embd=32, n_layer=2, n_head=4, n_inner=48), 48, 1024),
    (OPTConfig(hidden_size=32, ffn_dim=80, num_attention_heads=4, max_position_embeddings=64), 80, 64),
    (FalconConfig(hidden_size=32, num_attention_heads=4, ffn_hidden_size=72), 72, 2048),
    (MptConfig(d_model=32, n_heads=4, expansion_ratio=3, max_seq_len=96), 96, 96),
    (BloomConfig(hidden_size=32, n_head=4), 128, 4096),  # ALiBi: no position limit
])
def test_eagle_config_for_targets_that_name_their_shapes_otherwise(config, width, positions):
    """GPT-2-style configs name the MLP width and the context length otherwise than Llama's (`n_inner`, `ffn_dim`,
    `ffn_hidden_size`, `expansion_ratio`; `n_positions`, `max_seq_len`, none): a head shaped for them reads them."""

    class Target(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = config

    head = EagleConfig.for_target(Target())
    assert (head.intermediate_size, head.max_position_embeddings) == (width, positions)
    assert head.hidden_size == 32 and head.num_attention_heads == 4


def test_eagle_on_a_target_with_rope_per_layer_type():
    """Gemma-3 sets RoPE per layer type (local layers at another base than global ones): a head shaped for it takes
    the full-attention layers' (it attends over the whole context), and drafts losslessly."""
    torch.manual_seed(0)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}
    config = Gemma3TextConfig(vocab_size=VOCAB, **{**DECODER, "num_hidden_layers": 4}, head_dim=8, sliding_window=6,
                              rope_parameters=rope, **SPECIAL)
    target = Gemma3ForCausalLM(config).eval()
    assert EagleConfig.for_target(target).rope_parameters == target.config.rope_parameters["full_attention"]
    ids, mask = padded_batch([11, 6, 9], seed=2, repeat_period=3)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
    for version in ("eagle", "eagle3"):
        head = trained_head(target, version, expected)
        out = _generate(target, ids, mask, SpeculativeConfig(method="eagle", heads=head, **SHAPES["dynamic"]),
                        pad_token_id=0)
        assert torch.equal(out.sequences, expected), version
        assert out.spec_stats.num_accepted_tokens > 0


def test_eagle3_draft_vocabulary_maps_to_target_ids():
    """A 40-token draft vocabulary scattered over the target's 128 ids: drafts are only ever mapped ids, and the
    output is still plain generate's."""
    target = make_model("llama")
    head = eagle_head(target, "eagle3", draft_vocab_size=40)
    target_ids = torch.randperm(128, generator=torch.Generator().manual_seed(0))[:40].sort().values
    with torch.no_grad():
        head.d2t.copy_(target_ids - torch.arange(40))
        head.t2d.zero_()
        head.t2d[target_ids] = True
    ids, mask = padded_batch([9, 6], seed=1)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    with pytest.MonkeyPatch.context() as patch:
        drafted = record_eagle_guesses(patch)
        out = _generate(target, ids, mask, SpeculativeConfig(method="eagle", heads=head, **SHAPES["dynamic"]))
    assert torch.equal(out.sequences, expected)
    assert bool(head.t2d[torch.cat(drafted)].all())


@pytest.mark.parametrize("version", ["eagle", "eagle3"])
def test_vocabulary_logits_only_where_drafting_reads_them(version):
    """The head's vocabulary-sized logits are computed for no prompt position (the prompt's feed reads none and
    runs no projection at all) and for one position per row when committed tokens are fed (each row's last): a long
    prompt in a large batch does not build a [B, P, V] tensor. Output unchanged."""
    target = make_model("llama")
    head = eagle_head(target, version)
    widths: list[int] = []
    original = EagleHead.logits

    def recording(self, hidden, lm_head):
        widths.append(hidden.shape[1])
        return original(self, hidden, lm_head)

    ids, mask = padded_batch([12, 5, 9], seed=4, repeat_period=2)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EagleHead, "logits", recording)
        out = _generate(target, ids, mask, SpeculativeConfig(method="eagle", heads=head, num_speculative_tokens=3,
                                                             schedule="fixed"))
    assert torch.equal(out.sequences, expected)
    assert widths and min(widths) == max(widths) == 1, widths  # each feed of committed tokens, each chain step


def plain_steps_between_drafts(monkeypatch, plain_run: int) -> None:
    """The adaptive schedule's decisions replaced: `plain_run` plain steps, then one in which every row drafts as
    the estimates say (at least one token), and again."""
    steps = []

    def scripted(accepted, step_time, active, *args, **kwargs):
        steps.append(None)
        if len(steps) % (plain_run + 1):
            return controller.Decision(0, (0,) * len(active), 0.0, 0.0)
        width = accepted.shape[1] - 1
        limits = tuple(width if row else 0 for row in active)
        return controller.Decision(width, limits, 0.0, 0.0)

    monkeypatch.setattr(controller, "decide", scripted)


@pytest.mark.parametrize("version", ["eagle", "eagle3"])
@pytest.mark.parametrize("shape", ["chain", "dynamic"])
def test_plain_steps_between_drafts_match_plain_generate(version, shape, monkeypatch):
    """Runs of plain steps leave their tokens' features waiting and the next proposal feeds them with the rows'
    different numbers of accepted tokens; padded batch, greedy output still plain generate's; the head runs fewer
    forwards on committed tokens than there were steps."""
    target = make_model("llama")
    ids, mask = padded_batch([12, 5, 9], seed=4, repeat_period=2)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    plain_steps_between_drafts(monkeypatch, 2)
    feeds = []
    original = EagleDrafter.forward

    @functools.wraps(original)
    def counting(self, *args, **kwargs):
        feeds.append(kwargs.get("from_target", args[5] if len(args) > 5 else None))
        return original(self, *args, **kwargs)

    calls = {"propose": 0, "skip": 0}
    for name in calls:
        def counted(self, state, name=name, method=getattr(EagleProposer, name)):
            calls[name] += 1
            return method(self, state)
        monkeypatch.setattr(EagleProposer, name, counted)
    monkeypatch.setattr(EagleDrafter, "forward", counting)
    out = _generate(target, ids, mask, SpeculativeConfig(method="eagle", heads=trained_head(target, version, expected),
                                                         **SHAPES[shape]))
    assert torch.equal(out.sequences, expected)
    stats = out.spec_stats
    assert stats.num_accepted_tokens > 0 and calls["skip"] >= calls["propose"]
    # the prompt's feed, one per proposal, and at most one per skip right after a proposal (rows committed
    # different numbers of tokens): the other plain steps run no head forward
    feeds_of_committed = sum(1 for from_target in feeds if from_target) - 1
    assert feeds_of_committed <= 2 * calls["propose"] < calls["propose"] + calls["skip"]


@pytest.mark.parametrize("version", ["eagle", "eagle3"])
@pytest.mark.parametrize("plain_run", [0, 3])
def test_head_is_fed_the_target_feature_before_each_token(version, plain_run, monkeypatch):
    """Every committed token reaches the head with the target's features at the position before it, equal to what
    a fresh forward over the final sequence computes (for EAGLE-3, the fused layers' inputs); also when plain steps
    leave their tokens waiting for the next proposal, which feeds them in one forward."""
    target = make_model("gemma2")  # 4 layers: EAGLE-3 fuses the inputs of layers 2, 2 and 1
    ids = torch.tensor([[5, 9, 5, 9, 5, 9, 5, 7, 3]])
    plain_steps_between_drafts(monkeypatch, plain_run)
    head = trained_head(target, version, target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None))
    fed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    original = EagleDrafter.forward

    def recording(self, input_ids, position_ids, attention_mask, cache, features, from_target, **kwargs):
        if from_target:
            fed.append((input_ids[0].clone(), position_ids[0].clone(), features[0].clone()))
        return original(self, input_ids, position_ids, attention_mask, cache, features, from_target, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EagleDrafter, "forward", recording)
        out = _generate(target, ids, None, SpeculativeConfig(method="eagle", heads=head, **SHAPES["dynamic"]))
    assert out.spec_stats.accepted_per_position[1] > 0  # some steps commit several tokens
    assert out.spec_stats.schedule.plain_steps >= plain_run * 2
    with torch.no_grad():
        hidden_states = target(out.sequences, output_hidden_states=True).hidden_states
    layers = head.target_feature_layers(target)
    expected = torch.cat([hidden_states[i][0] for i in layers], dim=-1)  # [L, F]
    sequence = out.sequences[0]
    covered = set()
    for tokens, positions, features in fed:
        for token, position, feature in zip(tokens, positions, features):
            index = int(position) + 1  # pair i: token i + 1 with the feature at i
            if index >= len(sequence) - 1:
                continue  # the last step's features: the token after them was never verified
            assert int(token) == int(sequence[index])
            torch.testing.assert_close(feature, expected[index - 1], atol=1e-4, rtol=1e-4)
            covered.add(index)
    # every token but the first, once the target verified it; the tokens of the last proposal's step (at most
    # depth + 1) and of the plain steps after it (the scripted ones, and one at the length limit) are never fed
    assert covered == set(range(1, max(covered) + 1))
    assert max(covered) >= len(sequence) - 3 - SHAPES["dynamic"]["depth"] - plain_run
    widths = [len(tokens) for tokens, _, _ in fed[1:]]  # after the prompt's feed
    if plain_run:  # the waiting tokens and the drafting step's own, in one forward
        assert max(widths) > SHAPES["dynamic"]["depth"] + 1, widths


def test_a_call_that_never_drafts_never_runs_the_head():
    """With every step plain (speculation off by the batch-size rule) the head is not run over the prompt or the
    committed tokens: the prompt's feed waits for the head's first forward. The output is plain generate's."""
    target = make_model("llama")
    ids, mask = padded_batch([12, 5, 9], seed=4)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    calls = []
    original = EagleDrafter.forward

    def counting(self, *args, **kwargs):
        calls.append(None)
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EagleDrafter, "forward", counting)
        config = SpeculativeConfig(method="eagle", heads=eagle_head(target, "eagle3"), disable_by_batch_size=1)
        out = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, max_new_tokens=12,
                                  do_sample=False, eos_token_id=None, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.num_draft_tokens == 0 and calls == []


def test_prompt_features_skip_left_padding():
    """The prefill pairs exactly the real tokens after each row's first one with the features before them."""
    target = make_model("llama")
    ids, mask = padded_batch([8, 4, 6], seed=7)
    calls = []
    original = EagleDrafter.forward

    def recording(self, input_ids, position_ids, attention_mask, cache, features, from_target, **kwargs):
        calls.append((input_ids.clone(), features.clone()))
        return original(self, input_ids, position_ids, attention_mask, cache, features, from_target, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EagleDrafter, "forward", recording)
        _generate(target, ids, mask, SpeculativeConfig(method="eagle", heads=eagle_head(target), num_speculative_tokens=2))
    tokens, features = calls[0]  # the prefill
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        final = target(ids, attention_mask=mask, position_ids=position_ids, output_hidden_states=True).hidden_states[-1]
    for row, length in enumerate(mask.sum(dim=1).tolist()):
        start = ids.shape[1] - length
        assert torch.equal(tokens[row, : length - 1], ids[row, start + 1 :])
        torch.testing.assert_close(features[row, : length - 1], final[row, start:-1], atol=1e-4, rtol=1e-4)


def test_eagle_spellings_and_bad_input():
    target = make_model("llama")
    head = eagle_head(target)
    ids, mask = padded_batch([6, 4], seed=0)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    assert torch.equal(hf_specdec.generate(target, ids, assistant=head, spec_method="eagle", **kwargs), expected)
    config = SpeculativeConfig(method="eagle", heads=head, top_k=4, depth=5, total_tokens=12)
    assert (config.tree_width, config.num_speculative_tokens, config.tree_total_tokens) == (4, 5, 12)
    with pytest.raises(ValueError, match="SpeculativeConfig.top_k: an alias of tree_width"):
        SpeculativeConfig(method="eagle", heads=head, top_k=4, tree_width=3)
    with pytest.raises(ValueError, match="method='eagle' needs hf_specdec.heads.EagleHead, got None"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="method='eagle' needs hf_specdec.heads.EagleHead, got an object"):
        SpeculativeConfig(method="eagle", heads=object())
    with pytest.raises(ValueError,
                       match=r"tree_paths: static trees of rank paths; only methods \['medusa', 'recycling'\]"):
        SpeculativeConfig(method="eagle", heads=head, tree_paths=[(0,)])
    other = make_model("gemma2")
    with pytest.raises(ValueError, match="vocab_size 128 does not match|hidden_size"):
        hf_specdec.generate(target, ids, assistant=eagle_head(make_model("llama"), hidden_size=16,
                                                             num_attention_heads=2, num_key_value_heads=2,
                                                             head_dim=8), spec_method="eagle", **kwargs)
    deep = EagleHead(EagleConfig.for_target(other, "eagle3"))  # fuses layer 2: the 2-layer llama has none
    with pytest.raises(ValueError, match=r"feature_layers \(2, 2, 1\) need a target with more than 2 layers"):
        hf_specdec.generate(target, ids, assistant=deep, spec_method="eagle", **kwargs)
    with pytest.raises(ValueError, match="EagleConfig.version: expected one of"):
        EagleConfig.for_target(target, "eagle2")
    with pytest.raises(ValueError, match="EagleConfig.feature_layers: only for version 'eagle3'"):
        EagleConfig.for_target(target, "eagle", feature_layers=(0,))
    with pytest.raises(ValueError, match="EagleConfig.draft_vocab_size: expected at most vocab_size 128"):
        EagleConfig.for_target(target, "eagle3", draft_vocab_size=500)


def _write_safeailab(head: EagleHead, target: torch.nn.Module, folder) -> None:
    """SafeAILab's layout: the draft layer's Llama config.json ("bias" for EAGLE-1, "draft_vocab_size" for
    EAGLE-3) and model.safetensors with a copy of the target's embeddings."""
    config = head.config
    values = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": config.hidden_size,
              "intermediate_size": config.intermediate_size, "num_attention_heads": config.num_attention_heads,
              "num_key_value_heads": config.num_key_value_heads, "num_hidden_layers": 1,
              "vocab_size": config.vocab_size, "rms_norm_eps": config.rms_norm_eps, "rope_theta": 10000.0,
              "max_position_embeddings": config.max_position_embeddings, "hidden_act": "silu"}
    values |= {"bias": config.fc_bias} if config.version == "eagle" else {"draft_vocab_size": config.vocab_size}
    (folder / "config.json").write_text(json.dumps(values))
    weights = {k: v.detach().clone().contiguous() for k, v in head.state_dict().items()}
    weights["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    save_file(weights, str(folder / "model.safetensors"))


@pytest.mark.parametrize("layout", ["ours", "safeailab", "speculators"])
@pytest.mark.parametrize("version", ["eagle", "eagle3"])
def test_saved_and_published_layouts_load_and_run(tmp_path, layout, version):
    """A trained head written in each layout loads back and drafts exactly as before, losslessly."""
    target = make_model("llama")
    ids, mask = padded_batch([10, 6, 8], seed=5, repeat_period=2)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    head = trained_head(target, version, expected)
    if layout == "ours":
        head.save_pretrained(tmp_path)
    elif layout == "speculators":
        export_speculators(head, tmp_path, verifier_name_or_path="local/target")
    else:
        _write_safeailab(head, target, tmp_path)  # EAGLE-3: the fused layers are resolved from the target
    loaded = EagleHead.from_pretrained(tmp_path)
    if layout == "safeailab" and version == "eagle3":
        assert loaded.config.feature_layers is None  # resolved at generate, to the layers `head` was trained on
    runs = [_generate(target, ids, mask, SpeculativeConfig(method="eagle", heads=h, **SHAPES["dynamic"]))
            for h in (head, loaded)]
    for out in runs:
        assert torch.equal(out.sequences, expected)
    assert runs[0].spec_stats.accepted_per_position == runs[1].spec_stats.accepted_per_position
    assert runs[0].spec_stats.num_accepted_tokens > 0
