#!/usr/bin/env bash
# The GPU path, on a machine with one GPU and no registry (the device tool): wheels carried in .whl/, the MNIST
# t10k IDX files in .gpu/. 1) every clipping engine on CUDA and CPU side by side (bench/gpu_check.py);
# 2) the README main job through Ray with --gpus-per-trial auto (nvidia-smi logs which processes hold the GPU);
# 3) the printed final training on CUDA. Results under $OUT (bench/results/gpu_check.md says what was seen).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import torch, ray, opacus, dp_accounting, optuna; print('torch', torch.__version__, 'ray', ray.__version__, 'opacus', opacus.__version__)"
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_gpu.log"
timeout 150 python3 bench/gpu_check.py --mnist .gpu --epochs 1 --batch 1024 --out "$OUT/gpu_check.json" 2>&1 | grep -v Warning | tee "$OUT/gpu_check.log"
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv -l 1 > "$OUT/smi.log" 2>&1 &
SMI=$!
timeout 200 python3 -m dptune.search --space search_spaces/digits.yaml --ledger runs/ledger.sqlite --budget-epsilon 30 \
  --name gpu --num-cpus 8 > "$OUT/search.log" 2>&1
echo "search rc=$?"; tail -25 "$OUT/search.log"; tail -30 runs/gpu/sealed/logs/driver.log 2>/dev/null
timeout 90 python3 -m dptune.train --release runs/gpu/release --out runs/gpu/final --target-epsilon 8 --train-on-validation > "$OUT/train.log" 2>&1
echo "train rc=$?"; tail -15 "$OUT/train.log"
kill $SMI; sort -u "$OUT/smi.log" | head -20
cp runs/gpu/release/best_config.yaml runs/gpu/final/metrics.json "$OUT/" 2>/dev/null
