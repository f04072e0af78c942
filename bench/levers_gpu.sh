#!/bin/bash
# Issue 33, thirteenth session, on one GPU: (1) the checks torch 2.11 needs (plan of the SDXL example, a 2-stage CPU
# run through the launcher's fork server, a short GPU train); (2) Flux.1-dev
# LoRA with every memory setting left to the planner on a card capped to 12 GiB (what it chooses, and whether that
# trains there); (3) SDXL full fine-tune, 100 steps, AdamW moments in fp32 against 8 bits (peak and losses).
# PARTS="1 2 3" picks parts; 6: each unit's saved bytes counted against the GPU's, and the uncheckpointed Flux stage;
# 7: every measured peak against the planner on this torch; 8: Flux.1-dev LoRA's step profiled against the plain loop;
# 9: SDXL LoRA's host time (cProfile) in the plain loop and in diffpipe's step, fp32 base (row 3); 10: row 3 measured
# twice in one call, plain loop and diffpipe alternating; 11: train.optimizer (AdamW, Prodigy, Adafactor) on an SDXL
# UNet LoRA r16, one stage on CUDA: losses, samples/s and each one's optimizer time a step, and a Prodigy run resumed.
#   OUT=runs/levers bash bench/levers_gpu.sh
# On the lent device machine, install the carried wheels first (see the session notes) and put them on PYTHONPATH.
set -u
OUT=${OUT:-runs/levers}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PARTS=${PARTS:-"1 2 3"}
say() { echo "$*" >> $OUT/summary.txt; }
losses() { python3 -c "import json,sys; print([round(json.loads(l)['loss'], 4) for l in open(sys.argv[1]) if 'loss' in l])" "$1" 2>&1 | tail -1; }
if [[ " $PARTS " == *" 1 "* ]]; then
  [ -f examples/tiny/made-by.txt ] || python3 examples/make_tiny_pipeline.py > $OUT/make.log 2>&1
  timeout 120 python3 -m diffpipe plan examples/sdxl_unet.toml > $OUT/plan_sdxl.txt 2>&1; say "plan sdxl rc=$?"
  C="--set train.max_steps=3 --set checkpoint.every=0 --set output.save_weights=false --set output.sample_every_end=false"
  timeout 150 python3 -m diffpipe train examples/flux_tiny.toml $C --set pipeline.stages=2 --set train.device=\"cpu\" --output-dir $OUT/cpu2 --overwrite > $OUT/cpu2.log 2>&1
  say "tiny flux 2 stages cpu rc=$? losses $(losses $OUT/cpu2/metrics.jsonl)"
  timeout 150 python3 -m diffpipe train examples/flux_tiny.toml $C --set pipeline.stages=1 --set train.max_steps=10 --set train.device=\"cuda\" --output-dir $OUT/gpu1 --overwrite > $OUT/gpu1.log 2>&1
  say "tiny flux 1 stage cuda rc=$? losses $(losses $OUT/gpu1/metrics.jsonl)"
fi
if [[ " $PARTS " == *" 2 "* ]]; then
  A="--set pipeline.stages=1 --set pipeline.microbatches=1 --set train.batch_size=1 --set adapter.type=\"lora\" --set adapter.target_modules=[\"to_q\",\"to_k\",\"to_v\",\"to_out.0\"] --set train.max_steps=8 --set observe.every=1 --set output.save_weights=false --set train.device=\"cuda\" --set checkpoint.every=0 --set pipeline.checkpointing=\"all\" --set plan.memory_gib=12 --set memory.block_swap=\"auto\" --set memory.optimizer_state=\"auto\" --set memory.base_dtype=\"auto\" --set memory.quantise_if_needed=[\"fp8\",\"nf4\"]"
  timeout 200 python3 -m diffpipe plan examples/flux_dev.toml $A > $OUT/plan_auto12.txt 2>&1; say "plan flux-dev auto 12 GiB rc=$?"
  timeout 280 python3 bench/capped_card.py --gib 12 --label auto-ckpt-cap12 --out $OUT/rows.jsonl -- train examples/flux_dev.toml $A --output-dir $OUT/auto12 --overwrite > $OUT/auto12.log 2>&1
  say "flux-dev auto cap12 rc=$? chose: $(grep -i 'memory' $OUT/auto12.log | head -3 | tr '\n' ' ')"
fi
if [[ " $PARTS " == *" 3 "* ]]; then
  S="--set pipeline.stages=1 --set pipeline.microbatches=1 --set train.batch_size=4 --set train.max_steps=100 --set observe.every=10 --set train.device=\"cuda\" --set checkpoint.every=0 --set output.save_weights=false --set pipeline.checkpointing=\"all\" --set plan.memory_gib=139 --set train.learning_rate=1e-4"
  for state in fp32 8bit; do
    timeout 280 python3 bench/capped_card.py --gib 139 --skip 10 --label sdxl-full-$state --out $OUT/rows.jsonl -- train examples/sdxl_unet.toml $S --set memory.optimizer_state=\"$state\" --output-dir $OUT/sdxl-$state --overwrite > $OUT/sdxl-$state.log 2>&1
    say "sdxl full $state rc=$? losses $(losses $OUT/sdxl-$state/metrics.jsonl)"
  done
fi
if [[ " $PARTS " == *" 4 "* ]]; then
  F="--set pipeline.stages=2 --set pipeline.microbatches=4 --set train.batch_size=4 --set adapter.type=\"lora\" --set adapter.rank=16 --set adapter.alpha=16.0 --set adapter.target_modules=[\"to_q\",\"to_k\",\"to_v\",\"to_out.0\"] --set memory.base_dtype=\"bf16\" --set plan.memory_gib=24 --set plan.link_gbps=25"
  timeout 280 python3 bench/stage_probe.py examples/flux_dev.toml $F --gib 24 --repeats 2 > $OUT/flux_two_stages.jsonl 2> $OUT/flux_two_stages.err
  say "flux-dev lora 2 stages probed capped 24 rc=$?"
fi
if [[ " $PARTS " == *" 5 "* ]]; then
  timeout 60 python3 -m diffpipe plan examples/wan_14b.toml --world-size 4 --gpu-memory 24GiB > $OUT/plan_wan14b_4x24.txt 2>&1; say "plan wan14b 4x24 rc=$?"
  timeout 60 python3 -m diffpipe plan examples/wan_14b.toml --world-size 2 --gpu-memory 48GiB > $OUT/plan_wan14b_2x48.txt 2>&1; say "plan wan14b 2x48 rc=$?"
  for stage in ${WAN_STAGES:-0 3}; do
    timeout 280 python3 bench/stage_probe.py examples/wan_14b.toml --stage $stage --gib ${WAN_GIB:-24} --repeats 1 > $OUT/wan14b_stage$stage.jsonl 2> $OUT/wan14b_stage$stage.err
    say "wan14b 4x24 stage $stage probed capped ${WAN_GIB:-24} rc=$?"
  done
fi
if [[ " $PARTS " == *" 6 "* ]]; then  # what each unit saves, counted against the GPU (bench/unit_memory.py)
  L="--set adapter.type=\"lora\" --set adapter.rank=16 --set adapter.alpha=16.0 --set adapter.target_modules=[\"to_q\",\"to_k\",\"to_v\",\"to_out.0\"] --set memory.base_dtype=\"bf16\""
  timeout 200 python3 bench/unit_memory.py examples/flux_dev.toml $L --set train.batch_size=1 --set pipeline.microbatches=1 --set pipeline.stages=1 --units embed double.0 double.1 single.0 single.1 out --detail > $OUT/units_flux.jsonl 2> $OUT/units_flux.err; say "unit memory flux rc=$?"
  timeout 200 python3 bench/unit_memory.py examples/wan_14b.toml --units embed block.0 block.39 out --detail > $OUT/units_wan.jsonl 2> $OUT/units_wan.err; say "unit memory wan rc=$?"
  timeout 200 python3 bench/unit_memory.py examples/sdxl_unet.toml --set train.batch_size=4 --set pipeline.microbatches=1 --set pipeline.stages=1 --units down.1.0 down.2.0 mid.0 mid.1 up.0.0 up.0.up up.2.0 > $OUT/units_sdxl.jsonl 2> $OUT/units_sdxl.err; say "unit memory sdxl rc=$?"
  F="--set pipeline.stages=2 --set pipeline.microbatches=4 --set train.batch_size=4 $L --set plan.memory_gib=139 --set pipeline.split=[28] --set pipeline.checkpointing=[0]"
  timeout 280 python3 bench/stage_probe.py examples/flux_dev.toml $F --stage 1 --repeats 2 > $OUT/flux_stage1_unchecked.jsonl 2> $OUT/flux_stage1_unchecked.err
  say "flux-dev lora stage 1 unchecked probed rc=$?"
fi
if [[ " $PARTS " == *" 7 "* ]]; then
  timeout 150 python3 bench/planned_against_measured.py > $OUT/planned_against_measured.txt 2>&1; say "planned against measured rc=$?"
fi
if [[ " $PARTS " == *" 8 "* ]]; then
  timeout 330 python3 bench/profile_step.py examples/flux_dev.toml --batch 1 --lora 16 --steps 4 --top 25 --set memory.base_dtype=\"bf16\" > $OUT/profile_flux_lora.jsonl 2> $OUT/profile_flux_lora.err
  say "profile flux-dev lora bf16 rc=$?"
fi
if [[ " $PARTS " == *" 9 "* ]]; then
  timeout 300 python3 bench/lora_sdxl.py --ranks 16 --steps 12 --base-dtypes fp32 --host-profile > $OUT/host_profile_sdxl_lora.txt 2>&1
  say "host profile sdxl lora fp32 rc=$?"
fi
if [[ " $PARTS " == *" 10 "* ]]; then
  timeout 400 python3 bench/lora_sdxl.py --ranks 16,16 --steps 16 --skip-full --base-dtypes fp32 > $OUT/lora_sdxl_twice.jsonl 2> $OUT/lora_sdxl_twice.err
  say "sdxl lora fp32 twice rc=$?"
fi
if [[ " $PARTS " == *" 11 "* ]]; then
  O="--set adapter.type=\"lora\" --set adapter.rank=16 --set pipeline.stages=1 --set pipeline.microbatches=1 --set pipeline.split=[] --set pipeline.checkpointing=\"none\" --set train.batch_size=4 --set train.max_steps=12 --set checkpoint.every=6 --set output.save_weights=false --set train.device=\"cuda\" --set observe.every=1 --set observe.log_every=1 --set train.warmup_steps=0"
  for o in adamw:1e-4 prodigy:1.0 adafactor:1e-4; do
    timeout 150 python3 -m diffpipe train examples/sdxl_unet.toml $O --set train.optimizer=\"${o%%:*}\" --set train.learning_rate=${o#*:} --output-dir $OUT/opt_${o%%:*} --overwrite > $OUT/opt_${o%%:*}.log 2>&1
    say "sdxl lora ${o%%:*} cuda rc=$? losses $(losses $OUT/opt_${o%%:*}/metrics.jsonl)"
    python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])][4:]; print('  samples/s', round(sum(x.get('samples_per_s',0) for x in r)/max(1,len(r)),2))" $OUT/opt_${o%%:*}/metrics.jsonl >> $OUT/summary.txt 2>&1
    grep -o '"optimizer_s": [0-9.e-]*' $OUT/opt_${o%%:*}/stage_times.jsonl | tail -6 | tr '\n' ' ' >> $OUT/summary.txt; echo >> $OUT/summary.txt
  done
  rm -rf $OUT/opt_resumed && cp -r $OUT/opt_prodigy $OUT/opt_resumed && rm -rf $OUT/opt_resumed/checkpoints/step-00000012
  python3 -c "import json,sys; p=sys.argv[1]; rows=[l for l in open(p) if json.loads(l).get('step', 99) <= 7]; open(p,'w').writelines(rows)" $OUT/opt_resumed/metrics.jsonl
  timeout 150 python3 -m diffpipe train examples/sdxl_unet.toml $O --set train.optimizer=\"prodigy\" --set train.learning_rate=1.0 --resume $OUT/opt_resumed > $OUT/opt_resumed.log 2>&1
  say "sdxl lora prodigy resumed at 6 rc=$? losses $(losses $OUT/opt_resumed/metrics.jsonl)"
fi
cat $OUT/summary.txt $OUT/rows.jsonl $OUT/*.jsonl 2>/dev/null
