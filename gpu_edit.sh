set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" > $OUT/versions.txt 2>&1
python3 -c "import torchvision; print(torchvision.__version__)" >> $OUT/versions.txt 2>&1
python3 -m diffpipe plan examples/sdxl_unet.toml > $OUT/plan_sdxl.txt 2>&1
python3 -m diffpipe train examples/qwen_image_edit_tiny.toml --set train.max_steps=20 --set pipeline.stages=1 --set 'train.device="cuda"' --set checkpoint.every=0 --output-dir /tmp/qe --overwrite > $OUT/tiny_edit_cuda.txt 2>&1
python3 -m diffpipe plan examples/qwen_image_edit_lora.toml --gpu-memory 48GiB --world-size 2 > $OUT/plan_edit_48x2.txt 2>&1
python3 -m diffpipe plan examples/qwen_image_edit_lora.toml --gpu-memory 24GiB --world-size 4 > $OUT/plan_edit_24x4.txt 2>&1
python3 bench/qwen_image_slice.py --edit --blocks 20 --lora 16 --base-dtype bf16 --steps 10 > $OUT/slice_edit_20.txt 2>&1
python3 bench/qwen_image_slice.py --edit --blocks 60 --lora 16 --base-dtype bf16 --steps 10 --checkpointing > $OUT/slice_edit_60_gc.txt 2>&1
