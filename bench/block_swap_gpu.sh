#!/bin/bash
# Block swap on one GPU (issue 33; docs/benchmarks.md): the tiny Flux's losses with memory.block_swap = 3 against 0,
# then Flux.1-dev size (LoRA, fp8 base, checkpointed) unswapped on a card capped to 24 GiB against block_swap = 28 on
# one capped to 12 GiB. Prints the losses and one JSON row per Flux.1-dev run (bench/capped_card.py).
#   OUT=runs/block_swap bash bench/block_swap_gpu.sh
# On the lent device machine, install the carried wheels first (see the session notes) and put them on PYTHONPATH.
set -u
OUT=${OUT:-runs/block_swap}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 examples/make_tiny_pipeline.py > $OUT/make.log 2>&1
T="--set pipeline.stages=1 --set adapter.type=\"lora\" --set memory.base_dtype=\"fp8\" --set train.max_steps=10 --set train.device=\"cuda\" --set checkpoint.every=0 --set output.save_weights=false --set output.sample_every_end=false --set observe.every=1"
for n in 0 3; do
  timeout 120 python3 -m diffpipe train examples/flux_tiny.toml $T --set memory.block_swap=$n --output-dir $OUT/tiny$n --overwrite > $OUT/tiny$n.log 2>&1
  echo "tiny swap $n rc=$?" >> $OUT/summary.txt
done
python3 - >> $OUT/summary.txt <<'PY'
import json, os
out = os.environ["OUT"]
for n in (0, 3):
    try:
        rows = [json.loads(l) for l in open(f"{out}/tiny{n}/metrics.jsonl")]
        print(n, [round(r["loss"], 5) for r in rows if "loss" in r])
    except Exception as e:
        print(n, "no metrics", e)
PY
F="--set pipeline.stages=1 --set pipeline.microbatches=1 --set train.batch_size=1 --set adapter.type=\"lora\" --set adapter.target_modules=[\"to_q\",\"to_k\",\"to_v\",\"to_out.0\"] --set train.max_steps=8 --set observe.every=1 --set output.save_weights=false --set train.device=\"cuda\" --set checkpoint.every=0 --set memory.base_dtype=\"fp8\" --set pipeline.checkpointing=\"all\""
timeout 260 python3 bench/capped_card.py --gib 12 --label fp8-ckpt-swap28-cap12 --out $OUT/rows.jsonl -- train examples/flux_dev.toml $F --set memory.block_swap=28 --output-dir $OUT/swap28 --overwrite > $OUT/swap28.log 2>&1
echo "swap28 rc=$?" >> $OUT/summary.txt
timeout 250 python3 bench/capped_card.py --gib 24 --label fp8-ckpt-cap24 --out $OUT/rows.jsonl -- train examples/flux_dev.toml $F --output-dir $OUT/noswap --overwrite > $OUT/noswap.log 2>&1
echo "noswap rc=$?" >> $OUT/summary.txt
cat $OUT/summary.txt $OUT/rows.jsonl
