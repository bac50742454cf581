"""benchmarks/drafter_generalization.py: acceptance summed per set and per Spec-Bench category, and its --folder
values (the measurements themselves need the real model; a smoke run on the test bed checks the sums)."""

from __future__ import annotations

import json

import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.testbed.loading import load_testbed


def test_a_set_is_the_sum_of_its_categories(benchmark_script):
    script = benchmark_script("drafter_generalization")
    tokenizer, target, _ = load_testbed(dtype=torch.float32)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, schedule="fixed")
    text = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    prompts = [("code", tokenizer(text).input_ids), ("prose", tokenizer("The cat sat on the").input_ids),
               ("code", tokenizer(text * 2).input_ids)]
    row = script.measure(target, tokenizer, config, prompts, max_new_tokens=12)
    parts = row["per_category"]
    assert list(parts) == ["code", "prose"]
    assert row["drafting_steps"] == sum(p["drafting_steps"] for p in parts.values()) > 0
    for name, part in [("all", row), *parts.items()]:
        assert len(part["accepted_at_position"]) == 3, name
        assert 1 <= part["mean_acceptance_length"] <= 4, name
    # the whole set's acceptance is the steps-weighted mean of its categories'
    weighted = sum(p["drafting_steps"] * (p["mean_acceptance_length"] - 1) for p in parts.values())
    assert row["mean_acceptance_length"] - 1 == pytest.approx(weighted / row["drafting_steps"])
    # one request alone: the same figures as the engine's own statistics for it
    out = hf_specdec.generate(target, torch.tensor([prompts[1][1]]), speculative=config, max_new_tokens=12,
                              do_sample=False, pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True)
    assert parts["prose"]["drafting_steps"] == out.spec_stats.num_drafts
    assert "per_category" not in script.measure(target, tokenizer, config, [(None, prompts[0][1])], 4)


def test_folder_values_are_checked(benchmark_script, tmp_path):
    script = benchmark_script("drafter_generalization")
    assert script.parse_folders([f"eagle3={tmp_path}"], ["eagle3", "draft"]) == {"eagle3": tmp_path}
    for value, message in (("eagle3", "expected KIND=PATH"), ("eagle3=", "expected KIND=PATH"),
                           ("medusa=/x", "not one of the --kinds measured")):
        with pytest.raises(SystemExit, match=message):
            script.parse_folders([value], ["eagle3"])
    with pytest.raises(SystemExit, match="a second folder for 'eagle3'"):
        script.parse_folders(["eagle3=/a", "eagle3=/b"], ["eagle3"])


def test_each_drafter_is_measured_on_requests_of_its_own_prompt_files(benchmark_script):
    script = benchmark_script("drafter_generalization")
    counts, files = script.train_settings()
    assert files["eagle"] == ("prompts.jsonl", "prompts_more.jsonl") and files["draft"] == ("prompts.jsonl",)
    tokenizer, _, _ = load_testbed(dtype=torch.float32)
    records = [json.loads(line)["text"] for name in files["eagle"]
               for line in (script.HERE / name).read_text().splitlines() if line.strip()]
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(0)).tolist()
    trained = {records[i] for i in order[: counts["eagle"]]}
    sets = script.request_sets(tokenizer, 3, ("trained", "held-out"), files["eagle"], counts["eagle"])
    texts = {name: [tokenizer.decode(ids) for _, ids in prompts] for name, prompts in sets.items()}
    assert all(text in trained for text in texts["trained"]) and not set(texts["held-out"]) & trained
    with pytest.raises(SystemExit, match="at most"):
        script.request_sets(tokenizer, len(records), ("held-out",), files["eagle"], counts["eagle"])


def test_head_window_reaches_the_heads_cache_and_stays_lossless(benchmark_script, monkeypatch):
    """--head-window N: the EAGLE head's own cache masks all but its last N positions; output stays plain's."""
    from hf_specdec.cache.ragged import AttentionLayout
    from hf_specdec.heads import EagleHead
    from hf_specdec.proposers.eagle import EagleDrafter
    from hf_specdec.testbed.loading import heads_dir

    script = benchmark_script("drafter_generalization")
    tokenizer, target, _ = load_testbed(dtype=torch.float32)
    monkeypatch.setattr(script.drafters, "load_drafter",
                        lambda model, kind, target, folder=None: EagleHead.from_pretrained(heads_dir(kind)).eval())
    config = script.config_for("eagle", target, head_window=4)
    assert AttentionLayout.from_model(EagleDrafter(config.heads, target)).sliding_window == 4
    assert AttentionLayout.from_model(EagleDrafter(script.config_for("eagle", target).heads, target)).sliding_window \
        is None
    ids = torch.tensor([tokenizer("def add(a, b):\n    return a + b\n\ndef mul(a, b):\n").input_ids])
    kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
    assert out.spec_stats.num_drafts > 0
    assert torch.equal(out.sequences, target.generate(ids, **kwargs))
