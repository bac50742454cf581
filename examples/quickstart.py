"""Quickstart: speculative decoding on the committed test bed, three ways of asking for it.

Run from the repository root: python examples/quickstart.py
"""

import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.testbed.loading import load_testbed
from hf_specdec.testbed.workloads import load_workload


def main() -> None:
    tokenizer, target, draft = load_testbed()
    tokenizer.padding_side = "left"
    batch = tokenizer(load_workload("edit")[:3], return_tensors="pt", padding=True)
    kwargs = dict(attention_mask=batch["attention_mask"], max_new_tokens=48, do_sample=False)

    plain = target.generate(batch["input_ids"], **kwargs)

    hf_specdec.enable()
    config = SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=5)
    with_draft = target.generate(batch["input_ids"], speculative=config, **kwargs)
    with_lookup = target.generate(batch["input_ids"], spec_method="ngram", return_dict_in_generate=True, **kwargs)
    hf_specdec.disable()

    assert torch.equal(with_draft, plain) and torch.equal(with_lookup.sequences, plain)
    new_tokens = plain[:, batch["input_ids"].shape[1] :]
    print(tokenizer.decode(new_tokens[0], skip_special_tokens=True))

    stats = with_lookup.spec_stats
    emitted = (new_tokens != tokenizer.pad_token_id).sum(dim=1).tolist()  # new tokens per row
    per_forward = [tokens / row.target_forward_passes for tokens, row in zip(emitted, stats.per_row)]
    print(f"n-gram: {stats.acceptance_rate:.0%} of the drafted tokens accepted")
    print(f"  tokens per target forward, per row: {' '.join(f'{value:.2f}' for value in per_forward)}"
          "  (new tokens / target forwards the row took part in, prefill included)")
    print(f"  mean acceptance length: {stats.mean_acceptance_length:.2f}"
          "  (1 + accepted tokens per drafting step; leaves out the prefill and steps without a match)")


if __name__ == "__main__":
    main()
