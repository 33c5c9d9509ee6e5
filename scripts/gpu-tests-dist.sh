#!/usr/bin/env bash
# Data-parallel checks on a machine with 2 or more GPUs (device kind nvidia-h200-x2 or larger): builds nopad with the
# CUDA backend and NCCL, then
#   1. equality: bert-tiny trained 20 steps by one process on one GPU and by `mpirun -np 2` (one GPU each, gradients
#      summed by NCCL) on the same global batches: every step's loss agrees within bf16 noise, and the 2-rank run's
#      final checkpoint passed the trainer's check that both ranks hold identical weights;
#   2. hang: one rank stopped (SIGSTOP) mid-run: the other ends the job with an error naming the timeout
#      (dist.timeout_s = 15) within 60 s;
#   3. death: one rank killed (SIGKILL) mid-run: the job ends within 60 s with the launcher's error;
#   1b. bucket-wise clipping (dist.clip = bucket): kernels vs CPU twin, 1 and 2 GPUs bound every bucket's norm;
#   1c. bf16 gradient reduction (dist.reduce = bf16): kernels vs CPU twin, 2 GPUs vs 1 GPU loss for loss;
#   1d. torchrun launch (`python3 -m torch.distributed.run`, its agent's TCPStore shared with the workers): 2 GPUs
#      vs 1 GPU loss for loss;
#   4. scaling of BERT-large (with .carry/): overlap, balancing, NCCL SM cap, bucket clipping and bf16 variants;
#   5. the same through `nopad bench model` on all GPUs (per-rank timing table), balancing off and on.
#   SKIP_FAULTS=1 skips 2 and 3 (~100 s).
# Prints a pass/fail line per check; logs in $OUT (or out/gpu-dist). Usage: bash scripts/gpu-tests-dist.sh
#   NOPAD_CMAKE_EXTRA="..."   extra CMake arguments (e.g. -DCMAKE_CUDA_ARCHITECTURES=90a-real)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/gpu-dist}
mkdir -p "$out"
source scripts/dist-env.sh  # mpirun as root, no NVLink multicast, NCCL_ROOT, build-gpu
status=0
step() { echo "== $*" | tee -a "$out/summary.txt"; }
result() { echo "$*" | tee -a "$out/summary.txt"; }

step "build (CUDA on, NCCL_ROOT=${NCCL_ROOT:-system})"
NOPAD_CMAKE_ARGS="-DNOPAD_CUDA=ON ${NOPAD_CMAKE_EXTRA:-}" bash scripts/setup.sh > "$out/build.log" 2>&1 ||
  { tail -40 "$out/build.log"; exit 1; }
grep -E "nopad: (NCCL|MPI|CUDA)" "$out/build.log" | tee -a "$out/summary.txt"
nvidia-smi --query-gpu=index,name --format=csv,noheader | tee -a "$out/summary.txt"
NOPAD=$PWD/build-gpu/nopad

d=/tmp/nopad-dist
rm -rf $d && mkdir -p $d
$NOPAD prepare --input data/wiki-sample/wiki_00 --vocab data/vocab/bert-uncased-vocab.txt --output $d/data \
  --max-seq-length 128 --dupe-factor 2 --quiet > "$out/prepare.log" 2>&1 || { cat "$out/prepare.log"; exit 1; }
train_args=(train --config configs/bert-tiny-sample.toml --set data.train=$d/data --set 'data.eval=""'
            --set train.device=cuda --set train.global_batch=32 --set log.interval_steps=1 --overwrite)

step "1. one GPU vs two (NCCL): 20 steps of bert-tiny, global batch 32, dropout on"
$NOPAD "${train_args[@]}" --set run_dir=$d/one --set train.max_steps=20 > "$out/one.log" 2>&1 || status=1
mpirun -np 2 --bind-to none $NOPAD "${train_args[@]}" --set run_dir=$d/two --set train.max_steps=20 \
  > "$out/two.log" 2>&1 || status=1
python3 scripts/compare_losses.py $d/one/metrics.jsonl $d/two/metrics.jsonl --label equality --same-samples \
  --log "$out/two.log" --expect "data parallel: 2 ranks" | tee -a "$out/summary.txt" || status=1
# The trainer compares the ranks' weight hashes at every checkpoint and fails the run when they differ.
grep -q "checkpoint" "$out/two.log" && ! grep -qi "differ" "$out/two.log" &&
  result "identical weights on both ranks at the final checkpoint: OK" ||
  { result "identical weights on both ranks: FAILED (see two.log)"; status=1; }

step "1b. bucket-wise clipping (dist.clip = bucket): the kernels against their CPU twin, then 1 GPU and 2 GPUs"
build-gpu/nopad_cuda_tests --gtest_filter='GradClip.*' > "$out/grad-clip.log" 2>&1 &&
  result "GradClip kernels vs CPU twin: OK" || { result "GradClip kernels: FAILED (grad-clip.log)"; status=1; }
# max_grad_norm far below every bucket's norm: one GPU must report max_grad_norm * sqrt(4 buckets) at every step;
# two GPUs' summed buckets (each rank's share clipped to half) at most that.
$NOPAD "${train_args[@]}" --set run_dir=$d/clip1 --set train.max_steps=10 --set dist.clip=bucket \
  --set optim.max_grad_norm=0.0001 > "$out/clip1.log" 2>&1 || status=1
mpirun -np 2 --bind-to none $NOPAD "${train_args[@]}" --set run_dir=$d/clip2 --set train.max_steps=10 \
  --set dist.clip=bucket --set optim.max_grad_norm=0.0001 > "$out/clip2.log" 2>&1 || status=1
python3 - $d/clip1/metrics.jsonl $d/clip2/metrics.jsonl <<'PY' | tee -a "$out/summary.txt" || status=1
import json, sys
def norms(p):
    try:
        return [json.loads(l)["grad_norm"] for l in open(p) if '"eval"' not in l]
    except (OSError, KeyError):
        return []
one, two = norms(sys.argv[1]), norms(sys.argv[2])
c, want = 1e-4, 2e-4  # bert-tiny: 4 gradient buckets
problems = []
if len(one) != 10 or len(two) != 10:
    problems.append(f"steps logged: {len(one)} and {len(two)} (want 10 each)")
if any(abs(n - want) > 1e-3 * want for n in one):
    problems.append(f"1 GPU: gradient norms {one} (want {want} at every step)")
if any(not (0.1 * c < n <= want * (1 + 1e-3)) for n in two):
    problems.append(f"2 GPUs: gradient norms {two} (want within (1e-5, {want}])")
print(f"bucket clipping: {'FAILED: ' + '; '.join(problems) if problems else 'OK'} (1 GPU {one[:2]}..., 2 GPUs "
      f"{[round(n, 7) for n in two[:4]]}...)")
sys.exit(1 if problems else 0)
PY

# Starts a long 2-rank run, waits for training steps, applies `signal` to rank 1, and checks that the job ends
# within 60 s with a non-zero status and (when given) a message matching `pattern` in its log.
fault() {
  local name=$1 signal=$2 pattern=$3 log="$out/$1.log"
  mpirun -np 2 --bind-to none $NOPAD "${train_args[@]}" --set run_dir=$d/$name --set train.max_steps=100000 \
    --set dist.timeout_s=15 > "$log" 2>&1 &
  local job=$! r1="" t=0
  while [ $t -lt 120 ] && [ "$(cat $d/$name/metrics.jsonl 2>/dev/null | wc -l)" -lt 5 ]; do
    sleep 1; t=$((t + 1))
  done
  for p in $(pgrep -f "nopad train .*run_dir=$d/$name"); do
    if tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=1"; then r1=$p; fi
  done
  if [ -z "$r1" ]; then
    result "$name: FAILED (rank 1 not found after ${t} s; log tail: $(tail -2 "$log" | tr '\n' ' '))"
    kill -9 $job 2>/dev/null; status=1; return
  fi
  kill -"$signal" "$r1"
  local start=$(date +%s.%N) rc=0 waited=0
  while kill -0 $job 2>/dev/null && [ $waited -lt 120 ]; do sleep 0.5; waited=$((waited + 1)); done
  if kill -0 $job 2>/dev/null; then
    kill -9 $job "$r1" 2>/dev/null
    result "$name: FAILED (the job was still running 60 s after SIGSTOP/SIGKILL of rank 1)"
    status=1; return
  fi
  wait $job; rc=$?
  local secs=$(python3 -c "import time; print(f'{time.time() - $start:.1f}')")
  kill -9 "$r1" 2>/dev/null
  local msg=$(grep -E "$pattern" "$log" | head -1)
  if [ $rc -ne 0 ] && python3 -c "import sys; sys.exit(0 if $secs <= 60 else 1)" && [ -n "$msg" ]; then
    result "$name: OK (rank 1 got SIG$signal; the job ended after $secs s with status $rc: $msg)"
  else
    result "$name: FAILED (status $rc after $secs s; message matching '$pattern': '${msg:-none}')"
    status=1
  fi
}
if [ "${SKIP_FAULTS:-0}" != 1 ]; then
  step "2. a hung rank (SIGSTOP): the other must stop the job (dist.timeout_s = 15)"
  fault hang STOP "did not finish within|no progress for"
  step "3. a dead rank (SIGKILL): the job must end"
  fault death KILL "signal 9|Killed|exited on signal|NCCL|non-zero"
fi

step "1c. bf16 gradient reduction (dist.reduce = bf16): the conversions and a one-rank NCCL bf16 sum, then 2 GPUs"
build-gpu/nopad_cuda_tests --gtest_filter='GradCast.*' > "$out/grad-cast.log" 2>&1 &&
  result "GradCast kernels vs CPU twin, one-rank NCCL bf16 all-reduce: OK" ||
  { result "GradCast: FAILED (grad-cast.log)"; status=1; }
mpirun -np 2 --bind-to none $NOPAD "${train_args[@]}" --set run_dir=$d/two-bf16 --set train.max_steps=20 \
  --set dist.reduce=bf16 > "$out/two-bf16.log" 2>&1 || status=1
# the fp32-reduced pair's bound (step 1), bf16 rounding of the gradients added
python3 scripts/compare_losses.py $d/one/metrics.jsonl $d/two-bf16/metrics.jsonl \
  --label "bf16 reduction, 2 GPUs vs 1" | tee -a "$out/summary.txt" || status=1
grep -q "gradients summed in bf16" "$out/two-bf16.log" || { result "bf16 reduction not announced: FAILED"; status=1; }

step "1d. torchrun launch on GPUs: python3 -m torch.distributed.run --standalone --nproc_per_node 2, 20 steps vs 1 GPU"
# torch >= 2.4 hands the workers its agent's TCPStore as MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True):
# nopad's ranks meet through it, then NCCL as under mpirun.
python3 -m torch.distributed.run --standalone --nproc_per_node 2 --no-python $NOPAD "${train_args[@]}" \
  --set run_dir=$d/two-torchrun --set train.max_steps=20 > "$out/two-torchrun.log" 2>&1 || status=1
torch_version=$(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null || echo "?")
python3 scripts/compare_losses.py $d/one/metrics.jsonl $d/two-torchrun/metrics.jsonl \
  --label "torchrun launch (torch $torch_version), 2 GPUs vs 1" --log "$out/two-torchrun.log" \
  --expect "data parallel: 2 ranks (torchrun" | tee -a "$out/summary.txt" ||
  { status=1; tail -5 "$out/two-torchrun.log"; }

# 4. Scaling (when .carry/ holds the Wikipedia text): BERT-large, 64 sequences per GPU of real phase-2 lengths, one
# GPU vs all of them; per-GPU sequences/s from metrics.jsonl (median over steps 6..30). NCCL all-reduce not yet
# overlapped with backward, so the gap is the exposed all-reduce (~1.3 GB of fp32 gradients per step).
if [ -f .carry/enwiki-20150515-AA.txt.xz ]; then
  ngpu=$(nvidia-smi -L | wc -l)
  step "4. scaling: BERT-large bf16, 64 sequences per GPU, 1 GPU vs $ngpu"
  source scripts/phase2-shards.sh
  phase2_shards "$NOPAD" /tmp/nopad-enwiki-shards "$out/prepare-enwiki.log" || status=1
  large_args=(train --config configs/bert-tiny-sample.toml --set model.config=data/configs/bert-large-mlperf.json
              --set data.train=/tmp/nopad-enwiki-shards --set 'data.eval=""' --set train.device=cuda
              --set optim.lr=0.0001 --set train.max_steps=30 --set log.interval_steps=1 --overwrite)
  $NOPAD "${large_args[@]}" --set run_dir=$d/large1 --set train.global_batch=64 > "$out/large1.log" 2>&1 || status=1
  # Overlap on/off (gradient buckets reduced during backward, or one all-reduce after it) and balancing by the
  # measured cost model (configs/mlperf-phase2.toml) vs none.
  runs=("ov-cost:--set dist.overlap=true --set dist.balance=cost --set dist.cost_per_token_sq=0.00062"
        "ov-none:--set dist.overlap=true --set dist.balance=none"
        "noov-cost:--set dist.overlap=false --set dist.balance=cost --set dist.cost_per_token_sq=0.00062"
        "ov-cost-4sm:--set dist.overlap=true --set dist.balance=cost --set dist.cost_per_token_sq=0.00062 --set dist.nccl_max_ctas=4"
        "ov-cost-bclip:--set dist.overlap=true --set dist.balance=cost --set dist.cost_per_token_sq=0.00062 --set dist.clip=bucket"
        "ov-cost-bf16:--set dist.overlap=true --set dist.balance=cost --set dist.cost_per_token_sq=0.00062 --set dist.reduce=bf16")
  for r in "${runs[@]}"; do
    name=${r%%:*}
    # shellcheck disable=SC2086
    mpirun -np "$ngpu" --bind-to none $NOPAD "${large_args[@]}" --set run_dir=$d/large-$name ${r#*:} \
      --set train.global_batch=$((64 * ngpu)) > "$out/large-$name.log" 2>&1 || status=1
  done
  python3 - $d/large1/metrics.jsonl "$ngpu" $d/large-ov-cost/metrics.jsonl $d/large-ov-none/metrics.jsonl \
    $d/large-noov-cost/metrics.jsonl $d/large-ov-cost-4sm/metrics.jsonl $d/large-ov-cost-bclip/metrics.jsonl \
    $d/large-ov-cost-bf16/metrics.jsonl <<'PY' |
import json, statistics, sys
def lines(p):
    try:
        return [l for l in (json.loads(x) for x in open(p) if '"eval"' not in x) if 6 <= l["step"] <= 30]
    except OSError:
        return []
def med(ls, k):
    v = [l[k] for l in ls if k in l]
    return statistics.median(v) if v else float("nan")
one, n = lines(sys.argv[1]), int(sys.argv[2])
base = med(one, "seq_per_s")
print(f"1 GPU: {base:.1f} seq/s, compute {med(one, 'compute_ms'):.1f} ms/step (median of steps 6-30)")
bad = not one
names = ("overlap, cost balance", "overlap, no balance", "no overlap, cost balance",
         "overlap with NCCL capped to 4 SMs, cost balance", "overlap, cost balance, bucket-wise clipping",
         "overlap, cost balance, bf16 gradient reduction")
for name, path in zip(names, sys.argv[3:]):
    ls = lines(path)
    if not ls:
        print(f"{n} GPUs, {name}: FAILED (no metrics)"); bad = True; continue
    r = med(ls, "seq_per_s")
    imb = statistics.mean(l["compute_imbalance"] for l in ls)
    print(f"{n} GPUs, {name}: {r:.1f} seq/s = {r / n:.1f} per GPU, efficiency {r / n / base:.3f}; compute "
          f"{med(ls, 'compute_ms'):.1f} ms mean / {med(ls, 'compute_ms_max'):.1f} max, max/mean {imb:.3f} (mean over "
          f"steps); gradient reduction {med(ls, 'reduce_ms'):.1f} ms (exposed + waiting)")
sys.exit(1 if bad else 0)
PY
    tee -a "$out/summary.txt" || status=1
  # The same workload through `nopad bench model` on all GPUs (per-rank table from rank 0), balancing off and on.
  step "5. nopad bench model on $ngpu GPUs: BERT-large, 64 sequences per GPU, balance none vs cost"
  for bal in none cost; do
    mpirun -np "$ngpu" --bind-to none $NOPAD bench model --model data/configs/bert-large-mlperf.json \
      --data /tmp/nopad-enwiki-shards --batch 64 --steps 20 --warmup 5 --balance $bal --cost-per-token-sq 0.00062 \
      > "$out/bench-ranks-$bal.json" 2> "$out/bench-ranks-$bal.log" || status=1
    tail -n 4 "$out/bench-ranks-$bal.log" | tee -a "$out/summary.txt"
    python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print(f'bench {sys.argv[2]}: {j[\"seqs_per_s\"]:.1f} seq/s, ' \
      f'{j[\"seqs_per_s_per_rank\"]:.1f} per GPU, compute max/mean {j[\"compute_imbalance\"]:.4f}, reduce {j[\"reduce_ms\"]:.2f} ms')" \
      "$out/bench-ranks-$bal.json" $bal | tee -a "$out/summary.txt" || status=1
  done
fi

step "done, status $status"
exit $status
