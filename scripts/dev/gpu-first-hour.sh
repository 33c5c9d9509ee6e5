#!/usr/bin/env bash
# GPU checks of the first-hour features, one stage after another (STAGES, default all but quickstart):
#   sanity     bert-tiny trained on the GPU on the quickstart data; nopad fill-mask and nopad eval on --device cuda
#              against --device cpu (same checkpoint): top-5 tokens and probabilities, accuracy and loss
#   logcheck   BERT-large, batch 256, a metrics line every 5 steps, on the 103 MB Wikipedia text (.carry/*.txt.xz,
#              read compressed by nopad prepare at MLPerf's settings): every line's seq/s against the samples over
#              the elapsed time between the lines
#   sweep      quickstart recipes for the CPU (bert-tiny) trained on the GPU for the samples the CPU gets through in
#              about 4 minutes, each ending with nopad fill-mask on probe sentences (SWEEP_SET=1); SWEEP_SET=2: the
#              same much longer, larger batches and lower rates, and bert-mini
#   emerge     how many samples bert-tiny and bert-mini need before fill-mask answers with content words: recipes at
#              the sample counts 2 CPU cores reach in ~4 minutes (64- and 128-token data), and longer ones with a
#              checkpoint every 200 steps, each checkpoint asked the probe sentences
#   quickstart configs/quickstart-gpu.toml as scripts/quickstart.sh runs it on a GPU, timed, with its fill-mask
# Logs go to $OUT (or out/first-hour). NOPAD=path of the nopad binary (default build-fp8/nopad, which
# scripts/dev/fp8-groundwork.sh builds; `cmake --build build-fp8 --target nopad` first).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out=${OUT:-out/first-hour}
mkdir -p "$out"
nopad=${NOPAD:-./build-fp8/nopad}
work=${WORK:-/tmp/nopad-first-hour}
mkdir -p "$work"
stages=${STAGES:-sanity logcheck sweep}
vocab=data/vocab/bert-uncased-vocab.txt
status=0
note() { echo "$*" | tee -a "$out/summary.txt"; }
probes=("the united [MASK] of america." "world war [MASK]." "new [MASK] city." "in the [MASK] century."
        "he was born on 12 [MASK] 1950." "the [MASK] river flows into the sea.")

prepare_quickstart_data() {
  [ -f "$work/qs/train/dataset.json" ] && return 0
  $nopad prepare --input data/wiki-sample/wiki_00 data/wiki-sample/wiki_01 data/wiki-sample/wiki_02 --vocab $vocab \
    --output "$work/qs/train" --max-seq-length "${1:-128}" --dupe-factor 5 --overwrite --quiet > /dev/null &&
  $nopad prepare --input data/wiki-sample/wiki_03 --vocab $vocab --output "$work/qs/eval" --max-seq-length 128 \
    --dupe-factor 1 --seed 4321 --overwrite --quiet > /dev/null
}

# Quickstart recipes for the sweep stage, one per line: name | train data | steps | --set overrides.
recipes() {
  case $1 in
  1) cat <<EOF
base|$work/qs/train|700|
lr02|$work/qs/train|700|--set optim.lr=0.02 --set schedule.warmup_steps=100
nodrop|$work/qs/train|700|--set model.config=$work/bert-tiny-nodrop.json
nodrop-lr02|$work/qs/train|700|--set model.config=$work/bert-tiny-nodrop.json --set optim.lr=0.02 --set schedule.warmup_steps=100
len64|$work/qs64/train|1400|
len64-nodrop-lr02|$work/qs64/train|1400|--set model.config=$work/bert-tiny-nodrop.json --set optim.lr=0.02 --set schedule.warmup_steps=100
nodrop-lr04|$work/qs/train|700|--set model.config=$work/bert-tiny-nodrop.json --set optim.lr=0.04 --set schedule.warmup_steps=150
long-nodrop-lr02|$work/qs/train|3000|--set model.config=$work/bert-tiny-nodrop.json --set optim.lr=0.02 --set schedule.warmup_steps=100
EOF
  ;;
  2) cat <<EOF
lamb01-long|$work/qs/train|20000|--set eval.interval_samples=64000
lamb01-b128-long|$work/qs/train|10000|--set train.global_batch=128 --set eval.interval_samples=128000
lamb005|$work/qs/train|700|--set optim.lr=0.005
lamb002|$work/qs/train|700|--set optim.lr=0.002
mini-lamb01|$work/qs/train|700|--set model.config=$PWD/data/configs/bert-mini.json
mini-lamb005|$work/qs/train|700|--set model.config=$PWD/data/configs/bert-mini.json --set optim.lr=0.005
EOF
  ;;
  esac
}

for stage in $stages; do
  t0=$(date +%s)
  case $stage in
  sanity)
    prepare_quickstart_data || { note "sanity: prepare failed"; status=1; continue; }
    $nopad train --config configs/quickstart.toml --overwrite --set run_dir="$work/sanity" \
      --set data.train="$work/qs/train" --set data.eval="$work/qs/eval" --set train.device=cuda \
      --set train.max_steps=300 > "$out/sanity-train.log" 2>&1 || { note "sanity: train failed"; status=1; }
    ck=$work/sanity/checkpoints/$(cat "$work/sanity/checkpoints/latest")
    for d in cuda cpu; do
      $nopad fill-mask --checkpoint "$ck" --device $d --json --top-k 5 "${probes[@]}" > "$out/fill-$d.jsonl" \
        2>> "$out/sanity.log" || status=1
      $nopad eval --checkpoint "$ck" --data "$work/qs/eval" --device $d --max-samples 1024 > "$out/eval-$d.json" \
        2>> "$out/sanity.log" || status=1
    done
    python3 - "$out" <<'PY' | tee -a "$out/summary.txt" || status=1
import json, sys
o = sys.argv[1]
g = [json.loads(l) for l in open(f"{o}/fill-cuda.jsonl")]
c = [json.loads(l) for l in open(f"{o}/fill-cpu.jsonl")]
worst, same = 0.0, 0
for a, b in zip(g, c):
    for ma, mb in zip(a["masks"], b["masks"]):
        same += [x["token"] for x in ma][:3] == [x["token"] for x in mb][:3]
        for x, y in zip(ma, mb):
            if x["token"] == y["token"]:
                worst = max(worst, abs(x["score"] - y["score"]) / y["score"])
ec, ep = json.load(open(f"{o}/eval-cuda.json")), json.load(open(f"{o}/eval-cpu.json"))
print(f"sanity: fill-mask cuda vs cpu: top-3 identical for {same} of {sum(len(a['masks']) for a in c)} masks, "
      f"worst relative probability difference {worst:.3g}; eval mlm_accuracy cuda {ec['mlm_accuracy']:.4f} "
      f"cpu {ep['mlm_accuracy']:.4f}, loss cuda {ec['loss']:.4f} cpu {ep['loss']:.4f}")
ok = worst < 0.05 and abs(ec["loss"] - ep["loss"]) < 0.01 * ep["loss"] and abs(ec["mlm_accuracy"] - ep["mlm_accuracy"]) < 0.01
print("sanity:", "OK" if ok else "FAILED")
sys.exit(0 if ok else 1)
PY
    ;;
  logcheck)
    xzf=$(ls .carry/*.txt.xz 2>/dev/null | head -1)
    [ -n "$xzf" ] || { note "logcheck: no .carry/*.txt.xz"; status=1; continue; }
    # Through standard input: the GPU machine's nopad may be built without liblzma.
    { command -v xz > /dev/null && xz -dc "$xzf" ||
        python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' "$xzf"; } |
      $nopad prepare --input - --vocab $vocab --output "$work/enwiki" --overwrite --quiet > "$out/logcheck.log" 2>&1 ||
      { note "logcheck: prepare failed"; tail -3 "$out/logcheck.log"; status=1; continue; }
    note "logcheck: prepared $xzf in $(( $(date +%s) - t0 )) s ($(python3 -c "import json; print(json.load(open('$work/enwiki/dataset.json'))['num_seqs'])") sequences)"
    $nopad train --config configs/mlperf-phase2.toml --overwrite --set run_dir="$work/large" \
      --set data.train="$work/enwiki" --set data.eval= --set train.global_batch=256 --set train.grad_accumulation=1 \
      --set train.max_steps=60 --set log.interval_steps=5 --set checkpoint.interval_steps=0 \
      --set train.target_mlm_accuracy=0 >> "$out/logcheck.log" 2>&1 || { note "logcheck: train failed"; status=1; }
    grep -E "^step|^device" "$out/logcheck.log" | tail -14 >> "$out/summary.txt"
    python3 - "$work/large/metrics.jsonl" <<'PY' | tee -a "$out/summary.txt" || status=1
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if not json.loads(l).get("eval")]
print("logcheck: step  seq/s logged  samples/elapsed between lines  ratio")
worst, prev = 0.0, None
for l in lines:
    if prev is not None:
        wall = (l["samples"] - prev["samples"]) / (l["elapsed_s"] - prev["elapsed_s"])
        r = l["seq_per_s"] / wall
        worst = max(worst, abs(r - 1))
        print(f"logcheck: {l['step']:5d}  {l['seq_per_s']:9.1f}  {wall:9.1f}  {r:.4f}")
    prev = l
total = sum((b["samples"] - a["samples"]) / b["seq_per_s"] for a, b in zip(lines, lines[1:]))
span = lines[-1]["elapsed_s"] - lines[0]["elapsed_s"]
print(f"logcheck: lines' times {total:.2f} s over an elapsed span of {span:.2f} s; worst line-vs-wall {worst:.3%}")
print("logcheck:", "OK" if worst < 0.03 else "FAILED")
sys.exit(0 if worst < 0.03 else 1)
PY
    ;;
  sweep)
    prepare_quickstart_data || { note "sweep: prepare failed"; status=1; continue; }
    # dropout-free bert-tiny
    python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); c["hidden_dropout_prob"]=0.0; c["attention_probs_dropout_prob"]=0.0; json.dump(c, open(sys.argv[2],"w"), indent=2)' \
      data/configs/bert-tiny.json "$work/bert-tiny-nodrop.json"
    [ -f "$work/qs64/train/dataset.json" ] || $nopad prepare --input data/wiki-sample/wiki_00 data/wiki-sample/wiki_01 \
      data/wiki-sample/wiki_02 --vocab $vocab --output "$work/qs64/train" --max-seq-length 64 --max-predictions 10 \
      --dupe-factor 5 --overwrite --quiet > /dev/null
    # name | train data | steps | --set overrides
    while IFS='|' read -r name data steps sets; do
      [ -n "$name" ] || continue
      run=$work/sweep-$name
      # shellcheck disable=SC2086
      timeout 150 $nopad train --config configs/quickstart.toml --overwrite --set run_dir="$run" --set data.train="$data" \
        --set data.eval="$work/qs/eval" --set train.device=cuda --set train.max_steps="$steps" \
        --set checkpoint.interval_steps=0 $sets > "$out/sweep-$name.log" 2>&1 || { note "sweep $name: train failed"; continue; }
      acc=$(grep "^eval at" "$out/sweep-$name.log" | sed -E 's/.*mlm accuracy ([0-9.]+).*/\1/' | tr '\n' ' ')
      ck=$run/checkpoints/$(cat "$run/checkpoints/latest")
      note "sweep $name ($steps steps, $sets): eval acc $acc"
      $nopad fill-mask --checkpoint "$ck" --device cuda --top-k 4 "${probes[@]}" 2>/dev/null | grep "\[MASK\]" |
        sed "s/^/sweep $name: /" | tee -a "$out/summary.txt" > /dev/null
    done < <(recipes "${SWEEP_SET:-1}")
    ;;
  emerge)
    prepare_quickstart_data || { note "emerge: prepare failed"; status=1; continue; }
    for split in train eval; do
      [ -f "$work/e64/$split/dataset.json" ] && continue
      files="data/wiki-sample/wiki_00 data/wiki-sample/wiki_01 data/wiki-sample/wiki_02"; dupe=5; seed=12345
      [ $split = eval ] && { files=data/wiki-sample/wiki_03; dupe=1; seed=4321; }
      # shellcheck disable=SC2086
      $nopad prepare --input $files --vocab $vocab --output "$work/e64/$split" --max-seq-length 64 \
        --max-predictions 10 --dupe-factor $dupe --seed $seed --overwrite --quiet > /dev/null
    done
    # name | length | steps | checkpoint every | --set overrides
    while IFS='|' read -r name len steps every sets; do
      [ -n "$name" ] || continue
      run=$work/emerge-$name
      data=$work/qs; [ "$len" = 64 ] && data=$work/e64
      # shellcheck disable=SC2086
      timeout 150 $nopad train --config configs/quickstart.toml --overwrite --set run_dir="$run" \
        --set data.train="$data/train" --set data.eval="$data/eval" --set train.device=cuda \
        --set train.max_steps="$steps" --set checkpoint.interval_steps="$every" --set checkpoint.keep=0 \
        --set eval.interval_samples=0 $sets > "$out/emerge-$name.log" 2>&1 || { note "emerge $name: train failed"; continue; }
      for ck in "$run"/checkpoints/step_*; do
        $nopad fill-mask --checkpoint "$ck" --device cuda --json --top-k 3 "${probes[@]}" 2>/dev/null |
          python3 -c '
import json, sys
function = set("the , . of and in a to \" is was ( ) - his her its as by for on at an which that with".split())
tops = [json.loads(l)["masks"][0][0]["token_str"] for l in sys.stdin]
print(f"{sum(t not in function for t in tops)}/{len(tops)} content:", " ".join(tops))' |
          sed "s|^|emerge $name $(basename "$ck"): |" | tee -a "$out/summary.txt" > /dev/null
      done
      note "emerge $name: $(grep '^final' "$out/emerge-$name.log")"
    done <<EOF
t128-b128|128|200|200|--set train.global_batch=128 --set schedule.warmup_steps=30
t64-b128|64|420|420|--set train.global_batch=128 --set schedule.warmup_steps=40
t64-b128-lr02|64|420|420|--set train.global_batch=128 --set schedule.warmup_steps=40 --set optim.lr=0.02
t64-b64|64|840|840|--set train.global_batch=64
m64-b64|64|230|230|--set model.config=$PWD/data/configs/bert-mini.json --set train.global_batch=64 --set optim.lr=0.005 --set schedule.warmup_steps=40
m64-b32|64|460|460|--set model.config=$PWD/data/configs/bert-mini.json --set optim.lr=0.005 --set schedule.warmup_steps=40
t64-b128-long|64|1600|200|--set train.global_batch=128 --set schedule.warmup_steps=40
m64-b128-long|64|800|200|--set model.config=$PWD/data/configs/bert-mini.json --set train.global_batch=128 --set optim.lr=0.006 --set schedule.warmup_steps=100
EOF
    ;;
  quickstart)
    prepare_quickstart_data || { note "quickstart: prepare failed"; status=1; continue; }
    sed -e "s|\.\./out/quickstart/train|$work/qs/train|; s|\.\./out/quickstart/eval|$work/qs/eval|; s|\.\./out/quickstart/run-gpu|$work/qs-gpu|; s|\.\./data/|$PWD/data/|" \
      configs/quickstart-gpu.toml > "$work/quickstart-gpu.toml"
    ts=$(date +%s)
    timeout 400 $nopad train --config "$work/quickstart-gpu.toml" --overwrite > "$out/quickstart-gpu.log" 2>&1 ||
      { note "quickstart: train failed"; status=1; }
    note "quickstart (GPU): training $(( $(date +%s) - ts )) s"
    grep -E "^eval at|^final|^device" "$out/quickstart-gpu.log" | tee -a "$out/summary.txt" > /dev/null
    ck=$work/qs-gpu/checkpoints/$(cat "$work/qs-gpu/checkpoints/latest")
    $nopad fill-mask --checkpoint "$ck" --top-k 5 "${probes[@]}" 2>&1 | sed 's/^/quickstart: /' | tee -a "$out/summary.txt" > /dev/null
    ;;
  *) note "unknown stage $stage"; status=1 ;;
  esac
  note "== $stage: $(( $(date +%s) - t0 )) s"
done
exit $status
