#!/usr/bin/env bash
# GPU benchmark run (on the GPU machine): builds nopad with CUDA, prepares real Wikipedia shards, times BERT-large
# training steps at batch 32 and 64, then the peer benchmarks on the same sequences, and prints the JSON lines and
# nopad/peer ratios. Everything is tee'd into $OUT/bench.log (OUT defaults to ./out).
#   BATCHES="32 64"       nopad batch sizes (the per-op breakdown runs at the last one)
#   PEER_BATCHES="32 64"  batch sizes of the compiled PyTorch peer (each on the workload of the same nopad batch, so
#                         each must be in BATCHES, as must HF_BATCH: checked before the build)
#                         The summary puts nopad's best batch against the peer's best. On an 80 GB H100 the peer's
#                         best is 128 or 160 (within 1%; it runs out of memory at 192) and nopad's 192-208:
#                         BATCHES="208 160 128" PEER_BATCHES="160 128"; on an H200 the peer's is 256 (out of memory
#                         at 384), nopad's 384: BATCHES="384 256" PEER_BATCHES=256
#   HF_BATCH=32           batch(es) of the Hugging Face peer, e.g. "32 64" (the summary takes its best; none: skip it).
#                         On an H200 it is flat from 144 to 176 (295.2 / 295.5 / 296.6 seq/s on one machine; 284.7
#                         at 128, 274.2 at 64, 255.8 at 32; out of memory at 192): BATCHES="384 256 160"
#                         PEER_BATCHES=256 HF_BATCH=160 for a best-against-best run
#   PEER_ATTENTION=1      the attention-only peer (varlen_attn, 64 sequences) on the last batch's workload (0: skip)
#   VARIANT_RUNS="A=0 B=1,C=2"  the last nopad batch again under each environment setting (kernel variants, dense.cu;
#                         settings joined by a comma form one variant),
#                         then the default once more, and a table of each variant against the two defaults' mean
#   MODEL_VARIANTS="F.json"  the last nopad batch again with each model config (--model), among the variants
#   VARIANT_WARMUP=5      warm-up steps of the variant runs (more for a variant that tunes during its first steps,
#                         e.g. NOPAD_GEMM_AUTOTUNE=1)
#   BASE_TREE=DIR         another nopad source tree (e.g. `git archive <ref> | tar -x -C .carry/base`, carried), built
#                         into DIR/build-gpu and timed at the last batch among the variants ("variant base"): a
#                         before/after of a code change in one call, on one GPU
#   PROFILE_BATCH=B       also profile the compiled PyTorch peer at batch B (scripts/profile_peer.py: its kernel time
#                         per step by category, to compare with nopad's --breakdown); unset: skip
#   HIDDEN_ACTS="gelu"    nopad activations to time at every batch: gelu (exact erf, the standard workload's) and/or
#                         gelu_new (tanh approximation, in the same GEMM epilogues as the erf form)
#   PEER_GELU_TANH=1      also run the compiled PyTorch peer with F.gelu(approximate="tanh") (a patched copy in
#                         .carry/), so a nopad gelu_new line has a peer with the same activation beside it
#   CEILING=1             also time the products alone of every batch's timed steps (scripts/products_ceiling.py,
#                         cuBLAS through PyTorch): the step time if nothing but the products cost, and the seq/s bound
#   SMI_LOG=1             log the SM clock, power and power-cap state every 250 ms ($OUT/smi.csv) and print each
#                         section's mean clock and power at the end (a GPU held at its power cap runs a kernel slower
#                         inside the training step than alone)
#   NOPAD_CMAKE_EXTRA     extra CMake arguments
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
LOG="$OUT/bench.log"
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1

echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo no-gpu)"
stamp() { echo "== $(date -u +%T) $*"; }  # section headers carry the time: the clock table below splits on them
if [ "${SMI_LOG:-0}" = 1 ] && command -v nvidia-smi >/dev/null; then
  # SM clock, power and whether the software power cap holds the clock down, every 250 ms, for the clock table.
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.sw_power_cap --format=csv,noheader \
    -lms 250 >"$OUT/smi.csv" 2>&1 &
  SMI_PID=$!
  trap 'kill $SMI_PID 2>/dev/null || true' EXIT
fi

BATCHES=${BATCHES:-32 64}
PEER_BATCHES=${PEER_BATCHES:-$BATCHES}
HF_BATCH=${HF_BATCH:-32}
# The peers run on the workload file of a nopad batch of the same size: a peer batch missing from BATCHES would only be
# skipped at the end of the run, so it stops the run here, before any device time is spent.
for B in $PEER_BATCHES $([ "$HF_BATCH" = none ] || echo "$HF_BATCH"); do
  [ "$B" = none ] && continue
  if [[ " $BATCHES " != *" $B "* ]]; then
    echo "bench.sh: peer batch $B has no nopad batch of that size in BATCHES=\"$BATCHES\"" \
      "(whose workload file the peers read): add $B to BATCHES, or drop it from PEER_BATCHES / HF_BATCH" \
      "(HF_BATCH=none skips Hugging Face)" >&2
    exit 2
  fi
done

NOPAD_SKIP_INSTALL=1 NOPAD_BUILD_DIR=build-gpu NOPAD_CMAKE_ARGS="-DNOPAD_CUDA=ON ${NOPAD_CMAKE_EXTRA:-}" bash scripts/setup.sh
NOPAD=build-gpu/nopad
if [ -n "${BASE_TREE:-}" ]; then
  stamp "build of the base tree $BASE_TREE"
  source scripts/base-tree.sh
  build_base_tree "$BASE_TREE" "$OUT/build-base.log" || exit 1
fi

# Real Wikipedia shards, phase-2 settings (scripts/phase2-shards.sh).
source scripts/phase2-shards.sh
SHARDS=/tmp/nopad-enwiki-shards
phase2_shards "$NOPAD" "$SHARDS"

LAST_BATCH=${BATCHES##* }
HIDDEN_ACTS=${HIDDEN_ACTS:-gelu}
for B in $BATCHES; do
  for ACT in $HIDDEN_ACTS; do
    stamp "nopad bench model batch $B hidden_act $ACT"
    BREAKDOWN=""
    if [ "$B" = "$LAST_BATCH" ]; then BREAKDOWN=--breakdown; fi  # per-op table (a second, event-timed pass)
    # The same shards, seed and batch give the same timed batches whatever the activation: one workload file.
    "$NOPAD" bench model --model data/configs/bert-large-mlperf.json --data "$SHARDS" --batch "$B" --steps 20 \
      --warmup 5 --hidden-act "$ACT" --workload "$OUT/workload-$B.txt" $BREAKDOWN
  done
done

# The last batch once more, without the breakdown, as a line prefixed "variant NAME: " (so the summary below, nopad/peer
# ratios at the defaults, does not take it): variant NAME BINARY CONFIG WARMUP [VAR=VALUE ...].
variant() {
  local name=$1 bin=$2 cfg=$3 warmup=$4
  shift 4
  stamp "nopad bench model batch $LAST_BATCH: variant $name"
  env "$@" "$bin" bench model --model "$cfg" --data "$SHARDS" --batch "$LAST_BATCH" --steps 20 --warmup "$warmup" |
    sed "s|^{|variant $name: {|"
}
BERT_LARGE=data/configs/bert-large-mlperf.json
[ -z "${BASE_TREE:-}" ] || variant base "$BASE_TREE/build-gpu/nopad" $BERT_LARGE 5
# VARIANT_RUNS="NOPAD_GELU_GEMM=0 NOPAD_DGELU_GEMM=0,NOPAD_GELU_TABLE=0": one variant per word (kernel variants that
# read the environment: dense.cu, gemm_sm90.cu); a word's comma-joined settings apply together.
# shellcheck disable=SC2086
for V in ${VARIANT_RUNS:-}; do variant "$V" "$NOPAD" $BERT_LARGE "${VARIANT_WARMUP:-5}" ${V//,/ }; done
# MODEL_VARIANTS="a.json b.json": other model configs (e.g. the attention dropout off: what the compiled peer, whose
# varlen_attn has no dropout, leaves out).
for CFG in ${MODEL_VARIANTS:-}; do variant "model=$(basename "$CFG")" "$NOPAD" "$CFG" 5; done
# After the variants, the default once more: a GPU whose clocks sag during the run shows here (one instance went from
# 225 to 241 ms over a call), and each variant is compared with the mean of the two default runs.
if [ -n "${VARIANT_RUNS:-}${BASE_TREE:-}${MODEL_VARIANTS:-}" ]; then
  variant default-again "$NOPAD" $BERT_LARGE 5
  python3 - "$LOG" "$LAST_BATCH" <<'EOF'
import json, sys
first, variants = None, []
for line in open(sys.argv[1]):
    line = line.strip()
    if line.startswith("variant ") and ": {" in line:
        name, _, js = line[len("variant "):].partition(": ")
        variants.append((name, json.loads(js)["step_ms"]))
    elif first is None and line.startswith('{"bench":"model"'):
        r = json.loads(line)
        if r.get("batch") == int(sys.argv[2]) and r.get("hidden_act", "gelu") == "gelu":
            first = r["step_ms"]
again = dict(variants).get("default-again")
if first is None or again is None:
    sys.exit("variant table: the default runs are missing")
base = (first + again) / 2
print(f"variant table (batch {sys.argv[2]}): default {first:.2f} ms, again {again:.2f} ms (drift {again - first:+.2f})")
for name, ms in variants:
    if name != "default-again":
        print(f"  {name:40s} {ms:8.2f} ms  {ms - base:+6.2f} vs the defaults' mean {base:.2f}")
EOF
fi

stamp "fmha PerfSmoke (dropout 0 vs 0.1)"
build-gpu/nopad_cuda_tests --gtest_filter='Fmha.PerfSmoke' || echo "fmha PerfSmoke failed"

for B in $PEER_BATCHES; do
  [ -f "$OUT/workload-$B.txt" ] || { echo "no workload file for batch $B (add it to BATCHES)"; continue; }
  stamp "peer_torch_varlen batch $B"
  python3 .carry/peers/peer_torch_varlen.py --batch "$B" --steps 20 --compile --lengths "$OUT/workload-$B.txt" ||
    echo "peer_torch_varlen batch $B failed"
done
if [ "${PEER_GELU_TANH:-0}" = 1 ]; then
  python3 - <<'EOF'
src = open(".carry/peers/peer_torch_varlen.py").read()
for a in ("F.gelu(s.f1(x))", "F.gelu(s.mlm_t(x[mpos]))"):
    assert a in src, a
    src = src.replace(a, a[:-1] + ', approximate="tanh")')
open(".carry/peers/peer_torch_varlen_tanh.py", "w").write(src)
EOF
  for B in $PEER_BATCHES; do
    [ -f "$OUT/workload-$B.txt" ] || continue
    stamp "peer_torch_varlen with tanh GELU batch $B"
    python3 .carry/peers/peer_torch_varlen_tanh.py --batch "$B" --steps 20 --compile --lengths "$OUT/workload-$B.txt" |
      sed 's/^{/{"hidden_act": "gelu_new", /' || echo "peer_torch_varlen_tanh batch $B failed"
  done
fi
if [ "${PEER_ATTENTION:-1}" = 1 ] && [ -f "$OUT/workload-$LAST_BATCH.txt" ]; then
  stamp "peer_attention (varlen_attn, batches of 64 from the batch-$LAST_BATCH workload)"
  (cd .carry/peers && python3 peer_attention.py --batch 64 --batches 2 --lengths "$OUT/workload-$LAST_BATCH.txt") ||
    echo "peer_attention failed"
fi
if [ -n "${PROFILE_BATCH:-}" ] && [ -f "$OUT/workload-$PROFILE_BATCH.txt" ]; then
  stamp "profile of peer_torch_varlen --compile at batch $PROFILE_BATCH"
  python3 scripts/profile_peer.py .carry/peers/peer_torch_varlen.py --batch "$PROFILE_BATCH" --steps 6 --warmup 4 \
    --compile --lengths "$OUT/workload-$PROFILE_BATCH.txt" 2>&1 | grep -v -i warn || echo "profile_peer failed"
fi
for B in $HF_BATCH; do
  [ "$B" = none ] && continue
  if [ ! -f "$OUT/workload-$B.txt" ]; then
    echo "no workload file for the Hugging Face batch $B (add $B to BATCHES)"
    continue
  fi
  stamp "peer_hf_bert batch $B"
  python3 .carry/peers/peer_hf_bert.py --batch "$B" --steps 10 --lengths "$OUT/workload-$B.txt" ||
    echo "peer_hf_bert batch $B failed"
done

if [ "${CEILING:-0}" = 1 ]; then
  for B in $BATCHES; do
    [ -f "$OUT/workload-$B.txt" ] || continue
    stamp "products alone, batch $B (products_ceiling.py)"
    python3 scripts/products_ceiling.py --lengths "$OUT/workload-$B.txt" --batch "$B" ||
      echo "products_ceiling batch $B failed"
  done
fi

stamp "summary"
python3 - "$LOG" <<'EOF'
import json, sys
rows = []
for line in open(sys.argv[1]):
    line = line.strip()
    if line.startswith("{") and line.endswith("}"):
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
for r in rows:
    print(json.dumps(r))
def name(r):
    return r.get("bench") or r.get("system") or r.get("name") or "peer"
nopad = {(r["batch"], r.get("hidden_act", "gelu")): r for r in rows if r.get("bench") == "model"}
best_peer = {}
for r in rows:
    if r.get("bench") == "model" or "seqs_per_s" not in r:
        continue
    act = r.get("hidden_act", "gelu")
    key = (name(r), act)
    if key not in best_peer or r["seqs_per_s"] > best_peer[key]["seqs_per_s"]:
        best_peer[key] = r
    for (b, nact), n in sorted(nopad.items()):
        if b == r.get("batch"):
            print(f"batch {b}: nopad ({nact}) {n['seqs_per_s']:.1f} seq/s vs {name(r)} ({act}) {r['seqs_per_s']:.1f}"
                  f" seq/s -> ratio {n['seqs_per_s'] / r['seqs_per_s']:.3f}")
for (pname, act), p in sorted(best_peer.items()):
    for nact in sorted({a for (_, a) in nopad}):
        best = max((n for (b, a), n in nopad.items() if a == nact), key=lambda n: n["seqs_per_s"])
        print(f"best: nopad ({nact}) {best['seqs_per_s']:.1f} seq/s at batch {best['batch']} vs {pname} ({act}) "
              f"{p['seqs_per_s']:.1f} at batch {p.get('batch')} -> {best['seqs_per_s'] / p['seqs_per_s']:.3f}x")
EOF
if [ "${SMI_LOG:-0}" = 1 ] && [ -s "$OUT/smi.csv" ]; then
  kill "$SMI_PID" 2>/dev/null || true
  sleep 0.5
  stamp "clocks by section (samples above 200 W: the GPU at work)"
  python3 - "$LOG" "$OUT/smi.csv" <<'EOF'
import datetime, re, sys
sections = []
for line in open(sys.argv[1]):
    m = re.match(r"== (\d\d:\d\d:\d\d) (.*)", line)
    if m:
        sections.append((m.group(1), m.group(2).strip()))
samples = []
for line in open(sys.argv[2]):
    f = [x.strip() for x in line.split(",")]
    try:
        t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").strftime("%H:%M:%S")
        samples.append((t, float(f[1].split()[0]), float(f[2].split()[0]), f[3] if len(f) > 3 else "?"))
    except (ValueError, IndexError):
        pass
for i, (start, name) in enumerate(sections):
    end = sections[i + 1][0] if i + 1 < len(sections) else "99:99:99"
    busy = [s for s in samples if start <= s[0] < end and s[2] > 200]
    if not busy:
        continue
    mhz = sum(s[1] for s in busy) / len(busy)
    watts = sum(s[2] for s in busy) / len(busy)
    capped = sum(1 for s in busy if s[3].lower().startswith("active")) / len(busy)
    print(f"  {name[:60]:60s} {len(busy):5d} samples  {mhz:6.0f} MHz  {watts:5.0f} W  power-capped {100 * capped:3.0f}%")
EOF
fi
