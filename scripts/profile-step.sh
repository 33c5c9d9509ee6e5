#!/usr/bin/env bash
# Per-kernel GPU time of one BERT-large training step (on the GPU machine, after a CUDA build in build-gpu/): the
# model is BERT-large with LAYERS encoder layers (default 2: every layer runs the same kernels, so 2 layers show the
# per-layer kernels and the heads at a fraction of the profiling time), trained by `nopad bench model` for one
# warm-up and one timed step on real phase-2 shards under Nsight Compute (gpu__time_duration of every kernel). Prints
# the kernels of the timed step grouped by name, with ms per layer for the encoder kernels. Usage:
#   SHARDS=/tmp/nopad-enwiki-shards BATCH=128 LAYERS=2 bash scripts/profile-step.sh   (logs in $OUT or out/profile)
# DETAIL='regex' then profiles DETAIL_COUNT (default 12) launches of the matching kernels from the timed step in depth
# (speed of light, memory workload, occupancy, warp states, launch statistics) into $OUT/ncu-detail.txt: where a
# memory-bound kernel loses bandwidth. Shards are prepared from .carry/enwiki-20150515-AA.txt.xz when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/profile}
mkdir -p "$OUT"
SHARDS=${SHARDS:-/tmp/nopad-enwiki-shards}
BATCH=${BATCH:-128}
LAYERS=${LAYERS:-2}
NOPAD=${NOPAD:-build-gpu/nopad}
source scripts/phase2-shards.sh
phase2_shards "$NOPAD" "$SHARDS"
cfg="$OUT/bert-large-${LAYERS}layers.json"
python3 - "$cfg" "$LAYERS" <<'EOF'
import json, sys
c = json.load(open("data/configs/bert-large-mlperf.json"))
c["num_hidden_layers"] = int(sys.argv[2])
json.dump(c, open(sys.argv[1], "w"), indent=1)
EOF
ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
  "$NOPAD" bench model --model "$cfg" --data "$SHARDS" --batch "$BATCH" --steps 1 --warmup 1 \
  > "$OUT/ncu-step.csv" 2> "$OUT/ncu-step.log"
python3 - "$OUT/ncu-step.csv" "$LAYERS" <<'EOF'
import collections, csv, sys
rows = []
with open(sys.argv[1]) as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    if r.get("Metric Name") == "gpu__time_duration.sum":
        rows.append((int(r["ID"]), r["Kernel Name"], float(r["Metric Value"].replace(",", "")) / 1e6))  # ns -> ms
rows.sort()
# The timed step is the second half of the launches after the parameters' set-up: find the LAMB launches (the last
# kernels of each step) and keep the kernels after the first step's.
lamb = [i for i, (_, name, _) in enumerate(rows) if "apply_kernel" in name]
start = lamb[-2] + 1 if len(lamb) >= 2 else 0
step = rows[start:]
by = collections.OrderedDict()
for _, name, ms in step:
    short = name.replace("(anonymous namespace)::", "").split("(")[0][:90]
    n, t = by.get(short, (0, 0.0))
    by[short] = (n + 1, t + ms)
total = sum(t for _, t in by.values())
print(f"one step: {len(step)} kernels, {total:.3f} ms of kernel time ({sys.argv[2]} encoder layers)")
print(f"{'kernel':92s} {'calls':>5s} {'ms':>9s} {'%':>6s}")
for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1]):
    print(f"{name:92s} {n:5d} {t:9.3f} {100 * t / total:6.1f}")
EOF
if [ -n "${DETAIL:-}" ]; then
  # The first step's launches are skipped (every kernel of the regex runs a few times per step at LAYERS=2).
  ncu --clock-control none -k "regex:$DETAIL" --launch-skip "${DETAIL_SKIP:-12}" --launch-count "${DETAIL_COUNT:-12}" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
    --section LaunchStats --section SchedulerStats \
    "$NOPAD" bench model --model "$cfg" --data "$SHARDS" --batch "$BATCH" --steps 1 --warmup 1 \
    > "$OUT/ncu-detail.txt" 2>&1
  grep -E "^  [a-z_].*\(|Duration|DRAM Throughput|Memory Throughput|L2 Cache Throughput|Issue Slots|Achieved Occupancy|Theoretical Occupancy|Eligible Warps|Registers Per|Block Size|Grid Size|Waves|Warp Cycles Per Issued|Block Limit" \
    "$OUT/ncu-detail.txt" | head -200
fi
