#!/usr/bin/env bash
# Train bench/rehearsal_sim.py grids on the device machine (one GPU, 16 cores, no registry): wheels carried in
# .whl/ (as bench/gpu_check.sh), every proxy run on CUDA, many workers sharing the one GPU. Each quoted argument
# after the time limit is one rehearsal_sim invocation's arguments (its --jobs included); they run side by side,
# each streaming its records to $OUT/gridN.jsonl as they finish (a run cut short by the limit keeps them; finish
# it anywhere with --have). Simulate later, on any machine: rehearsal_sim --from-json.
#   bash bench/rehearsal_gpu.sh 420 "--space search_spaces/mnist.yaml --seeds 100,101 --jobs 8" "..."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/bench:$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
limit=$1; shift
nvidia-smi -L
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv -l 10 > "$OUT/smi.log" 2>&1 &
SMI=$!
i=0 pids=()
for a in "$@"; do
  # shellcheck disable=SC2086  # each argument is a list of options
  timeout "$limit" python3 bench/rehearsal_sim.py $a --proxy mnist-public --epsilons 1,2,4 --lrs 3 --draws 0 \
    --device cuda --stream "$OUT/grid$i.jsonl" --out "$OUT/grid$i.md" > "$OUT/grid$i.log" 2>&1 &
  pids+=($!) i=$((i + 1))
done
wait "${pids[@]}"
kill $SMI
for f in "$OUT"/grid*.log; do echo "== $f"; grep -v -i warn "$f" | tail -5; done
wc -l "$OUT"/grid*.jsonl
python3 -c "
import json, glob, statistics as st
for f in sorted(glob.glob('$OUT/grid*.jsonl')):
    r = [json.loads(x) for x in open(f) if x.strip()]
    if r: print(f, len(r), 'runs, mean', round(st.mean(x['seconds'] for x in r), 1), 's, devices', sorted({x['device'] for x in r}))
"
sort -u "$OUT/smi.log" | tail -5
