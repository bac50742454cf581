#!/usr/bin/env bash
# Everything that needs a GPU, in one command: the GPU-marked tests, the Triton tree-mask kernel against its
# reference, the engine's per-step overhead at 1B scale, packed grouped-query attention against transformers' sdpa,
# the real-model bench, the token-map A/B (SmolLM2's drafters over the whole vocabulary against their 8192-token
# maps), chains stopped on the drafter's confidence (draft_confidence), dynamic trees stopped once settled and token
# recycling's tree sizes (8 to 80 nodes, and "auto") beside n-gram lookup and auto; JSON under benchmarks/results/
# named after the device. `benchmarks/gpu.sh --smoke` runs every part at tiny sizes on the CPU (measures nothing).
# Details: benchmarks/gpu_suite.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec python benchmarks/gpu_suite.py "$@"
