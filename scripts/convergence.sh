#!/usr/bin/env bash
# The convergence comparison of nopad and its PyTorch twin (docs/convergence.md): bert-base from scratch at sequence
# length 128 on the 2015 Wikipedia sample, configs/convergence-bert-base.toml on both systems, two seeds each, the
# held-out masked-LM accuracy curves compared, plus a nopad run resumed from its mid-way checkpoint.
# Run on the GPU machine from the repository root, with the corpus carried in .carry/. Stages can be split over
# several calls; the prepared data, run folders and results stay in $WORK while the machine stays up, and every
# call copies the results so far to $OUT (give earlier calls' files back with PRIOR=DIR to compare them):
#   STAGES="equiv nopad1 nopad2" bash scripts/convergence.sh ; STAGES="torch1" bash scripts/convergence.sh ; ...
# nopad is built when $NOPAD is missing (the nopad target only, CUDA for CUDA_ARCH, default 90a-real: ~3-5 min;
# stages that only need `nopad prepare` build it without CUDA, ~1 min).
# Stages (default: all, in this order; estimated H100 times):
#   data     prepare the training shards and the 10,000-sample held-out eval set (~1 min; done by any stage that
#            needs them and they are missing)
#   equiv    compare_twins.py: nopad vs torch_pretrain.py from the same weights, dropout 0, 20 steps: fp32 on the CPU
#            (bert-tiny, tight tolerance), then bf16 on the GPU (the config's bert-base) (~2 min)
#   nopad1, nopad2   nopad train, seeds 1 and 2 (~3 min each: 384,000 samples at a few thousand seq/s + 16 evals)
#   torch1, torch2   torch_pretrain.py, seeds 1 and 2, torch.compile unless TORCH_COMPILE=0, eager if compiling
#                    fails (~4-6 min each)
#   resume   nopad seed 1 resumed from nopad1's mid-way checkpoint to the end (~2 min; without nopad1's checkpoint
#            in $WORK it first trains seed 1 to that step, ~4 min)
# After the stages, scripts/plot_convergence.py compares every run whose metrics exist so far. $OUT receives at most 8
# files: metrics-{nopad1,nopad2,torch1,torch2,resume}.jsonl, summary.txt (tables, verdicts, equivalence reports,
# stage timings), convergence.svg, log.txt (this call's stages: timings and the key lines of their logs).
# Environment: OUT (default out/convergence-results), WORK (out/convergence), NOPAD (build-gpu/nopad), PYTHON
# (python3, with torch), CONFIG (configs/convergence-bert-base.toml), DEVICE (cuda; cpu for a smoke test),
# SETS ("key=value ..." overrides for every run of both systems), TORCH_COMPILE (1), CORPUS (a text file or folder;
# default .carry/enwiki-20150515-AA.txt.xz decompressed), DUPE (2), EVAL_SAMPLES (10000), CUDA_ARCH (90a-real),
# PRIOR (a folder of metrics-*.jsonl from earlier calls, compared with this call's; this call's runs win).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out/convergence-results}
WORK=${WORK:-$ROOT/out/convergence}
NOPAD=${NOPAD:-build-gpu/nopad}
PYTHON=${PYTHON:-python3}
CONFIG=${CONFIG:-configs/convergence-bert-base.toml}
DEVICE=${DEVICE:-cuda}
STAGES=${STAGES:-equiv nopad1 nopad2 torch1 torch2 resume}
TORCH_COMPILE=${TORCH_COMPILE:-1}
DUPE=${DUPE:-2}
EVAL_SAMPLES=${EVAL_SAMPLES:-10000}
RES=$WORK/results
LOGS=$WORK/logs
mkdir -p "$OUT" "$RES" "$LOGS"
[[ $NOPAD = /* ]] || NOPAD=$ROOT/$NOPAD
LOG=$OUT/log.txt
: >"$LOG"
export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}

say() { echo "$*" | tee -a "$LOG"; }
read -r -a USER_SETS <<<"${SETS:-}"
set_args() { local s; for s in "${USER_SETS[@]}" "$@"; do printf '%s\0%s\0' --set "$s"; done; }
cfg() { "$PYTHON" -c "import nopad_twin, sys; print(nopad_twin.load_train_config(sys.argv[1], sys.argv[2:])['$1'])" \
          "$CONFIG" "${USER_SETS[@]}"; }
TRAIN=$WORK/train
EVAL=$WORK/eval
# Keys every run of both systems gets.
common_sets() { set_args "data.train=$TRAIN" "data.eval=$EVAL" "train.device=$DEVICE" "$@"; }

# nopad itself: the CUDA build for training (need=cuda), or any build for `nopad prepare`.
ensure_nopad() {
  local need=$1
  if [ -x "$NOPAD" ]; then
    [ "$need" != cuda ] || [ "$DEVICE" != cuda ] || "$NOPAD" info 2>/dev/null | grep -q "cuda backend: built" || {
      say "$NOPAD has no CUDA backend"; return 1; }
    return 0
  fi
  if [ "$need" = cuda ] && [ "$DEVICE" = cuda ]; then
    say "building $NOPAD (CUDA, ${CUDA_ARCH:-90a-real}; log $LOGS/build.log)"
    local dir
    dir=$(dirname "$NOPAD")
    cmake -S . -B "$dir" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release -DNOPAD_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90a-real}" >"$LOGS/build.log" 2>&1 &&
      cmake --build "$dir" --target nopad -j "$(nproc)" >>"$LOGS/build.log" 2>&1 ||
      { tail -30 "$LOGS/build.log" | tee -a "$LOG"; return 1; }
  else
    PREP_NOPAD=$ROOT/build-prep/nopad
    [ -x "$PREP_NOPAD" ] && return 0
    say "building $PREP_NOPAD (no CUDA, for nopad prepare; log $LOGS/build.log)"
    cmake -S . -B build-prep "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release -DNOPAD_CUDA=OFF -DNOPAD_TESTS=OFF \
      >"$LOGS/build.log" 2>&1 && cmake --build build-prep --target nopad -j "$(nproc)" >>"$LOGS/build.log" 2>&1 ||
      { tail -30 "$LOGS/build.log" | tee -a "$LOG"; return 1; }
  fi
}
PREP_NOPAD=$NOPAD
GENERATOR=()
command -v ninja >/dev/null && GENERATOR=(-G Ninja)

stage_data() {
  ensure_nopad any
  local stamp="corpus=${CORPUS:-enwiki-20150515-AA} dupe=$DUPE eval=$EVAL_SAMPLES seq=128 pred=20"
  if [ -f "$TRAIN/dataset.json" ] && [ -f "$EVAL/dataset.json" ] && [ "$(cat "$WORK/data.stamp" 2>/dev/null)" = "$stamp" ]; then
    say "data: $TRAIN and $EVAL already prepared ($stamp)"
    return 0
  fi
  local corpus=${CORPUS:-}
  if [ -z "$corpus" ]; then
    corpus=/tmp/nopad-enwiki-AA.txt
    [ -f "$corpus" ] || xz -dc .carry/enwiki-20150515-AA.txt.xz >"$corpus"
  fi
  [ -x "$NOPAD" ] && PREP_NOPAD=$NOPAD
  "$PREP_NOPAD" prepare --input "$corpus" --vocab data/vocab/bert-uncased-vocab.txt --output "$TRAIN" \
    --eval-output "$EVAL" --eval-samples "$EVAL_SAMPLES" --max-seq-length 128 --max-predictions 20 \
    --dupe-factor "$DUPE" --overwrite 2>>"$LOGS/data.log" | tee -a "$LOG"
  echo "$stamp" >"$WORK/data.stamp"
}

stage_equiv() {
  ensure_nopad cuda
  local ok=0
  : >"$LOGS/equiv.log"
  rm -f "$RES/equiv-cpu.txt" "$RES/equiv-gpu.txt"
  # fp32 on the CPU: bert-tiny, so that both systems' CPU paths take seconds; a larger lr moves the weights more.
  "$PYTHON" scripts/compare_twins.py --nopad "$NOPAD" --config "$CONFIG" --python "$PYTHON" --device cpu \
    --set model.config=data/configs/bert-tiny.json --set train.global_batch=32 --set optim.lr=0.02 \
    $(for s in "${USER_SETS[@]}"; do printf -- '--set %s ' "$s"; done) \
    --data "$TRAIN" --eval "$EVAL" --eval-samples 256 --steps 20 --work "$WORK/equiv-cpu" \
    --report "$RES/equiv-cpu.txt" >>"$LOGS/equiv.log" 2>&1 || ok=1
  tail -3 "$RES/equiv-cpu.txt" 2>/dev/null | tee -a "$LOG"
  if [ "$DEVICE" = cuda ]; then
    "$PYTHON" scripts/compare_twins.py --nopad "$NOPAD" --config "$CONFIG" --python "$PYTHON" --device cuda \
      $(for s in "${USER_SETS[@]}"; do printf -- '--set %s ' "$s"; done) \
      --data "$TRAIN" --eval "$EVAL" --eval-samples 1024 --steps 20 --work "$WORK/equiv-gpu" \
      --report "$RES/equiv-gpu.txt" >>"$LOGS/equiv.log" 2>&1 || ok=1
    tail -3 "$RES/equiv-gpu.txt" 2>/dev/null | tee -a "$LOG"
  fi
  [ $ok = 0 ] || { tail -20 "$LOGS/equiv.log" | tee -a "$LOG"; return 1; }
}

run_nopad() {  # NAME SEED [extra sets...] [--resume]
  local name=$1 seed=$2 mode=--overwrite
  shift 2
  local extra=()
  for a in "$@"; do if [ "$a" = --resume ]; then mode=--resume; else extra+=("$a"); fi; done
  local -a args
  mapfile -d '' args < <(common_sets "run_dir=$WORK/$name" "train.seed=$seed" "${extra[@]}")
  "$NOPAD" train --config "$CONFIG" "${args[@]}" "$mode" >>"$LOGS/$name.log" 2>&1
}

stage_nopad() {  # SEED
  ensure_nopad cuda
  local name=nopad$1
  : >"$LOGS/$name.log"
  run_nopad "$name" "$1" || return 1
  cp "$WORK/$name/metrics.jsonl" "$RES/metrics-$name.jsonl"
}

stage_torch() {  # SEED
  local name=torch$1 compile=()
  [ "$TORCH_COMPILE" = 1 ] && compile=(--compile)
  local -a args
  mapfile -d '' args < <(common_sets "train.seed=$1")
  : >"$LOGS/$name.log"
  if ! "$PYTHON" scripts/torch_pretrain.py --config "$CONFIG" "${args[@]}" --out "$WORK/$name" "${compile[@]}" \
      >>"$LOGS/$name.log" 2>&1; then
    [ ${#compile[@]} -gt 0 ] || return 1
    say "$name: the compiled run failed (log $LOGS/$name.log); running eager"
    tail -5 "$LOGS/$name.log" >>"$LOG"
    "$PYTHON" scripts/torch_pretrain.py --config "$CONFIG" "${args[@]}" --out "$WORK/$name" \
      >>"$LOGS/$name.log" 2>&1 || return 1
  fi
  cp "$WORK/$name/metrics.jsonl" "$RES/metrics-$name.jsonl"
  cp "$WORK/$name/summary.json" "$RES/summary-$name.json"
}

stage_resume() {
  ensure_nopad cuda
  local mid rd=$WORK/resume
  mid=$(cfg checkpoint.interval_steps) || return 1
  [ "$mid" -gt 0 ] || { say "resume: checkpoint.interval_steps is 0: no mid-way checkpoint"; return 1; }
  local ckpt
  ckpt=$(printf 'step_%08d' "$mid")
  rm -rf "$rd"
  mkdir -p "$rd/checkpoints"
  : >"$LOGS/resume.log"
  if [ -d "$WORK/nopad1/checkpoints/$ckpt" ]; then
    # nopad1's own mid-way checkpoint and its metrics (nopad drops the lines after the checkpoint on --resume).
    cp -r "$WORK/nopad1/checkpoints/$ckpt" "$rd/checkpoints/"
    echo "$ckpt" >"$rd/checkpoints/latest"
    cp "$WORK/nopad1/metrics.jsonl" "$rd/metrics.jsonl"
    say "resume: from nopad1's checkpoint $ckpt"
  else
    say "resume: no nopad1 checkpoint in $WORK: training seed 1 to step $mid first"
    run_nopad resume 1 "train.max_steps=$mid" || return 1
  fi
  run_nopad resume 1 --resume || return 1
  grep -E "resuming from" "$LOGS/resume.log" | tee -a "$LOG"
  cp "$rd/metrics.jsonl" "$RES/metrics-resume.jsonl"
}

run_stage() {
  local s=$1 t0 rc
  t0=$(date +%s)
  say "=== stage $s ($(date -u +%H:%M:%S) UTC)"
  set +e
  case $s in
    data) (set -e; stage_data) ;;
    equiv) (set -e; ensure_nopad cuda; stage_data >/dev/null; stage_equiv) ;;
    nopad[0-9]*) (set -e; ensure_nopad cuda; stage_data >/dev/null; stage_nopad "${s#nopad}") ;;
    torch[0-9]*) (set -e; stage_data >/dev/null; stage_torch "${s#torch}") ;;
    resume) (set -e; ensure_nopad cuda; stage_data >/dev/null; stage_resume) ;;
    *) say "unknown stage $s (data equiv nopadN torchN resume)"; false ;;
  esac
  rc=$?
  local dt=$(($(date +%s) - t0))
  [ -f "$LOGS/$s.log" ] && grep -E "^device:|^torch .* on |eval at step|^done|^final|error" "$LOGS/$s.log" |
    tail -25 >>"$LOG"
  if [ $rc != 0 ]; then
    say "stage $s FAILED (exit $rc) after ${dt} s; its log: $LOGS/$s.log"
    [ -f "$LOGS/$s.log" ] && tail -15 "$LOGS/$s.log" >>"$LOG"
    failed+=("$s")
  else
    say "stage $s done in ${dt} s"
  fi
  echo "$s $(date -u +%FT%TZ) ${dt}s $([ $rc = 0 ] && echo ok || echo FAILED)" >>"$RES/timings.txt"
}

failed=()
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sed 's/^/gpu: /' | tee -a "$LOG"
say "nopad $NOPAD, config $CONFIG, device $DEVICE, work $WORK, stages: $STAGES${SETS:+, sets: $SETS}"
for s in $STAGES; do run_stage "$s"; done

# Compare whatever has been run so far (this call, earlier ones in $WORK, or files given back in PRIOR).
if [ -n "${PRIOR:-}" ]; then
  for f in "$PRIOR"/metrics-*.jsonl; do [ -f "$f" ] && [ ! -f "$RES/$(basename "$f")" ] && cp "$f" "$RES/"; done
fi
runs=()
for n in nopad1 nopad2 torch1 torch2; do [ -f "$RES/metrics-$n.jsonl" ] && runs+=("$n=$RES/metrics-$n.jsonl"); done
if [ ${#runs[@]} -gt 0 ]; then
  resume=()
  [ -f "$RES/metrics-resume.jsonl" ] && grep -q '"step"' "$RES/metrics-nopad1.jsonl" 2>/dev/null &&
    resume=(--resume "$RES/metrics-resume.jsonl" --resume-of nopad1
            --resume-after "$(($(cfg checkpoint.interval_steps) * $(cfg train.global_batch)))")
  {
    echo "# nopad vs PyTorch twin: convergence ($(date -u +%F), $CONFIG${SETS:+, sets: $SETS})"
    echo
    "$PYTHON" scripts/plot_convergence.py "${runs[@]}" "${resume[@]}" --svg "$RES/convergence.svg"
    for n in torch1 torch2; do
      [ -f "$RES/summary-$n.json" ] && echo "$n summary: $(tr -d '\n' <"$RES/summary-$n.json" | tr -s ' ')"
    done
    echo
    for f in equiv-cpu equiv-gpu; do [ -f "$RES/$f.txt" ] && { echo "## Equivalence ($f)"; echo; cat "$RES/$f.txt"; echo; }; done
    echo "## Stage timings (all calls)"
    echo
    cat "$RES/timings.txt"
  } >"$RES/summary.txt" 2>&1
  sed -n '/^Agreement/p;/^Throughput/p;/CONTINUES\|DOES NOT/p' "$RES/summary.txt" | tee -a "$LOG"
fi
for f in "$RES"/metrics-*.jsonl "$RES/summary.txt" "$RES/convergence.svg"; do [ -f "$f" ] && cp "$f" "$OUT/"; done
if [ ${#failed[@]} -gt 0 ]; then
  say "FAILED stages: ${failed[*]}"
  exit 1
fi
say "all stages passed; results in $OUT"
