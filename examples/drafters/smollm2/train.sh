#!/usr/bin/env bash
# Train every committed drafter of SmolLM2-135M-Instruct, as committed in this folder:
#
#     bash examples/drafters/smollm2/train.sh [draft|medusa|eagle|eagle3|mlp_speculator ...]   (default: all five)
#
# The target writes its own answers to the prompts of prompts.jsonl once (greedy, up to 192 tokens, bfloat16); every
# trainer reads those rows and the target's cached features (EAGLE-1/2, Medusa, the draft and the MLP speculator share
# the final hidden states, EAGLE-3 has its fused layers), so only the first run pays for them. The heads (EAGLE,
# Medusa) and the MLP speculator also learn from prompts_more.jsonl (more requests written the same way, none of
# prompts.jsonl's; the draft, trained on them too, drafted no better on Spec-Bench); a run over more prompts takes the answers an
# earlier run in $WORK already generated (`--reuse-generated`) and generates the others.
# Work files go to $WORK (default
# ~/.cache/hf_specdec/smollm2-drafters, several GB); each drafter lands in $WORK/<kind> with train_metrics.json,
# and is copied here in bfloat16. THREADS (default 2) sets the torch threads; NUM_SAMPLES how many prompts of
# its prompt files (a seeded sample of them) the target answers for every drafter (default: each drafter's own count
# in SAMPLES below; drafters trained on the same files and count share the answers and features).
set -euo pipefail
cd "$(dirname "$0")/../../.."
HERE=examples/drafters/smollm2
WORK=${WORK:-$HOME/.cache/hf_specdec/smollm2-drafters}
THREADS=${THREADS:-2}
BASE=$(python -c "from hf_specdec.testbed.real_model import ensure_smollm2; print(ensure_smollm2())")
declare -A SAMPLES=([eagle3]=5225 [eagle]=5225 [medusa]=5225 [draft]=3139 [mlp_speculator]=5225)
# each drafter's prompt files (default: prompts.jsonl)
declare -A PROMPTS=([eagle3]="prompts.jsonl prompts_more.jsonl" [eagle]="prompts.jsonl prompts_more.jsonl"
                   [medusa]="prompts.jsonl prompts_more.jsonl"
                   [mlp_speculator]="prompts.jsonl prompts_more.jsonl")

# The EAGLE-1/2 head starts from scratch: a copy of the target's last layer (the trainer's default) writes values far
# larger than the final normed hidden state the head regresses, and from it training diverged (cross-entropy 273 at
# step 1, top-1 agreement 0.00 after 90 steps). EAGLE-3 normalises its output and starts from the copy.
train() {  # kind, then the trainer's own options
    local kind=$1
    shift
    python -m hf_specdec.cli train "$@" --out "$WORK/$kind"
}
common() {  # the options every trainer takes, for a drafter trained on $1 answers to the prompt files $2
    local files=() name=$1 earlier
    for file in $2; do files+=("$HERE/$file"); done
    [[ $2 == prompts.jsonl ]] || name=$1_$(echo "$2" | tr ' ' '+' | sed 's/\.jsonl//g')
    COMMON=(--base "$BASE" --data "${files[@]}" --prompt-records --num-samples "$1" --max-new-tokens 192
            --seq-len 512 --generate-batch-size 64 --generated-data "$WORK/generated_data_$name.safetensors"
            --target-dtype bfloat16 --mixed-precision bf16 --threads "$THREADS" --save-every 100)
    earlier=$(ls "$WORK"/generated_data_*.safetensors 2>/dev/null || true)
    [[ -z $earlier ]] || COMMON+=(--reuse-generated $earlier)
    FINAL=(--feature-cache "$WORK/features_final_$name")
    FUSED=(--feature-cache "$WORK/features_eagle3_$name")
}

for kind in "${@:-eagle3 eagle medusa draft mlp_speculator}"; do
    for one in $kind; do
        begin=$SECONDS
        RESUMED_AT=
        samples=${NUM_SAMPLES:-${SAMPLES[$one]:-640}}
        common "$samples" "${PROMPTS[$one]:-prompts.jsonl}"
        case $one in
            eagle3) train eagle3 eagle "${COMMON[@]}" "${FUSED[@]}" --version eagle3 --draft-vocab-size 8192 \
                        --ttt-steps 4 --steps 2400 --batch-size 8 --learning-rate 1e-3 --warmup-steps 120 \
                        --eval-rows 64 --eval-every 400 ;;
            eagle) EAGLE=(eagle eagle "${COMMON[@]}" "${FINAL[@]}" --version eagle --no-init-from-target
                          --token-map-size 8192 --batch-size 8 --learning-rate 1e-3 --warmup-steps 250 --eval-rows 64
                          --eval-every 500)
                   # 5000 steps, then a rerun with more steps resumes the checkpoint at step 5000, its decay stretched
                   # to 9000 steps (held-out top-1 agreement 0.668 at step 5000, 0.692 at 9000)
                   train "${EAGLE[@]}" --steps 5000
                   train "${EAGLE[@]}" --steps 9000
                   RESUMED_AT=5000 ;;
            medusa) train medusa medusa "${COMMON[@]}" "${FINAL[@]}" --num-heads 4 --shared-lm-head \
                        --token-map-size 8192 --steps 3000 --batch-size 8 --learning-rate 1e-3 --warmup-steps 150 \
                        --tree-nodes 6 --eval-rows 64 --eval-every 500 ;;
            draft) train draft draft "${COMMON[@]}" "${FINAL[@]}" --target-layers 0 1 -1 --token-map-size 8192 \
                       --steps 1500 --batch-size 8 --learning-rate 3e-4 --warmup-steps 75 --eval-rows 64 \
                       --eval-every 500 ;;
            mlp_speculator) train mlp_speculator mlp_speculator "${COMMON[@]}" "${FINAL[@]}" --n-predict 3 \
                                --inner-dim 1024 --no-tie-weights --shared-vocab --token-map-size 8192 --steps 3000 \
                                --batch-size 8 --learning-rate 1e-3 --warmup-steps 100 --eval-rows 64 \
                                --eval-every 250 ;;
            *) echo "unknown drafter $one (expected draft, medusa, eagle, eagle3, mlp_speculator)" >&2; exit 2 ;;
        esac
        python "$HERE/publish.py" "$WORK/$one" "$HERE/$one" "$one" "$(( (SECONDS - begin) / 60 ))" ${RESUMED_AT:-}
    done
done
