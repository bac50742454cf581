"""The engine's per-step overhead against the bare target forward it wraps.

A random Llama (1B scale by default: hidden 2048, 16 layers, 32 heads, 8 KV heads, vocabulary 32000; bf16 on CUDA)
and a forced-acceptance draft: a proposer that offers each row the target's own greedy continuation (computed
once with plain `generate`), so drafts are accepted and a speculative step is exactly one verify forward of
k + 1 tokens plus the engine's own work. In half precision a (k + 1)-token forward can round a near-tie
differently from the one-token forward that wrote the continuation; that row's later drafts are then rejected,
which changes nothing timed under the fixed schedule (every step still verifies k + 1 tokens per row), and the
share of drafts accepted is reported beside the times. Each case runs with `schedule="fixed"` and with the adaptive
schedule, the default, whose host work each step (its estimates and decision, a timing of the step) is part of the
overhead users meet; with drafts always accepted it drafts k tokens but for the plain steps it takes now and then to
measure a plain step's time, which count as steps too. Per mode (eager; static shapes compiled with transformers'
`CompileConfig`, `mode="reduce-overhead"` = CUDA graphs on CUDA):

- step: hf_specdec's time per verify step, from two runs of different lengths (the difference cancels the prefill
  and the setup), median over repeats;
- forward: the bare target forward of the same k + 1 tokens per row on a cache of the same length (transformers'
  own StaticCache, compiled the same way), median over repeats;
- overhead = step / forward - 1: the share of a step spent outside the target forward. Goal on a GPU: <= 10%;
- ops/step (eager only): the aten operations the engine dispatches per verify step outside the target forward and
  the proposer (counted by a `TorchDispatchMode`, from the same two run lengths): each is a kernel launch or at
  least a dispatch, whatever the device, so this count is what the step's host time scales with where launches
  bound a step (a GPU).

    python benchmarks/step_overhead.py [--batch-size 1 8] [-k 4] [--json out.json]
    python benchmarks/step_overhead.py --smoke   # tiny sizes on the CPU: checks that it runs, measures nothing
    python benchmarks/step_overhead.py --tiny --batch-size 1 --modes eager   # the host work per step

With `--tiny` the model is the smoke run's (2 layers, hidden 64), whose forward takes about a millisecond on a CPU,
so that step_ms - forward_ms reads the engine's own work per step in milliseconds, on whatever device runs it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM, StaticCache

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cache.naming import CACHE_KWARG
from hf_specdec.cli.environment import environment, write_report
from hf_specdec.proposers import base
from hf_specdec.step import DecodeState, Proposal

ONE_B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=32000)
SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)
GOAL_OVERHEAD = 0.10


class OracleProposer(base.Proposer):
    """Proposes each row's next k tokens of a precomputed greedy output: every draft is accepted."""

    def __init__(
        self,
        # [B, L]: the target's greedy output, prompt included
        sequences: torch.Tensor,
        k: int,
    ) -> None:
        self.sequences, self.k = sequences, k

    def propose(self, state: DecodeState) -> Proposal:
        columns = (state.lengths[:, None] + torch.arange(self.k, device=state.lengths.device))
        drafts = self.sequences.gather(1, columns.clamp(max=self.sequences.shape[1] - 1))
        budget = state.draft_budget().clamp(max=self.k)
        dense = all(b >= self.k for b in state.host_draft_budget())
        return Proposal.chain(state.last_tokens(), drafts, budget, dense=dense)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def speculative_seconds(target, prompts, oracle, k: int, new_tokens: int, compile_config,
                        schedule: str = "fixed") -> tuple[float, int, float]:
    """(seconds, verify steps, share of drafts accepted) of one hf_specdec call with the oracle proposer."""
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k, schedule=schedule)
    factory = lambda *_: OracleProposer(oracle, k)  # noqa: E731
    extra = {} if compile_config is None else dict(compile_config=compile_config)
    with mock.patch.dict(base._REGISTRY, {"ngram": factory}):
        sync(target.device)
        start = time.perf_counter()
        out = hf_specdec.generate(target, prompts, speculative=config, max_new_tokens=new_tokens, do_sample=False,
                                  eos_token_id=None, use_cache=False, return_dict_in_generate=True, **extra)
        sync(target.device)
    seconds, stats = time.perf_counter() - start, out.spec_stats
    return seconds, stats.target_forward_passes - 1, stats.num_accepted_tokens / max(stats.num_draft_tokens, 1)


def bare_forward_seconds(target, prompts, k: int, context: int, compile_config, repeats: int) -> float:
    """Median time of the target's forward over k + 1 new tokens per row after `context` cached ones."""
    batch = prompts.shape[0]
    cache = StaticCache(config=target.config, max_cache_len=context + k + 1)
    prefix = torch.randint(3, target.config.vocab_size, (batch, context), device=target.device)
    with torch.no_grad():
        target(prefix, **{CACHE_KWARG: cache}, use_cache=True)
        forward = target.forward
        if compile_config is not None:
            options = compile_config.to_dict()
            if target.device.type != "cuda" and options.get("mode") == "reduce-overhead":
                options["mode"] = None
            forward = torch.compile(target.forward, **{**options, "dynamic": False})
        new = torch.randint(3, target.config.vocab_size, (batch, k + 1), device=target.device)
        position = torch.arange(context, context + k + 1, device=target.device)
        times = []
        for _ in range(repeats + 2):  # two warm-ups (the compile, the CUDA graph capture)
            for layer in cache.layers:  # write the same k + 1 slots after the context every time
                layer.cumulative_length.fill_(context)
            sync(target.device)
            start = time.perf_counter()
            forward(input_ids=new, position_ids=position[None].expand(batch, -1), **{CACHE_KWARG: cache},
                    use_cache=True)
            sync(target.device)
            times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched outside the target's forwards (its forward hooks pause the count) and the
    forced-acceptance proposer's (a real proposer's ops depend on the method): the engine's own tensor operations,
    each a kernel launch or at least a dispatch on any device."""

    def __init__(self, target: torch.nn.Module) -> None:
        super().__init__()
        self.count, self.inside = 0, 0
        self.hooks = [target.register_forward_pre_hook(lambda *_: self.shift(1)),
                      target.register_forward_hook(lambda *_: self.shift(-1))]

    def shift(self, by: int) -> None:
        """Enter (1) or leave (-1) a stretch whose ops are not counted."""
        self.inside += by

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def counted_run(target, prompts, oracle, k: int, new_tokens: int, schedule: str) -> tuple[int, int]:
    """(aten ops outside the target forward and the proposer, verify steps) of one eager hf_specdec call."""
    counter, propose = OpCounter(target), OracleProposer.propose

    def paused(proposer, state):
        counter.shift(1)
        try:
            return propose(proposer, state)
        finally:
            counter.shift(-1)

    try:
        with counter, mock.patch.object(OracleProposer, "propose", paused):
            _, steps, _ = speculative_seconds(target, prompts, oracle, k, new_tokens, None, schedule)
    finally:
        counter.remove()
    return counter.count, steps


def ops_per_step(target, prompts, oracle, k: int, new_tokens: tuple[int, int], schedule: str) -> float:
    """aten ops per verify step outside the target forward and the proposer, from two runs of different lengths."""
    (short_ops, short_steps), (long_ops, long_steps) = (counted_run(target, prompts, oracle, k, length, schedule)
                                                        for length in new_tokens)
    return (long_ops - short_ops) / (long_steps - short_steps)


def measure(target, prompts, k: int, new_tokens: tuple[int, int], compile_config, repeats: int,
            schedules: tuple[str, ...] = ("fixed",)) -> list[dict]:
    """One case per schedule: its step time, the bare forward's (measured once), and the overhead."""
    with torch.no_grad():
        oracle = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens[1] + k,
                                 do_sample=False, eos_token_id=None)
    context = prompts.shape[1] + (new_tokens[0] + new_tokens[1]) // 2
    forward = bare_forward_seconds(target, prompts, k, context, compile_config, repeats)
    cases = []
    for schedule in schedules:
        per_step, accepted = [], []
        for _ in range(repeats + 1):  # the first round warms up (and compiles)
            short = speculative_seconds(target, prompts, oracle, k, new_tokens[0], compile_config, schedule)
            long = speculative_seconds(target, prompts, oracle, k, new_tokens[1], compile_config, schedule)
            per_step.append((long[0] - short[0]) / (long[1] - short[1]))
            accepted.append(long[2])
        step = statistics.median(per_step[1:])
        ops = None if compile_config is not None else ops_per_step(target, prompts, oracle, k, new_tokens, schedule)
        cases.append({"schedule": schedule, "step_ms": 1000 * step, "forward_ms": 1000 * forward, "ops_per_step": ops,
                      "overhead": step / forward - 1, "repeats_step_ms": [1000 * s for s in per_step[1:]],
                      "accepted_share": min(accepted)})
    return cases


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    parser.add_argument("-k", type=int, default=4, help="draft tokens per step (default 4)")
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, nargs=2, default=[32, 160], help="the two run lengths")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--schedule", nargs="+", choices=["fixed", "adaptive"], default=["fixed", "adaptive"],
                        help="the step schedules to measure (default both)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (checks that it runs)")
    parser.add_argument("--tiny", action="store_true", help="the smoke run's tiny model, full runs and repeats")
    parser.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    parser.add_argument("--json", type=Path, help="write the results here, as JSON")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = SMOKE if args.smoke or args.tiny else ONE_B
    if args.smoke:
        args.batch_size, args.prompt_length, args.new_tokens, args.repeats = [1, 2], 8, [4, 8], 1
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**sizes, max_position_embeddings=4096)).to(device, dtype).eval()
    parameters = sum(p.numel() for p in target.parameters())
    # the smoke run checks the compiled path's plumbing without inductor's C++ build
    compile_config = CompileConfig(fullgraph=True, backend="eager" if args.smoke else "inductor")
    cases = []
    print(f"{environment(device, dtype)['gpu'] or 'CPU'}: random Llama, {parameters / 1e9:.2f}B parameters, k={args.k}")
    print(f"{'mode':>9} {'batch':>5} {'schedule':>9} {'step ms':>8} {'forward ms':>10} {'overhead':>8} {'accepted':>8} "
          f"{'ops/step':>8}")
    configs = {"eager": None, "compiled": compile_config}
    for mode in args.modes:
        config = configs[mode]
        for batch in args.batch_size:
            prompts = torch.randint(3, sizes["vocab_size"], (batch, args.prompt_length), device=device)
            for measured in measure(target, prompts, args.k, tuple(args.new_tokens), config, args.repeats,
                                    tuple(args.schedule)):
                case = {"mode": mode, "batch": batch, **measured}
                cases.append(case)
                print(f"{mode:>9} {batch:>5} {case['schedule']:>9} {case['step_ms']:>8.3f} {case['forward_ms']:>10.3f} "
                      f"{case['overhead']:>7.1%} {case['accepted_share']:>8.1%} "
                      f"{'-' if case['ops_per_step'] is None else format(case['ops_per_step'], '.1f'):>8}")
    write_report(args, cases, device, dtype, parameters=parameters)
    return cases


if __name__ == "__main__":
    main()
