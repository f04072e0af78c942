#!/bin/bash
# Quantised LoRA bases on one GPU (issue 33; docs/benchmarks.md): the tiny Flux with memory.base_dtype int8 and nf4
# on CUDA (10 steps each), then Flux.1-dev size (LoRA r16, 1024^2, batch 1, checkpointed) with fp8 and int8 on a card
# capped to 24 GiB, nf4 on one capped to 12 GiB and nf4 with 30 blocks swapped on one capped to 8 GiB, one JSON row
# each (bench/capped_card.py). ROWS="nf4 12 0" runs only that row (base, GiB, memory.block_swap).
#   OUT=runs/quantised bash bench/quantised_base_gpu.sh
# On the lent device machine, install the carried wheels first (see the session notes) and put them on PYTHONPATH.
set -u
OUT=${OUT:-runs/quantised}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T="--set pipeline.stages=1 --set adapter.type=\"lora\" --set train.precision=\"bf16\" --set train.max_steps=10 --set train.device=\"cuda\" --set checkpoint.every=0 --set output.save_weights=false --set output.sample_every_end=false --set observe.every=1"
for base in $([ "${TINY:-1}" = 1 ] && echo bf16 int8 nf4); do  # TINY=0: the Flux.1-dev rows only
  timeout 70 python3 -m diffpipe train examples/flux_tiny.toml $T --set memory.base_dtype=\"$base\" --output-dir $OUT/tiny-$base --overwrite > $OUT/tiny-$base.log 2>&1
  echo "tiny $base rc=$? losses $(python3 -c "import json,sys; print([round(json.loads(l)['loss'], 4) for l in open(sys.argv[1])])" $OUT/tiny-$base/metrics.jsonl 2>&1 | tail -1)" >> $OUT/summary.txt
done
F="--set pipeline.stages=1 --set pipeline.microbatches=1 --set train.batch_size=1 --set adapter.type=\"lora\" --set adapter.target_modules=[\"to_q\",\"to_k\",\"to_v\",\"to_out.0\"] --set train.max_steps=8 --set observe.every=1 --set output.save_weights=false --set train.device=\"cuda\" --set checkpoint.every=0 --set pipeline.checkpointing=\"all\""
ROWS=${ROWS:-"nf4 12 0;int8 24 0;fp8 24 0;nf4 8 30"}
IFS=';' read -ra rows <<< "$ROWS"
for row in "${rows[@]}"; do
  set -- $row
  label=$1-ckpt-swap$3-cap$2
  timeout 200 python3 bench/capped_card.py --gib $2 --label $label --out $OUT/rows.jsonl -- train examples/flux_dev.toml $F --set memory.base_dtype=\"$1\" --set memory.block_swap=$3 --output-dir $OUT/$label --overwrite > $OUT/$label.log 2>&1
  echo "flux-dev $label rc=$?" >> $OUT/summary.txt
done
cat $OUT/summary.txt $OUT/rows.jsonl
