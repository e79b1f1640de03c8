#!/usr/bin/env bash
# The sweep shown in docs/train.md ("Ablations: what a sweep reports"): llama_tiny under
# three layouts on two 4-rank meshes, 20 steps each, on CPU.  Regenerates docs/sweep/
# (summary.md, summary.csv, summary.png, curves.png) from a fresh sweep directory.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="$(mktemp -d)/sweep"
meshlm train -m model=llama_tiny layout=ddp,fsdp,tp mesh=fsdp4,fsdp2_tp2 \
    train.steps=20 train.seq_len=64 train.batch_size=16 train.warmup_steps=4 \
    train.val_every=10 train.val_batches=2 train.progress=false "hydra.sweep.dir=$out" || true
cp "$out"/summary.md "$out"/summary.csv "$out"/summary.png "$out"/curves.png docs/sweep/
echo "docs/sweep/ regenerated from $out"
