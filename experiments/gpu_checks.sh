#!/usr/bin/env bash
# The GPU checks, each piece time-boxed against one deadline so that a lease
# of a few minutes returns every row that finished.
#
#   experiments/gpu_checks.sh bench SECONDS OUT  # gpu_bench 1b + 2.7b, then 3.5b stage 3 (+offload)
#   experiments/gpu_checks.sh rest SECONDS OUT   # the main job, no flags; longest_context, coarse
#   experiments/gpu_checks.sh lc SECONDS OUT     # longest_context alone (dots, then offload), coarse
#   experiments/gpu_checks.sh offload SECONDS OUT # 2.7b and 7b offload: default (stacks by rows), whole stacks, crossing; 7b +params; accum4; link; rows' rounding
#   experiments/gpu_checks.sh offload7b SECONDS OUT # 7b offload +accum4, +params (warm-up 1000)
#   experiments/gpu_checks.sh offload7b8 SECONDS OUT # 7b offload +accum8, +params (warm-up 1000)
#   experiments/gpu_checks.sh share SECONDS OUT  # 2.7b with a share of the state on the host (offload=0.05, 0.1), batch 4 and accum4: the outside-loops link time timed
#   experiments/gpu_checks.sh grads SECONDS OUT  # +grads (offload_grads) beside offload at 2.7b (and accum4) and 7b +params, per-leaf clip
#
# Logs and JSON land in OUT, flat (the device tool brings back at most 8
# files, two folders down).
set -u
part=$1; budget=$2; out=$3
mkdir -p "$out"
deadline=$((SECONDS + budget))
left() { echo $((deadline - SECONDS)); }
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
# the CUDA plugin's pinned host pool is 64 GB unless this says more; 7b
# with its params on the host holds 78 GB there
export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB:-110}

nvidia-smi -L; python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'

bench() {  # SIZES CONFIGS STEPS TIMEOUT NAME [gpu_bench flags]
  [ "$(left)" -gt 60 ] || return
  timeout "$(left)" python3 experiments/gpu_bench.py --sizes "$1" \
    --configs "$2" --steps "$3" --timeout "$4" --out "$out/b_$5" "${@:6}" 2>&1 \
    | tee -a "$out/gpu_checks.log"
  cp "$out/b_$5/gpu_bench.json" "$out/gpu_bench_$5.json" 2>/dev/null
  rm -rf "$out/b_$5"
}

case $part in
  bench)
    timeout "$(left)" python3 experiments/gpu_bench.py --sizes 1b,2.7b \
      --steps 5 --timeout 150 --out "$out/b1" 2>&1 | tee "$out/gpu_bench.log"
    cp "$out/b1/gpu_bench.json" "$out/gpu_bench.json" 2>/dev/null
    if [ "$(left)" -gt 60 ]; then
      timeout "$(left)" python3 experiments/gpu_bench.py --sizes 3.5b \
        --configs 3+offload,3 --steps 3 --timeout 150 --out "$out/b2" 2>&1 \
        | tee "$out/gpu_bench_3.5b.log"
      cp "$out/b2/gpu_bench.json" "$out/gpu_bench_3.5b.json" 2>/dev/null
    fi
    ;;
  rest)
    timeout "$(( $(left) < 240 ? $(left) : 240 ))" python3 -m zerojax.train \
      --out "$out/train" 2>&1 | tee "$out/train.log"
    cp "$out/train/summary.json" "$out/train/metrics.jsonl" "$out/" 2>/dev/null
    if [ "$(left)" -gt 60 ]; then
      timeout "$(left)" python3 experiments/longest_context.py \
        --policies dots,offload --start 32768 --granularity 32768 \
        --timeout 120 --out "$out/lc" 2>&1 | tee "$out/longest_context.log"
      cp "$out/lc/longest_context.json" "$out/" 2>/dev/null
    fi
    ;;
  lc)
    timeout "$(left)" python3 experiments/longest_context.py \
      --policies dots,offload --start 32768 --granularity 32768 --steps 1 \
      --timeout 100 --out "$out/lc" 2>&1 | tee "$out/longest_context.log"
    cp "$out/lc/longest_context.json" "$out/" 2>/dev/null
    ;;
  offload)
    # most wanted first: 2.7b offload (default: stacks by rows; whole
    # stacks; the crossing stream) against the plain loop, 7b offload (the
    # same three), 7b with params on the host, the accumulation pair, then
    # the link and the host's update
    bench 2.7b plain,3+offload,3+offload+whole,3+offload+cross 3 180 offload
    # 7b at the warm-up under which its loss falls (at 100 steps its first
    # step overshoots: docs/results.md)
    bench 7b 3+offload,3+offload+whole,3+offload+cross 2 300 7b --warmup 1000
    bench 7b 3+offload+params 2 240 7b_params --warmup 1000
    bench 2.7b plain+accum4,3+offload+accum4 3 150 accum4
    if [ "$(left)" -gt 30 ]; then
      timeout "$(( $(left) < 60 ? $(left) : 60 ))" python3 \
        experiments/studies/host_update.py --out "$out" 2>&1 | tee -a "$out/gpu_checks.log"
    fi
    # whether the GPU compiler rounds the streamed update (by rows, and
    # whole stacks) apart from no offload's
    if [ "$(left)" -gt 60 ]; then
      timeout "$(left)" python3 experiments/studies/rows_rounding.py --out "$out" \
        2>&1 | tee -a "$out/gpu_checks.log"
    fi
    ;;
  offload7b)
    # 7b at a warm-up under which its loss falls: with 4 micro-batches,
    # and with the parameters on the host too
    bench 7b 3+offload+accum4 2 200 7b_accum4 --warmup 1000
    bench 7b 3+offload+params 2 200 7b_params --warmup 1000
    ;;
  offload7b8)
    # 7b offload with 8 micro-batches (compute twice the link time), then
    # the parameters on the host
    bench 7b 3+offload+accum8 2 120 7b_accum8 --warmup 1000
    bench 7b 3+offload+params 2 200 7b_params --warmup 1000
    ;;
  share)
    # the GPU compiler's prediction (docs/results.md, "A share of the state
    # on the host"): each share adds its outside-loops link time
    bench 2.7b plain,3+offload=0.05,3+offload=0.1 3 180 share
    bench 2.7b plain+accum4,3+offload=0.1+accum4 3 150 share_accum4
    ;;
  grads)
    # the gradients in host memory beside the state alone, clipped by
    # the global norm (computed first: each gradient comes down twice)
    # and per leaf (once); 7b with the params on the host holds 92 GB
    # there with its gradients
    bench 2.7b plain,3+offload,3+offload+grads 3 180 grads
    bench 2.7b 3+offload+grads 3 180 grads_leaf --clip leaf
    # 4 micro-batches summed in host memory beside the sums on the device
    bench 2.7b 3+offload+accum4,3+offload+grads+accum4 3 180 grads_accum4
    bench 7b 3+offload+params,3+offload+params+grads 2 240 7b_grads \
      --warmup 1000
    ;;
esac
rm -rf "$out/b1" "$out/b2" "$out/lc" "$out/train"
