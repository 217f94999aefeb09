#!/usr/bin/env bash
# The GPU path, on a machine with one GPU and no registry (the device tool): wheels carried in .whl/, the MNIST
# t10k IDX files in .gpu/. Stages (default: tests engines mnist digits pack; group and search when named), each
# bounded by its own timeout:
#   tests   pytest -m gpu tests/test_gpu.py (every engine on CUDA with its charged noise; a Ray search granted a GPU)
#   engines every clipping engine on CUDA and CPU side by side (bench/gpu_check.py)
#   mnist   the issue-21 main job: search_spaces/mnist.yaml through Ray with --gpus-per-trial auto, then the
#           printed dptune.train command at the space's target epsilon (2), on CUDA
#   digits  the README main job (digits) through Ray with --gpus-per-trial auto, then the printed final training
#   pack    trials per GPU-hour, one trial per GPU (--gpus-per-trial 1) against four packed on it (0.25), side by
#           side, for the MNIST space and the CIFAR-10 ResNet-9 space (synthetic CIFAR-format data): bench/gpu_pack.py
#           (issue 44; under 6 minutes; $OUT/gpu_pack.json)
#   group   vectorised trials on the GPU: G trials of one architecture as one computation (dpsgd.run_group) against
#           the same trials one at a time, and whether a trial's numbers depend on its company at the real chunk
#           shapes (bench/gpu_group.py; $OUT/gpu_group.json)
#   search  a CIFAR-shaped search end to end on the card (issue 61): the ResNet-9 space on synthetic CIFAR-format
#           data through `python -m dptune.search --group-trials`, then the final training it prints; the same
#           space with one trial per card (--gpus-per-trial 1) beside it, trials per GPU-hour of each
#           (bench/gpu_search.py; under 6 minutes; $OUT/gpu_search.json, $OUT/search_cifar_*.log)
# nvidia-smi logs which processes hold the GPU while the searches run. Results under $OUT
# (bench/results/gpu_check.md says what was seen).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STAGES=${*:-tests engines mnist digits pack}
nvidia-smi -L
python3 -c "import torch, ray, opacus, dp_accounting, optuna; print('torch', torch.__version__, 'ray', ray.__version__, 'opacus', opacus.__version__)"
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv -l 1 > "$OUT/smi.log" 2>&1 &
SMI=$!

final() {  # run the `next:` command a search printed (the exact final-training command), on CUDA by default
  local cmd
  cmd=$(grep -m1 '^  next:' "$1" | sed -e 's/^  next: *//' -e 's/ *(.*$//')  # less its note
  echo "+ $cmd"
  [ -n "$cmd" ] && eval "timeout $2 $cmd"
}

for stage in $STAGES; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests) timeout 170 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --durations=8 > "$OUT/pytest_gpu.log" 2>&1
           echo "pytest rc=$?"; grep -E "^(FAILED|E  )|passed|failed" "$OUT/pytest_gpu.log" | tail -30 ;;
    engines) timeout 90 python3 bench/gpu_check.py --mnist .gpu --epochs 1 --batch 1024 --out "$OUT/gpu_check.json" \
             2>&1 | grep -v Warning | tee "$OUT/gpu_check.log" ;;
    mnist) mkdir -p ../shared/data/mnist-t10k && cp .gpu/*.gz ../shared/data/mnist-t10k/
           SECONDS=0
           timeout 240 python3 -m dptune.search --space search_spaces/mnist.yaml --tune-anyway --name gpu-mnist \
             --ledger runs/ledger.sqlite --budget-epsilon 2 --num-cpus 16 --gpus-per-trial auto > "$OUT/search_mnist.log" 2>&1
           echo "search rc=$? ${SECONDS}s"; grep -v -i warn "$OUT/search_mnist.log" | tail -22
           python3 -c "from dptune.trials import read_trials as r; print('mnist trial devices:', sorted({t.measured.get('device') for t in r('runs/gpu-mnist/sealed/trials.parquet')}))" 2>&1 | tail -1
           SECONDS=0; final "$OUT/search_mnist.log" 120 > "$OUT/train_mnist.log" 2>&1
           echo "train rc=$? ${SECONDS}s"; tail -12 "$OUT/train_mnist.log" ;;
    pack) SECONDS=0
           timeout 330 python3 bench/gpu_pack.py --mnist .gpu --num-cpus 16 --out "$OUT/gpu_pack.json" \
             > "$OUT/gpu_pack.log" 2>&1
           echo "pack rc=$? ${SECONDS}s"; grep -E "^=== |^space |^(mnist|cifar10_resnet9)|Error|error:" "$OUT/gpu_pack.log" | tail -20 ;;
    search) SECONDS=0
           timeout 275 python3 bench/gpu_search.py --logs "$OUT" --out "$OUT/gpu_search.json" > "$OUT/gpu_search.log" 2>&1
           echo "gpu_search rc=$? ${SECONDS}s"
           grep -E "^=== |^arm |^(grouped|one_per_card) |^grouped/|^  (config|privacy):|Error|error:" "$OUT/gpu_search.log" | tail -20
           SECONDS=0; final "$OUT/search_cifar_grouped.log" 60 > "$OUT/train_cifar.log" 2>&1
           echo "train rc=$? ${SECONDS}s"; grep -v -i warn "$OUT/train_cifar.log" | tail -8 ;;
    group) SECONDS=0
           timeout 300 python3 bench/gpu_group.py --mnist .gpu --out "$OUT/gpu_group.json" > "$OUT/gpu_group.log" 2>&1
           echo "group rc=$? ${SECONDS}s"; grep -v -i warn "$OUT/gpu_group.log" | tail -30 ;;
    digits) SECONDS=0
           timeout 200 python3 -m dptune.search --space search_spaces/digits.yaml --ledger runs/ledger.sqlite \
             --budget-epsilon 30 --name gpu --num-cpus 8 > "$OUT/search.log" 2>&1
           echo "search rc=$? ${SECONDS}s"; tail -25 "$OUT/search.log"
           SECONDS=0; final "$OUT/search.log" 90 > "$OUT/train.log" 2>&1
           echo "train rc=$? ${SECONDS}s"; tail -15 "$OUT/train.log" ;;
  esac
done
kill $SMI; sort -u "$OUT/smi.log" | head -20
