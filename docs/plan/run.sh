#!/usr/bin/env bash
# Regenerates every `meshlm plan` output quoted in docs/plan.md, into docs/plan/*.txt
# (tests/unit/test_docs_plan.py checks that docs/plan.md quotes them as they are).
# Run from the repository root: bash docs/plan/run.sh
set -u
cd "$(dirname "$0")/../.."
out=docs/plan
run() {  # run NAME ARGS...: "$ meshlm plan ARGS" then what it prints (stdout and stderr)
    local name=$1; shift
    { echo "\$ meshlm plan $*"; python -m meshlm.app.cli plan "$@" 2>&1; } > "$out/$name.txt"
}
big="model=llama3_70b layout=auto plan.devices=256 plan.max_memory_per_device=80GiB plan.profile=h100_nvlink_ib
 train.batch_size=256 train.seq_len=8192 train.param_dtype=bfloat16 plan.method=formula"
# shellcheck disable=SC2086
run 70b_none $big train.activation_checkpointing=none
# shellcheck disable=SC2086
run 70b_full $big train.activation_checkpointing=full plan.png=docs/plan_70b.png
run small_measured model=llama_small layout=auto plan.devices=4 plan.profile=cpu train.batch_size=16 \
    train.seq_len=1024 plan.top=3 plan.png=outputs/plan/small.png
