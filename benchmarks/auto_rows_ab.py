"""`method="auto"` choosing per row against one candidate per step, interleaved in one bench run.

    python benchmarks/auto_rows_ab.py --model smollm2 --dtype bfloat16 --workload spec-bench \
        --categories mt_bench translation qa math_reasoning --method plain ngram auto+eagle3 auto+eagle3~step \
        --batch-size 4 -k 5 --num-prompts 8 --max-new-tokens 64 --threads 1 --repeats 3 --json ...

is `hf-specdec bench` with one more case per auto case, `<auto case>~step` (`auto~step`, `auto+eagle3~step`, ...):
the same config, but every row of a step drafts with the step's candidate (the schedule's riders, the host lookups
drafting for the rows where they offer more, are switched off), as `method="auto"` chose before it chose per row.
The two run in the same interleaved rounds, so their ratio is not the machine's noise between runs.
"""

from __future__ import annotations

import sys
import weakref

import hf_specdec.cli.bench as bench
from hf_specdec.cli.main import main
from hf_specdec.schedule import controller

PER_STEP = "~step"
# the suffix caches of the per-step cases' configs (each config has its own): how a schedule knows its config is one
_PER_STEP_CACHES: weakref.WeakSet = weakref.WeakSet()


def register_cases() -> None:
    """Add `<case>~step` for every auto case to the bench's cases, and make their schedules choose per step."""
    variants = {f"{case}{PER_STEP}": case for case in ("auto", *bench.AUTO_CASES)}
    bench.CASES = bench.CASES + tuple(variants)
    bench.SCHEDULED_CASES = bench.SCHEDULED_CASES + tuple(variants)
    for variant, case in variants.items():
        if case in bench.AUTO_CASES:
            bench.AUTO_CASES[variant] = bench.DRAFTER_OF[variant] = bench.AUTO_CASES[case]
    make_config = bench._speculative_config

    def config_for(case: str, *args, **kwargs):
        config = make_config(variants.get(case, case), *args, **kwargs)
        if case in variants:
            _PER_STEP_CACHES.add(config.suffix_cache)
        return config

    bench._speculative_config = config_for
    start = controller.Schedule.__init__
    riders = controller.Schedule.riders

    def schedule_init(self, config, *args, **kwargs):
        start(self, config, *args, **kwargs)
        self.per_step = config.suffix_cache is not None and config.suffix_cache in _PER_STEP_CACHES

    controller.Schedule.__init__ = schedule_init
    controller.Schedule.riders = lambda self, method, candidates: [] if self.per_step else riders(
        self, method, candidates)


if __name__ == "__main__":
    register_cases()
    sys.exit(main(["bench", *sys.argv[1:]]))
