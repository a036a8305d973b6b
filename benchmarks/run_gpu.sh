#!/usr/bin/env bash
# Every single-GPU measurement the README quotes, in one go (about 9 minutes on an H200).
# Usage: bash benchmarks/run_gpu.sh OUT_DIR [STEP...]   STEP: tests overhead spill checkpointing tuners sweeps
# (all when none is named), or one of: deepspeed (the callbacks under DeepSpeedStrategy, 1-2 minutes; DeepSpeed is not
# a dependency: where it is missing it is installed from the wheels in DS_WHEELS, made on a machine with internet by
# `bash benchmarks/deepspeed_wheels.sh DIR`), sharded (ours against FSDP's own checkpointing switch, 2-4 minutes), adapt (MemGuard(on_spill="adapt") with memory taken and
# freed mid-run, about 3 minutes), forensics (the memory report's cost: plain, MemGuard without and with reports, and
# recording the allocator's history, in turns, about 4 minutes), zoo compile_frontier compile_rerun compile_tuner compile_budgets compile_peak (each 3-8
# minutes), families (timm and Hugging Face against their own switches; FAMILY_MODELS=a,b picks a part: the twelve
# models take two calls, the vision ones by default, then FAMILY_MODELS=gpt2,llama,bert,t5,whisper; each within 9 minutes), checkpoint_overhead (timm's switch against ours and the ablations
# between them, profiled; CKPT_MODEL=resnet50, vit_small_patch16_224 or bert, gpt2, llama, t5, whisper (the switch's own blocks beside ours and the fused loss) for another model than convnext_tiny; 3-4 minutes),
# offload (overlapped activation offload's cost per GB moved, GPT-2 small and ResNet50, and every block checkpointed with
# and without its input offloaded, about 6 minutes; OFFLOAD_ARGS="--models gpt2 --profile first_1,checkpointed_inputs"
# also records and summarises one step's trace of those rows),
# autocast_cache (the language models' peak with autocast's weight cache kept and off inside the checkpoints, 2 minutes).
# Results and plots land in OUT_DIR; copy them to benchmarks/results/ and docs/,
# then update the README's "Measured" section.
set -uo pipefail
out=${1:?usage: run_gpu.sh OUT_DIR}
shift
steps=" ${*:-tests overhead spill checkpointing tuners sweeps} "
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(cd "$(dirname "$0")/.." && pwd)" PYTHONUNBUFFERED=1
quiet='Warning|warn\(|LOCAL_RANK|available|Tip|AMP|Restor|weights_only'
run() { echo "== $*"; "$@" 2>&1 | grep -vE "$quiet" | tail -"${TAIL:-6}"; }
want() { [[ $steps == *" $1 "* ]]; }
if want tests; then
    echo "== pytest -m cuda tests/gpu/test_gpu.py tests/gpu/test_gpu_sharded.py tests/gpu/test_gpu_offload.py"
    timeout 560 python3 -m pytest -m cuda -q -rA -p no:cacheprovider tests/gpu/test_gpu.py tests/gpu/test_gpu_sharded.py \
        tests/gpu/test_gpu_offload.py \
        -o addopts=--strict-markers 2>&1 |
        grep -vE "$quiet" >"$out/gpu_tests.txt"  # the compiled test takes about a minute
    tail -4 "$out/gpu_tests.txt"
fi
if want deepspeed; then
    if ! python3 -c "import deepspeed" 2>/dev/null; then
        ds=$(mktemp -d)  # DeepSpeed and what it needs beyond torch, numpy, psutil, tqdm and packaging
        python3 -m pip install -q --no-index --no-deps --find-links "${DS_WHEELS:?DeepSpeed is missing: set DS_WHEELS}" \
            --target "$ds" deepspeed einops hjson msgpack ninja py-cpuinfo pydantic pydantic-core annotated-types \
            typing-inspection typing-extensions && export PYTHONPATH="$PYTHONPATH:$ds" DS_BUILD_OPS=0
    fi
    echo "== pytest -m cuda tests/gpu/test_gpu_deepspeed.py"
    timeout 400 python3 -m pytest -m cuda -q -rA -s -p no:cacheprovider tests/gpu/test_gpu_deepspeed.py \
        -o addopts=--strict-markers 2>&1 | grep -vE "$quiet" >"$out/gpu_deepspeed_tests.txt"
    tail -4 "$out/gpu_deepspeed_tests.txt"
fi
want overhead && run timeout 240 python3 benchmarks/overhead.py --rounds 3 --out "$out/overhead.json"
want spill && run timeout 120 python3 benchmarks/spill.py --out "$out/spill.json"
want checkpointing && run timeout 420 python3 benchmarks/checkpointing.py --out "$out/checkpointing.json" --plot "$out/checkpointing.png"
want tuners && run timeout 330 python3 benchmarks/tuners.py --out "$out/tuners.json"
want zoo && TAIL=12 run timeout 300 python3 benchmarks/checkpointing_zoo.py ${ZOO_ARGS:-} --out "$out/checkpointing_zoo.json"
want compile_frontier && TAIL=14 run timeout 540 python3 benchmarks/compile.py --part frontier --out "$out/compile_frontier.json"
want compile_tuner && TAIL=10 run timeout 540 python3 benchmarks/compile.py --part tuner --out "$out/compile_tuner.json"
want compile_budgets && TAIL=8 run timeout 540 python3 benchmarks/compile.py --part budgets --budgets "${BUDGETS:-0.65,0.6,0.56,0.5,0.4,0.35}" --out "$out/compile_budgets.json"
want compile_rerun && TAIL=8 run timeout 420 python3 benchmarks/compile.py --part frontier --rows "${ROWS:-compile_every_block,compile_every_block_one_graph}" --out "$out/compile_rerun.json"
want families && TAIL=80 run timeout 540 python3 benchmarks/families.py \
    --models ${FAMILY_MODELS:-resnet50,convnext_tiny,vit_small,efficientnet_b0,swin_tiny,regnety_032,densenet121} \
    --out "$out/families.json"
want checkpoint_overhead && TAIL=200 run timeout 420 python3 benchmarks/checkpoint_overhead.py \
    --model "${CKPT_MODEL:-convnext_tiny}" --profile --out "$out/checkpoint_overhead.json"
want offload && TAIL=40 run timeout 540 python3 benchmarks/offload.py ${OFFLOAD_ARGS:-} --out "$out"
want autocast_cache && TAIL=6 run timeout 240 python3 benchmarks/autocast_cache.py --out "$out/autocast_cache.json"
want sharded && TAIL=4 run timeout 420 python3 benchmarks/sharded.py --out "$out/sharded.json"
want adapt && TAIL=4 run timeout 420 python3 benchmarks/adapt.py --out "$out/adapt.json"
want forensics && TAIL=12 run timeout 420 python3 benchmarks/forensics.py --out "$out/forensics.json"
want compile_peak && TAIL=80 run timeout 555 python3 benchmarks/compile_peak.py --out "$out/compile_peak.json"
if want sweeps; then
TAIL=9 run timeout 90 python3 -m lightning_memguard.commands.cli sweep --model resnet50 --batch-sizes 32,64,128,256,512 \
    --precision bf16-mixed --channels-last --out "$out/sweep"
TAIL=9 run timeout 120 python3 -m lightning_memguard.commands.cli sweep --model resnet50 --batch-sizes 64,128,256,384,512,1024 \
    --precision bf16-mixed --channels-last --emulate-capacity 16GB --out "$out/sweep16"
# the device tool brings back at most 8 files: pack the sweeps
tar czf "$out/sweeps.tgz" -C "$out" sweep sweep16 && rm -r "$out/sweep" "$out/sweep16"
fi
ls -la "$out"
