#!/bin/bash
# One device call: FP8-vs-bf16 drafter quality (CPU- and GPU-trained) + the GPU tests + a bench smoke.
T0=$SECONDS
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .fp8/whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
exec > >(tee $OUT/run.log) 2>&1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,driver_version --format=csv
lscpu | grep -i "model name\|^CPU(s)" ; grep -o -w "amx_bf16\|avx512_bf16" /proc/cpuinfo | sort | uniq -c
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'amx', torch._C._cpu._init_amx())"
S=/tmp/sweep
echo "== [$((SECONDS-T0))s] CPU-trained sweep (background)"
(timeout 520 python3 .fp8/quality_sweep.py --variants .fp8/variants_cpu.json --par 6 --out $S --no-diag --device cpu > $S.cpu.log 2>&1) &
CPUPID=$!
echo "== [$((SECONDS-T0))s] pytest -m gpu"
timeout 200 python3 -m pytest -q -m gpu tests/unit -p no:cacheprovider --continue-on-collection-errors 2>&1 | tail -25
echo "== [$((SECONDS-T0))s] bench/train.py smoke"
timeout 220 python3 bench/train.py --batches 1 4 --steps 6 --warmup 2 --eager-batches --profile-batches --out $OUT 2>&1 | grep -v "^\s*$" | tail -30
echo "== [$((SECONDS-T0))s] refcheck"
python3 .fp8/check_ref.py .fp8/ref.pt $S/shards-fp8r64 $S/shards-fp8r64-fp8_e4m3 2>&1 | tail -3
cat $S/shards-fp8r64/manifests.json > $OUT/manifests_plain.json; cat $S/shards-fp8r64-fp8_e4m3/manifests.json > $OUT/manifests_fp8.json
LEFT=$((525 - (SECONDS-T0)))
echo "== [$((SECONDS-T0))s] GPU-trained sweep, ${LEFT}s left"
if [ $LEFT -gt 90 ]; then timeout $LEFT nice -n 10 python3 .fp8/quality_sweep.py --variants .fp8/variants_gpu.json --par 2 --out $S --no-diag > $S.gpu.log 2>&1; fi
wait $CPUPID
echo "== [$((SECONDS-T0))s] done"
grep -h "shards built\|^\[" $S.cpu.log $S.gpu.log | cut -c1-300
for d in $S/*-s?-*/; do n=$(basename $d); grep -h "step" $d/train.log | tail -1 | sed "s/^/$n: /" | cut -c1-250; done
tar czf $OUT/trainlogs.tgz -C $S $(cd $S && ls -d *.log */train.log 2>/dev/null)
