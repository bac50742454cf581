"""The engine with speculation switched off (`disable_by_batch_size=1`) against transformers' plain generate on the
same batch: what a plain step and a call's own setup cost inside hf_specdec (the proposer's too: EAGLE-3 reads the
target's features at every forward and keeps its head's cache). SmolLM2-135M-Instruct in bf16, 1 thread, interleaved
repeats. Each case also prints its host time per target forward: wall time outside the target's forwards (timed by
forward hooks) over their number. `--adaptive` adds each method with the adaptive schedule on. `--target tiny`
swaps the model for a random Llama with SmolLM2's vocabulary (hidden 64, 2 layers) on the same prompts: its forwards
cost little, so the wall times compare the engine's own work per step with plain `generate`'s.

    python benchmarks/plain_step.py --prompts 16 --max-new-tokens 32 --repeats 3 --method ngram eagle3
    python benchmarks/plain_step.py --target tiny --prompts 4 --max-new-tokens 64 --repeats 10 --adaptive
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cli.runs import ForwardTimer
from hf_specdec.testbed.drafters import load_drafter
from hf_specdec.testbed.real_model import load_real_model
from hf_specdec.testbed.spec_bench import spec_bench_prompts

CATEGORIES = ["mt_bench", "qa", "math_reasoning", "translation"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--method", nargs="+", choices=["ngram", "eagle3"], default=["ngram"],
                        help="proposers to run with speculation off (eagle3: the committed SmolLM2 head)")
    parser.add_argument("--adaptive", action="store_true", help="also run each method with the adaptive schedule")
    parser.add_argument("--target", choices=["smollm2", "tiny"], default="smollm2",
                        help="tiny: a random Llama with SmolLM2's vocabulary, whose forwards cost little")
    args = parser.parse_args()
    if args.target == "tiny" and "eagle3" in args.method:
        parser.error("--target tiny: the EAGLE-3 head is SmolLM2's; run --method ngram")
    torch.set_num_threads(1)
    model, tokenizer = load_real_model("smollm2", dtype=torch.bfloat16)
    if args.target == "tiny":
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=model.config.vocab_size, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id)
        model = LlamaForCausalLM(config).eval().to(torch.bfloat16)
    tokenizer.padding_side = "left"
    per_category = -(-args.prompts // len(CATEGORIES))
    ids = [prompt_ids for _, prompt_ids in spec_bench_prompts(tokenizer, per_category, CATEGORIES)][: args.prompts]
    batch = tokenizer.pad({"input_ids": ids}, return_tensors="pt")
    kwargs = dict(attention_mask=batch["attention_mask"], max_new_tokens=args.max_new_tokens, do_sample=False,
                  pad_token_id=tokenizer.pad_token_id)
    cases = {"transformers": lambda: model.generate(batch["input_ids"], **kwargs)}
    for method in args.method:
        heads = {"heads": load_drafter("smollm2", "eagle3", model)} if method == "eagle3" else {}
        off = SpeculativeConfig(method="eagle" if method == "eagle3" else method, num_speculative_tokens=5,
                                disable_by_batch_size=1, **heads)
        cases[f"{method}, speculation off"] = functools.partial(hf_specdec.generate, model, batch["input_ids"],
                                                                speculative=off, **kwargs)
        if args.adaptive:
            on = SpeculativeConfig(method=off.method, num_speculative_tokens=5, **heads)
            cases[f"{method}, adaptive"] = functools.partial(hf_specdec.generate, model, batch["input_ids"],
                                                             speculative=on, **kwargs)
    for run in cases.values():  # warm-up
        run()
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    host: dict[str, list[float]] = {name: [] for name in cases}  # ms outside the target's forwards, per forward
    for _ in range(args.repeats):
        for name, run in cases.items():
            timer = ForwardTimer(model)
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
            timer.close()
            host[name].append(1000 * (seconds[name][-1] - timer.seconds) / max(timer.calls, 1))
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    for name, times in seconds.items():
        print(f"{name}: {', '.join(f'{t:.2f}' for t in times)} s; host time {statistics.median(host[name]):.2f} ms "
              "per target forward")
    for name in cases:
        if name != "transformers":
            print(f"batch {len(ids)}: hf_specdec {name} runs at {medians['transformers'] / medians[name]:.3f}x "
                  "transformers' plain generate")


if __name__ == "__main__":
    main()
