"""Multimodal prompts: the pixel values (or the image features `generate` encodes from them) go to the prompt's
forward only, as plain `generate` feeds them; every later forward takes text tokens, at positions that continue each
axis of the prompt's (Qwen2-VL's multimodal rotary positions). Greedy output equals plain `generate`'s on tiny
random Llava, Llava-NeXT, Gemma-3, SmolVLM, Qwen2-VL and Qwen2.5-VL models, batched with left padding, for every kind of drafter, and the images
matter (without them the output differs)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    CLIPVisionConfig,
    DynamicCache,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    MllamaConfig,
    MllamaForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    SiglipVisionConfig,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
)

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cache.naming import CACHE_KWARG
from hf_specdec.cache.ragged import RaggedKVCache
from hf_specdec.heads import EagleConfig, EagleHead

VOCAB = 64
IMAGE = 63  # the image placeholder token
# every model's language part
TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# multimodal rotary positions: the head dimension's frequencies split over time, height and width
MROPE = {"rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}}


def llava() -> LlavaForConditionalGeneration:
    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                              image_size=16, patch_size=8, projection_dim=32)
    config = LlavaConfig(text_config=LlamaConfig(**TEXT), vision_config=vision, image_token_index=IMAGE, projector_hidden_act="gelu",
                         vision_feature_layer=-1, vision_feature_select_strategy="full")  # 5 image tokens
    return LlavaForConditionalGeneration(config).eval()


def gemma3() -> Gemma3ForConditionalGeneration:
    torch.manual_seed(0)
    text = Gemma3TextConfig(**TEXT, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                image_size=16, patch_size=4)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=IMAGE,
                          boi_token_index=61, eoi_token_index=62)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # initialised to zeros, which would make every image the same
        projection = model.model.multi_modal_projector.mm_input_projection_weight
        projection.normal_(std=1.0, generator=torch.Generator().manual_seed(3))
    return model


def qwen2_vl() -> Qwen2VLForConditionalGeneration:
    """Multimodal rotary positions (M-RoPE): `generate` gives position ids of four axes (text, time, height,
    width), the image's tokens laid out on a grid."""
    torch.manual_seed(0)
    config = Qwen2VLConfig(
        text_config={**TEXT, **MROPE},
        vision_config={"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "patch_size": 4,
                       "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3},
        image_token_id=IMAGE, video_token_id=60, vision_start_token_id=61, vision_end_token_id=62, pad_token_id=0)
    return Qwen2VLForConditionalGeneration(config).eval()


def qwen2_5_vl() -> Qwen2_5_VLForConditionalGeneration:
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config={**TEXT, **MROPE},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
                       "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3, "out_hidden_size": 32,
                       "window_size": 8, "fullatt_block_indexes": [0]},
        image_token_id=IMAGE, video_token_id=60, vision_start_token_id=61, vision_end_token_id=62, pad_token_id=0)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def llava_next() -> LlavaNextForConditionalGeneration:
    """Images tiled at their size (`image_sizes`): 10 tokens for a 16 x 16 image here."""
    torch.manual_seed(0)
    config = LlavaNextConfig(
        text_config={"model_type": "llama", **TEXT},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 1, "num_attention_heads": 4, "image_size": 16, "patch_size": 8,
                       "projection_dim": 32},
        image_token_index=IMAGE, image_grid_pinpoints=[[16, 16]], vision_feature_select_strategy="default",
        vision_feature_layer=-1)
    return LlavaNextForConditionalGeneration(config).eval()


def smolvlm() -> SmolVLMForConditionalGeneration:
    """Images split into patches whose features are pixel-shuffled: 4 tokens for a 16 x 16 image here."""
    torch.manual_seed(0)
    config = SmolVLMConfig(
        text_config={"model_type": "llama", **TEXT},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                       "image_size": 16, "patch_size": 4},
        image_token_id=IMAGE, scale_factor=2)
    return SmolVLMForConditionalGeneration(config).eval()


# the model, and an image's tokens in the prompt
MODELS = {"smolvlm": (smolvlm, [IMAGE] * 4), "llava": (llava, [IMAGE] * 5), "gemma3": (gemma3, [61] + [IMAGE] * 4 + [62]),
          "qwen2_vl": (qwen2_vl, [61] + [IMAGE] * 4 + [62]), "qwen2_5_vl": (qwen2_5_vl, [61] + [IMAGE] * 4 + [62]),
          "llava_next": (llava_next, [IMAGE] * 10)}


def prompt(arch: str) -> tuple[torch.nn.Module, dict]:
    """The model and `generate`'s inputs: two rows, left padded, an image in each at another place."""
    make, image = MODELS[arch]
    model = make()
    model.generation_config.pad_token_id = 0
    ids = torch.tensor([[0, 0, 0, 5] + image + [6, 7, 5, 6, 7, 5], [5, 6, 9] + image + [7, 5, 6, 7, 5, 6, 7]])
    inputs = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    generator = torch.Generator().manual_seed(1)
    if arch.startswith("qwen"):  # per image a 4 x 4 grid of patches (2 frames of 4 x 4 pixels each), merged 2 x 2
        inputs["pixel_values"] = torch.randn(2 * 16, 3 * 2 * 4 * 4, generator=generator)
        inputs["image_grid_thw"] = torch.tensor([[1, 4, 4], [1, 4, 4]])
        inputs["mm_token_type_ids"] = (ids == IMAGE).long()
    elif arch == "smolvlm":  # one image per row, all its pixels real
        inputs["pixel_values"] = torch.randn(2, 1, 3, 16, 16, generator=generator)
        inputs["pixel_attention_mask"] = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    elif arch == "llava_next":  # per image its tiles (one here) and the whole image
        inputs["pixel_values"] = torch.randn(2, 2, 3, 16, 16, generator=generator)
        inputs["image_sizes"] = torch.tensor([[16, 16], [16, 16]])
    else:
        inputs["pixel_values"] = torch.randn(2, 3, 16, 16, generator=generator)
    if arch == "gemma3":
        inputs["token_type_ids"] = (ids == IMAGE).long()  # Gemma-3's image tokens attend to each other both ways
    return model, inputs


def draft_for(model) -> LlamaForCausalLM:
    """A one-layer Llama sharing the target's vocabulary, image placeholder included."""
    torch.manual_seed(2)
    text = model.config.get_text_config()
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0,
                                        bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id)).eval()


def assert_same_cache(
    got,
    expected,
    # [B, P]: the prompt's mask
    attention_mask: torch.Tensor,
) -> None:
    """The returned caches hold the same keys and values at every position fed a real token (padding slots attend
    to nothing, and hold what each computation left there); a sliding-window layer keeps the last positions only."""
    prompt_length = attention_mask.shape[1]
    fed = torch.cat([attention_mask, expected.sequences[:, prompt_length:-1] != 0], dim=1).bool()
    for mine, theirs in zip(getattr(got, CACHE_KWARG).layers, getattr(expected, CACHE_KWARG).layers, strict=True):
        assert mine.keys.shape == theirs.keys.shape
        real = fed[:, -mine.keys.shape[2] :]
        for row in range(real.shape[0]):
            torch.testing.assert_close(mine.keys[row][:, real[row]], theirs.keys[row][:, real[row]])
            torch.testing.assert_close(mine.values[row][:, real[row]], theirs.values[row][:, real[row]])


SPECULATIVE = {
    "ngram": lambda model: {"spec_method": "ngram"},
    # the model itself drafting from the text alone (no images): its drafts are often accepted
    "self_draft": lambda model: {"speculative": SpeculativeConfig(method="draft", draft_model=copy.deepcopy(model),
                                                                 num_speculative_tokens=3, schedule="fixed")},
    "draft": lambda model: {"speculative": SpeculativeConfig(method="draft", draft_model=draft_for(model),
                                                            num_speculative_tokens=3)},
    "draft_tree": lambda model: {"speculative": SpeculativeConfig(method="draft", draft_model=draft_for(model),
                                                                 top_k=2, depth=3, total_tokens=6)},
    "eagle": lambda model: {"speculative": SpeculativeConfig(
        method="eagle", heads=EagleHead(EagleConfig.for_target(model, "eagle")).eval(), num_speculative_tokens=3)},
    "eagle3": lambda model: {"speculative": SpeculativeConfig(
        method="eagle", heads=EagleHead(EagleConfig.for_target(model, "eagle3")).eval(), num_speculative_tokens=3)},
    "static": lambda model: {"spec_method": "ngram", "cache_implementation": "static"},
}


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("method", sorted(SPECULATIVE))
def test_greedy_output_with_images_is_plain_generates(arch, method):
    model, inputs = prompt(arch)
    kwargs = {"max_new_tokens": 12, "do_sample": False}
    expected = model.generate(**inputs, **kwargs)
    out = hf_specdec.generate(model, **inputs, **kwargs, **SPECULATIVE[method](model), return_dict_in_generate=True)
    got = out.sequences
    assert torch.equal(got, expected)
    assert out.spec_stats.num_draft_tokens > 0
    if method == "self_draft":  # accepted drafts move each row's positions on by more than one
        assert out.spec_stats.num_accepted_tokens > 0
    if method == "ngram":  # the images reach the prompt's forward: without them the text goes elsewhere
        without = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
        assert not torch.equal(hf_specdec.generate(model, **without, **kwargs, **SPECULATIVE[method](model)), got)


def test_early_exit_drafts_with_a_multimodal_target_that_builds_as_a_causal_lm():
    model, inputs = prompt("gemma3")  # Gemma-3's multimodal class is also its causal LM
    kwargs = {"max_new_tokens": 12, "do_sample": False}
    expected = model.generate(**inputs, **kwargs)
    speculative = SpeculativeConfig(method="early_exit", early_exit_layer=1)
    assert torch.equal(hf_specdec.generate(model, **inputs, **kwargs, speculative=speculative), expected)


def test_early_exit_refuses_a_model_that_is_no_causal_lm():
    model, inputs = prompt("llava")
    speculative = SpeculativeConfig(method="early_exit", early_exit_layer=1)
    with pytest.raises(ValueError, match=r"early_exit_layer: LlavaForConditionalGeneration .*LlavaConfig.*method"):
        hf_specdec.generate(model, **inputs, max_new_tokens=4, do_sample=False, speculative=speculative)


def test_new_images_after_a_filled_cache_with_embeddings_are_refused():
    model, inputs = prompt("llava")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=inputs["input_ids"][:, :3], attention_mask=inputs["attention_mask"][:, :3], cache=cache)
    embeds = model.get_input_embeddings()(inputs["input_ids"]).detach()
    with pytest.raises(ValueError, match=r"multimodal inputs \(mm_encoder_outputs\) with inputs_embeds and a "
                                         r"filled cache"):
        hf_specdec.generate(model, input_ids=inputs["input_ids"], inputs_embeds=embeds,
                            attention_mask=inputs["attention_mask"], pixel_values=inputs["pixel_values"],
                            cache=cache, max_new_tokens=4, do_sample=False, spec_method="ngram")


@pytest.mark.parametrize("method", ["ngram", "self_draft"])
def test_rows_finishing_early_keep_their_positions(method):
    """A row that stops leaves the batch (the engine drops finished rows): the others keep each axis of their
    multimodal rotary positions."""
    model, inputs = prompt("qwen2_vl")
    prompt_length = inputs["input_ids"].shape[1]
    first = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    stop = int(first[0, prompt_length + 2])  # the first row's third token ends it
    kwargs = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": stop}
    expected = model.generate(**inputs, **kwargs)
    assert (expected[1, prompt_length:] != 0).sum() > 3, "the second row goes on"
    assert torch.equal(hf_specdec.generate(model, **inputs, **kwargs, **SPECULATIVE[method](model)), expected)


def test_text_alone_on_a_model_with_multimodal_rotary_positions():
    model, inputs = prompt("qwen2_vl")
    ids = inputs["input_ids"].masked_fill(inputs["input_ids"] >= 60, 9)  # no image
    kwargs = {"attention_mask": inputs["attention_mask"], "max_new_tokens": 12, "do_sample": False}
    expected = model.generate(ids, **kwargs)
    assert torch.equal(hf_specdec.generate(model, ids, spec_method="ngram", **kwargs), expected)


@pytest.mark.parametrize("arch", ["llava", "gemma3", "qwen2_vl", "qwen2_vl_text"])
def test_the_returned_cache_is_plain_generates(arch):
    """The output cache: a row that stopped early has its keys and values computed again over its final text, the
    prompt's images included (all rows are: an image's inputs are not split by row; without images, only the rows
    that stopped, their modalities split by row)."""
    model, inputs = prompt(arch.removesuffix("_text"))
    if arch.endswith("_text"):  # no image, each token's modality given all the same
        ids = inputs["input_ids"].masked_fill(inputs["input_ids"] >= 60, 9)
        inputs = {"input_ids": ids, "attention_mask": inputs["attention_mask"], "mm_token_type_ids": ids * 0}
    prompt_length = inputs["input_ids"].shape[1]
    first = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    kwargs = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": int(first[0, prompt_length + 2]),
              "return_dict_in_generate": True}
    expected = model.generate(**inputs, **kwargs)
    got = hf_specdec.generate(model, **inputs, **kwargs, spec_method="ngram")
    assert torch.equal(got.sequences, expected.sequences)
    assert_same_cache(got, expected, inputs["attention_mask"])


def test_inputs_that_every_forward_needs_are_refused():
    """Mllama's layers cross-attend to the image at every step (`cross_attention_mask` grows with the text)."""
    config = MllamaConfig(
        text_config={**TEXT, "cross_attention_layers": [1]},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_global_layers": 1,
                       "num_attention_heads": 4, "image_size": 16, "patch_size": 8, "max_num_tiles": 1,
                       "vision_output_dim": 64, "intermediate_layers_indices": [0],
                       "supported_aspect_ratios": [[1, 1]]},
        image_token_index=IMAGE)
    model = MllamaForConditionalGeneration(config).eval()
    ids = torch.tensor([[IMAGE, 5, 6, 7, 5, 6], [IMAGE, 9, 6, 7, 5, 6]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": torch.randn(2, 1, 1, 3, 16, 16),
              "aspect_ratio_ids": torch.tensor([[1], [1]]), "aspect_ratio_mask": torch.ones(2, 1, 1, dtype=torch.long),
              "cross_attention_mask": torch.ones(2, 6, 1, 1, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"model inputs \['aspect_ratio_ids', 'aspect_ratio_mask', "
                                         r"'cross_attention_mask'\] are not supported"):
        hf_specdec.generate(model, **inputs, max_new_tokens=4, do_sample=False, spec_method="ngram")


@pytest.mark.parametrize("method", ["ngram", "noisy_self_draft"])
def test_sampling_follows_the_exact_law_with_multi_axis_positions(method):
    """Sampling on a model whose positions have four axes (Qwen2-VL, text prompts: every axis advancing together):
    drafts accepted in some rows and rejected in others, at depth 2 too, and the draws follow the target's exact
    law (`tests/decoding/test_sampling_lossless.py`'s chi-square test)."""
    from tests.decoding import test_sampling_lossless as lossless

    torch.manual_seed(11)
    config = Qwen2VLConfig(
        text_config={"vocab_size": lossless.VOCAB, "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0,
                     "bos_token_id": None, "eos_token_id": None,
                     "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
        vision_config={"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "patch_size": 4,
                       "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3},
        image_token_id=7, video_token_id=6, vision_start_token_id=1, vision_end_token_id=2, pad_token_id=0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # peaked logits, as the law tests' own target
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    if method == "ngram":
        speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=3, seed=3)
    else:
        draft = copy.deepcopy(model)
        with torch.no_grad():
            weight = draft.lm_head.weight
            weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)) * 0.3 * weight.std())
        speculative = SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=3, seed=1)
    lossless.assert_exact_law_with_drafts(model, speculative, deep=method != "ngram")


@pytest.mark.parametrize("arch", ["llava", "gemma3", "qwen2_vl"])
def test_a_conversation_goes_on_from_the_cache_in_text(arch):
    """The second turn of a conversation about an image: the first call's cache holds the image, the second call
    brings text alone (`generate` still passes an empty `mm_encoder_outputs`), and continues as plain `generate`
    does (Qwen2-VL: positions from the first call's rotary offsets), the returned cache too."""
    model, inputs = prompt(arch)
    first = model.generate(**inputs, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    cache = getattr(first, CACHE_KWARG)
    ids = torch.cat([first.sequences, torch.tensor([[5, 6, 7], [7, 5, 6]])], dim=1)
    added = ids.shape[1] - inputs["input_ids"].shape[1]
    kwargs = {"attention_mask": torch.cat([inputs["attention_mask"], torch.ones(2, added, dtype=torch.long)], dim=1),
              "max_new_tokens": 8, "do_sample": False}
    for name in ("token_type_ids", "mm_token_type_ids"):  # the new text's types: 0
        if name in inputs:
            kwargs[name] = torch.cat([inputs[name], torch.zeros(2, added, dtype=torch.long)], dim=1)
    expected = model.generate(ids, **{CACHE_KWARG: copy.deepcopy(cache)}, **kwargs)
    got = hf_specdec.generate(model, ids, **{CACHE_KWARG: copy.deepcopy(cache)}, **kwargs, spec_method="ngram")
    assert torch.equal(got, expected)
    # the returned cache: a row that stopped early is computed again after the positions the given cache held (its
    # image among them, which the text alone does not give), as plain generate keeps them
    kwargs.update(eos_token_id=int(expected[0, ids.shape[1] + 2]), return_dict_in_generate=True)
    expected = model.generate(ids, **{CACHE_KWARG: copy.deepcopy(cache)}, **kwargs)
    got = hf_specdec.generate(model, ids, **{CACHE_KWARG: copy.deepcopy(cache)}, **kwargs, spec_method="ngram")
    assert torch.equal(got.sequences, expected.sequences)
    assert_same_cache(got, expected, kwargs["attention_mask"])


def test_the_image_text_to_text_pipeline_takes_the_keywords(monkeypatch):
    """After `enable()`, transformers' "image-text-to-text" pipeline hands `generate_kwargs={"spec_method": ...}` to
    the model's `generate` with the processor's inputs, and writes plain `generate`'s text. (Given as keywords of
    their own, this pipeline hands them to its processor, which drops them, as it does `generate`'s own.)"""
    from PIL import Image
    from transformers import CLIPImageProcessor, LlavaProcessor, pipeline

    from hf_specdec.testbed import load_testbed

    tokenizer = load_testbed()[0]
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    torch.manual_seed(0)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                              image_size=16, patch_size=8, projection_dim=32)
    model = LlavaForConditionalGeneration(LlavaConfig(
        text_config=text, vision_config=vision, image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        projector_hidden_act="gelu", vision_feature_layer=-1, vision_feature_select_strategy="full")).eval()
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}),
        tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="full", image_token="<image>",
        num_additional_image_tokens=1)
    image = Image.fromarray((torch.rand(16, 16, 3, generator=torch.Generator().manual_seed(0)) * 255).byte().numpy())
    generator = pipeline("image-text-to-text", model=model, processor=processor)
    kwargs = {"images": image, "text": "<image> def parse", "max_new_tokens": 12}
    expected = generator(**kwargs, generate_kwargs={"do_sample": False})
    prefills = []  # the engine's: it ran
    prefill = RaggedKVCache.prefill
    monkeypatch.setattr(RaggedKVCache, "prefill", lambda self, *a, **k: prefills.append(k) or prefill(self, *a, **k))
    hf_specdec.enable()
    try:
        assert generator(**kwargs, generate_kwargs={"do_sample": False, "spec_method": "ngram"}) == expected
    finally:
        hf_specdec.disable()
    assert len(prefills) == 1 and set(prefills[0]["multimodal"]) & {"pixel_values", "mm_encoder_outputs"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_images_on_a_gpu_in_bfloat16(arch):
    model, inputs = prompt(arch)
    model = model.to("cuda", torch.bfloat16)
    inputs = {name: value.to("cuda", torch.bfloat16) if value.is_floating_point() else value.to("cuda")
              for name, value in inputs.items()}
    kwargs = {"max_new_tokens": 16, "do_sample": False}
    expected = model.generate(**inputs, **kwargs)
    for method in ("ngram", "self_draft"):
        got = hf_specdec.generate(model, **inputs, **kwargs, **SPECULATIVE[method](model))
        assert got.device.type == "cuda"
        # bfloat16 kernels for k + 1 tokens may round differently from 1 token: near-ties can part
        assert (got == expected).float().mean().item() > 0.9, method


@pytest.mark.parametrize("arch", ["llava", "smolvlm", "gemma3"])
@pytest.mark.parametrize("method", ["ngram", "self_draft", "eagle"])
def test_a_conversation_goes_on_from_the_cache_with_a_new_image(arch, method):
    """The second turn brings another image: the new positions are encoded through the model's own input
    preparation and masks after the cached ones (Gemma-3's image tokens see each other both ways, read from the
    token types of the whole sequence), the image reaches them (another image gives another answer), and the output
    and the returned cache are plain `generate`'s."""
    model, inputs = prompt(arch)
    first = model.generate(**inputs, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    cache = getattr(first, CACHE_KWARG)
    image = MODELS[arch][1]
    ids = torch.cat([first.sequences, torch.tensor([[5, *image, 6, 7], [7, *image, 5, 6]])], dim=1)
    added = ids.shape[1] - inputs["input_ids"].shape[1]
    kwargs = {"attention_mask": torch.cat([inputs["attention_mask"], torch.ones(2, added, dtype=torch.long)], dim=1),
              "max_new_tokens": 8, "do_sample": False, "return_dict_in_generate": True,
              "pixel_values": inputs["pixel_values"].flip(0)}  # each row's image now the other row's
    for name in ("pixel_attention_mask", "image_sizes"):
        if name in inputs:
            kwargs[name] = inputs[name]
    if arch == "gemma3":
        kwargs["token_type_ids"] = (ids == IMAGE).long()
    expected = model.generate(ids, **{CACHE_KWARG: copy.deepcopy(cache)}, **kwargs)
    other = {**kwargs, "pixel_values": inputs["pixel_values"]}
    assert not torch.equal(model.generate(ids, **{CACHE_KWARG: copy.deepcopy(cache)}, **other).sequences,
                           expected.sequences), "the new image must matter"
    got = hf_specdec.generate(model, ids, **{CACHE_KWARG: copy.deepcopy(cache)}, **kwargs, **SPECULATIVE[method](model))
    assert torch.equal(got.sequences, expected.sequences)
    assert got.spec_stats.num_draft_tokens > 0
    assert_same_cache(got, expected, kwargs["attention_mask"])
