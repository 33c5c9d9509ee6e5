#!/usr/bin/env bash
# The scale-out measurement (BERT-large phase 2 on 1, 2, 4 and 8 GPUs of one host; docs/distributed.md, "Measuring
# scale-out"): for each GPU count, `nopad bench model` across the ranks with workload balancing off and on (per-GPU
# sequences/s, scaling efficiency against one GPU, slowest/mean per-rank compute, gradient-reduction time after the
# backward); at the largest count, `nopad train` with bucket-wise against global gradient clipping; then the largest
# count against NVIDIA's MLPerf v4.0 8x H200 figure (7,990 seq/s) and the projected MLPerf time-to-train
# (scripts/project_ttt.py) at the measured rate and global batch. JSON lines in $OUT/scale-out.jsonl, the table in
# $OUT/summary.txt (OUT defaults to out/scale-out). Needs .carry/enwiki-20150515-AA.txt.xz.
#   NS="1 2 4 8"     GPU counts (those above the machine's GPU count are skipped); 1 is the efficiency baseline and
#                    is always measured
#   BATCH=64         sequences per GPU and step (global batch = BATCH x GPUs)
#   STEPS=20         timed steps per measurement (after 5 warm-up steps)
#   CLIP=1           the clipping comparison at the largest count (0: skip, ~2 min)
#   DIST_VARIANTS="ARGS;ARGS"   more `nopad bench model` runs at each count above 1 (balance cost), one per
#                    ';'-separated set of extra arguments, e.g. " ;--reduce bf16;--reduce bf16 --no-overlap"
#                    (" ": the defaults)
#   SKIP_BASE=1      skip the balance none/cost runs (only the variants)
#   NOPAD_CMAKE_EXTRA="..."   extra CMake arguments (e.g. -DCMAKE_CUDA_ARCHITECTURES=90a-real)
#   DEVICE=cpu MODEL=data/configs/bert-tiny.json NGPU=2   a smoke run of the script itself on a CPU machine
# A call on the device machine is limited to 10 minutes: with the build, all four counts and the clipping runs take
# longer, so split it, e.g. NS="1 2 4" CLIP=0, then NS="8" (the build and the shards are kept on a warm machine).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/scale-out}
mkdir -p "$out"
source scripts/dist-env.sh  # mpirun as root, no NVLink multicast, NCCL_ROOT, build-gpu
NS=${NS:-1 2 4 8}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-data/configs/bert-large-mlperf.json}
BATCH=${BATCH:-64}
STEPS=${STEPS:-20}
COST_SQ=0.00062  # the measured cost model (configs/mlperf-phase2.toml): b/a per token
status=0
step() { echo "== $(date -u +%T) $*" | tee -a "$out/summary.txt"; }

if [ ! -x build-gpu/nopad ] || [ ! -f build-gpu/CMakeCache.txt ]; then
  step "build (CUDA on, NCCL_ROOT=${NCCL_ROOT:-system})"
  NOPAD_CMAKE_ARGS="-DNOPAD_CUDA=ON ${NOPAD_CMAKE_EXTRA:-}" bash scripts/setup.sh > "$out/build.log" 2>&1 ||
    { tail -40 "$out/build.log"; exit 1; }
fi
NOPAD=$PWD/build-gpu/nopad
if [ "$DEVICE" = cuda ]; then
  ngpu=${NGPU:-$(nvidia-smi -L | wc -l)}
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a "$out/summary.txt"
else
  ngpu=${NGPU:-2}
fi

SHARDS=/tmp/nopad-enwiki-shards
source scripts/phase2-shards.sh
phase2_shards "$NOPAD" "$SHARDS" "$out/prepare.log" || exit 1
bench_args=(bench model --model "$MODEL" --data $SHARDS --batch "$BATCH" --steps "$STEPS" --warmup 5 --device "$DEVICE")

# Adds "gpus" and "balance" to the JSON line on stdin and appends it to scale-out.jsonl.
tag() {
  sed "s/^{/{\"gpus\": $1, \"balance_run\": \"$2\", \"variant\": \"${3:-}\", /" | grep '^{' |
    tee -a "$out/scale-out.jsonl"
}

if ! grep -q '"gpus": 1,' "$out/scale-out.jsonl" 2>/dev/null; then
  step "1 GPU, batch $BATCH"
  $NOPAD "${bench_args[@]}" 2> "$out/bench-1.log" | tag 1 none || status=1
fi
largest=1
for n in $NS; do
  [ "$n" -gt 1 ] || continue
  if [ "$n" -gt "$ngpu" ]; then
    echo "skipping $n GPUs: this machine has $ngpu" | tee -a "$out/summary.txt"
    continue
  fi
  largest=$n
  bals="none cost"
  [ "${SKIP_BASE:-0}" = 1 ] && bals=""
  for bal in $bals; do
    step "$n GPUs, batch $BATCH per GPU, balance $bal"
    mpirun -np "$n" --bind-to none $NOPAD "${bench_args[@]}" --balance $bal --cost-per-token-sq $COST_SQ \
      2> "$out/bench-$n-$bal.log" | tag "$n" $bal || status=1
    tail -n 3 "$out/bench-$n-$bal.log" >> "$out/summary.txt"
  done
  if [ -n "${DIST_VARIANTS:-}" ]; then
    IFS=';' read -r -a variants <<< "$DIST_VARIANTS"
    v=0
    for args in "${variants[@]}"; do
      v=$((v + 1))
      step "$n GPUs, batch $BATCH per GPU, balance cost, $args"
      # shellcheck disable=SC2086
      mpirun -np "$n" --bind-to none $NOPAD "${bench_args[@]}" --balance cost --cost-per-token-sq $COST_SQ $args \
        2> "$out/bench-$n-v$v.log" | tag "$n" cost "$args" || status=1
      tail -n 3 "$out/bench-$n-v$v.log" >> "$out/summary.txt"
    done
  fi
done

if [ "${CLIP:-1}" = 1 ] && [ "$largest" -gt 1 ]; then
  # Bucket-wise clipping (each bucket clipped before its all-reduce) against global clipping (after it): nopad train,
  # 30 steps, balance by cost, overlap on; medians of steps 6-30 of metrics.jsonl.
  d=/tmp/nopad-scale-out
  mkdir -p $d
  for clip in global bucket; do
    step "$largest GPUs, nopad train, dist.clip = $clip"
    mpirun -np "$largest" --bind-to none $NOPAD train --config configs/bert-tiny-sample.toml \
      --set model.config="$MODEL" --set data.train=$SHARDS --set 'data.eval=""' \
      --set train.device="$DEVICE" --set optim.lr=0.0001 --set train.max_steps=30 --set log.interval_steps=1 \
      --set train.global_batch=$((BATCH * largest)) --set dist.balance=cost --set dist.cost_per_token_sq=$COST_SQ \
      --set dist.clip=$clip --set run_dir=$d/clip-$clip --overwrite > "$out/train-clip-$clip.log" 2>&1 || status=1
    python3 - $d/clip-$clip/metrics.jsonl "$largest" "$clip" <<'PY' | tee -a "$out/scale-out.jsonl" || status=1
import json, statistics, sys
try:
    ls = [l for l in (json.loads(x) for x in open(sys.argv[1]) if '"eval"' not in x) if 6 <= l["step"] <= 30]
except OSError:
    ls = []
if not ls:
    sys.exit(f"no metrics in {sys.argv[1]}")
med = lambda k: statistics.median(l[k] for l in ls if k in l)
print(json.dumps({"gpus": int(sys.argv[2]), "train_clip": sys.argv[3], "seqs_per_s": med("seq_per_s"),
                  "compute_ms": med("compute_ms"), "reduce_ms": med("reduce_ms"),
                  "compute_imbalance": statistics.mean(l["compute_imbalance"] for l in ls)}))
PY
  done
fi

step "summary"
python3 - "$out/scale-out.jsonl" "$BATCH" <<'PY' | tee -a "$out/summary.txt" || status=1
import json, os, subprocess, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
batch = int(sys.argv[2])
bench = [r for r in rows if "train_clip" not in r]
one = [r for r in bench if r["gpus"] == 1]
if not one:
    sys.exit("no 1-GPU line: the efficiency baseline is missing")
base = one[-1]["seqs_per_s"]
print(f"{'GPUs':>4} {'balance':>7} {'seq/s':>9} {'per GPU':>8} {'eff.':>6} {'compute ms':>10} "
      f"{'compute max/mean':>16} {'reduce ms':>9}  variant")
for r in bench:
    n = r["gpus"]
    per = r["seqs_per_s"] / n
    imb = r.get("compute_imbalance", 1.0)
    red = r.get("reduce_ms", 0.0)
    comp = r.get("compute_ms", r["step_ms"])
    print(f"{n:>4} {r['balance_run']:>7} {r['seqs_per_s']:>9.1f} {per:>8.1f} {per / base:>6.3f} {comp:>10.2f} "
          f"{imb:>16.4f} {red:>9.2f}  {r.get('variant', '')}")
for r in rows:
    if "train_clip" in r:
        print(f"{r['gpus']} GPUs, nopad train, clip {r['train_clip']}: {r['seqs_per_s']:.1f} seq/s, compute "
              f"{r['compute_ms']:.1f} ms, reduction {r['reduce_ms']:.1f} ms, max/mean {r['compute_imbalance']:.3f}")
top = max(bench, key=lambda r: (r["gpus"], r["seqs_per_s"]))
n = top["gpus"]
print(f"{n} GPUs, best: {top['seqs_per_s']:.1f} seq/s; NVIDIA MLPerf v4.0 8x H200: 7,990 seq/s "
      f"({top['seqs_per_s'] / 7990 * 8 / n:.3f}x per GPU)")
if batch * n >= 256:  # the smallest batch with an MLPerf convergence point
    subprocess.run([sys.executable, "scripts/project_ttt.py", "--seqs-per-s", str(top["seqs_per_s"]),
                    "--global-batch", str(batch * n)], check=False)
else:
    print(f"no time-to-train projection: global batch {batch * n} is below MLPerf's smallest RCP batch (256)")
PY
step "done, status $status"
exit $status
