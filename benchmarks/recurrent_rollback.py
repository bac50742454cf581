"""What rolling back recurrent layers costs: the share of a speculative call spent keeping the states before each
step and running the recurrent mixers again over the kept tokens (`hf_specdec.cache.recurrent`).

The model is a random Qwen3.5-style hybrid at SmolLM2-135M's width (hidden 576, 24 layers, three gated-delta-net
layers to one attention layer, vocabulary 49152): no hybrid model's weights can be had offline here, and the cost of
the rollback depends on the shapes, not the weights. A one-layer random draft model drafts k tokens at every step
(fixed k), and the target rejects nearly all of them, so every step rolls its rows back to their first token: the
worst case. Each row of the table is one setting of `MAX_PENDING_TOKENS` (0: the mixers run again at every commit;
else the kept tokens' inputs wait for the next forward, see `RecurrentRollback`), over `--calls` calls with the
settings, plain `generate` and the default adaptive schedule (which stops drafting where it does not pay) interleaved:
the median call time, plain `generate`'s, the adaptive schedule's, and the median time inside the
rollback's own calls (state copies, and mixers run at the commit; inputs fed with the next forward cost inside that
forward, so compare the calls' times). The verify forward's cost at the same width and a one-token forward's are
timed apart (medians of `--repeats`).

    python benchmarks/recurrent_rollback.py --batch-sizes 1 4 --dtype bfloat16 --max-pending 0 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cache import recurrent

RESULTS = Path(__file__).parent / "results"
VOCAB = 49152  # SmolLM2's


def hybrid_model(dtype: torch.dtype, smoke: bool = False) -> torch.nn.Module:
    """The benchmark's hybrid; `smoke`: a tiny one of the same layout (4 layers, hidden 64) for a quick check."""
    torch.manual_seed(0)
    layers = 4 if smoke else 24
    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64 if smoke else 576, intermediate_size=128 if smoke else 1536,
        num_hidden_layers=layers, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64,
        linear_value_head_dim=64, max_position_embeddings=2048, pad_token_id=0, eos_token_id=None,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)])
    return transformers.Qwen3_5ForCausalLM(config).eval().to(dtype)


class RollbackTimer:
    """Wall time inside RecurrentRollback.begin and .commit (the state copies and the mixers' second run)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.steps = 0
        begin, commit = recurrent.RecurrentRollback.begin, recurrent.RecurrentRollback.commit
        timer = self

        def timed_begin(self, *args, **kwargs):
            start = time.perf_counter()
            begin(self, *args, **kwargs)
            timer.seconds += time.perf_counter() - start

        def timed_commit(self, *args, **kwargs):
            start = time.perf_counter()
            timer.steps += any(width > 1 for _, _, width in self.forwards)  # a step that drafted
            commit(self, *args, **kwargs)
            timer.seconds += time.perf_counter() - start

        self.originals = begin, commit
        recurrent.RecurrentRollback.begin = timed_begin
        recurrent.RecurrentRollback.commit = timed_commit

    def close(self) -> None:
        """Put the rollback's methods back."""
        recurrent.RecurrentRollback.begin, recurrent.RecurrentRollback.commit = self.originals


def forward_ms(model, batch: int, width: int, context: int, repeats: int) -> float:
    """Median ms of a forward over `width` new tokens after `context` cached ones (plain transformers cache)."""
    ids = torch.randint(3, 1000, (batch, context + width), generator=torch.Generator().manual_seed(1))
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            cache = transformers.DynamicCache(config=model.config)
            model(ids[:, :context], cache=cache, use_cache=True)
            start = time.perf_counter()
            model(ids[:, context:], cache=cache, use_cache=True)
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure(args: argparse.Namespace, model, draft, timer: RollbackTimer, default_pending: int) -> list[dict]:
    """One row per batch size and MAX_PENDING_TOKENS setting (see the module docstring)."""
    rows = []
    for batch in args.batch_sizes:
        prompts = torch.randint(3, 1000, (batch, 64), generator=torch.Generator().manual_seed(2))
        config = SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=args.k, schedule="fixed")
        hf_specdec.generate(model, prompts, speculative=config, max_new_tokens=8, do_sample=False)  # warm-up
        runs: dict[int, list[tuple[float, float, int]]] = {value: [] for value in args.max_pending}
        adaptive_config = SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=args.k)
        plain, adaptive = [], []
        for _ in range(args.calls):  # the settings in turn, so the machine's drift falls on all of them
            start = time.perf_counter()
            model.generate(prompts, max_new_tokens=args.max_new_tokens, do_sample=False)
            plain.append(time.perf_counter() - start)
            recurrent.MAX_PENDING_TOKENS = default_pending
            start = time.perf_counter()
            hf_specdec.generate(model, prompts, speculative=adaptive_config, max_new_tokens=args.max_new_tokens,
                                do_sample=False)
            adaptive.append(time.perf_counter() - start)
            for max_pending in args.max_pending:
                recurrent.MAX_PENDING_TOKENS = max_pending
                timer.seconds, timer.steps = 0.0, 0
                start = time.perf_counter()
                hf_specdec.generate(model, prompts, speculative=config, max_new_tokens=args.max_new_tokens,
                                    do_sample=False)
                runs[max_pending].append((time.perf_counter() - start, timer.seconds, timer.steps))
        verify = forward_ms(model, batch, args.k + 1, prompts.shape[1], args.repeats)
        one = forward_ms(model, batch, 1, prompts.shape[1], args.repeats)
        for max_pending, measured in runs.items():
            call = statistics.median(m[0] for m in measured)
            rollback = statistics.median(m[1] for m in measured)
            steps = measured[0][2]
            row = {
                "batch_size": batch,
                "max_pending_tokens": max_pending,
                "call_s_median": round(call, 3),
                "call_s": [round(m[0], 3) for m in measured],
                "plain_generate_s_median": round(statistics.median(plain), 3),
                # the default adaptive schedule, which stops drafting where it does not pay
                "adaptive_call_s_median": round(statistics.median(adaptive), 3),
                "rollback_at_commit_s_median": round(rollback, 3),
                "rollback_at_commit_share": round(rollback / call, 4),
                "steps_with_draft": steps,
                "rollback_at_commit_ms_per_step": round(1000 * rollback / max(steps, 1), 2),
                "verify_forward_ms": round(verify, 2),
                "one_token_forward_ms": round(one, 2),
            }
            rows.append(row)
            print(json.dumps(row, sort_keys=True))
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5, help="forwards timed for the forward costs")
    parser.add_argument("--calls", type=int, default=3, help="calls per setting, the settings interleaved")
    parser.add_argument("--max-pending", type=int, nargs="+", default=[recurrent.MAX_PENDING_TOKENS],
                        help="MAX_PENDING_TOKENS values to run, each in turn per batch size (0: the mixers run again "
                             "at every commit)")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="a tiny model of the same layout: checks the script runs")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    hf_specdec.enable()
    model = hybrid_model(getattr(torch, args.dtype), args.smoke)
    draft = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=0)).eval().to(model.dtype)
    timer = RollbackTimer()
    default_pending = recurrent.MAX_PENDING_TOKENS
    try:
        rows = measure(args, model, draft, timer, default_pending)
    finally:
        timer.close()
        recurrent.MAX_PENDING_TOKENS = default_pending
    layout = "hidden 64, 4 layers (3 gated delta net, 1 attention)" if args.smoke else \
        "hidden 576, 24 layers (18 gated delta net, 6 attention)"
    result = {"model": f"random Qwen3.5-style hybrid, {layout}",
              "drafter": "random one-layer Llama draft, hidden 64",
              "dtype": args.dtype, "k": args.k, "max_new_tokens": args.max_new_tokens,
              "torch": torch.__version__, "transformers": transformers.__version__, "rows": rows}
    output = args.output or RESULTS / f"recurrent_rollback_{args.dtype}_cpu.json"
    output.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"wrote {output}")
    return result


if __name__ == "__main__":
    main()
