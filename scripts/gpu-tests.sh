#!/usr/bin/env bash
# Everything the GPU machine checks in one call: build with the CUDA backend, run the whole test suite, report the
# GPUs, run the Hugging Face compatibility check (transformers is installed there, not in CI), then fp16 end to end:
# bert-tiny trained with train.precision=fp16 and a dynamic loss scale (the loss must fall), a run whose first loss
# scale must overflow (it backs off and goes on), and one bf16-vs-fp16 step-time line of BERT-large.
# Logs go to $OUT (or out/gpu when OUT is unset). Usage: bash scripts/gpu-tests.sh
#   NOPAD_CMAKE_EXTRA="..."   extra CMake arguments (e.g. -DCMAKE_CUDA_ARCHITECTURES=90a-real to build one target)
#   CUDA_TEST_FILTER=PATTERN  GoogleTest filter for nopad_cuda_tests (default: all)
#   SKIP_CTEST=1              skip the CPU test suite (CI runs it; useful when device time is short)
#   ONLY_CUDA_TESTS=1         stop after the CUDA op tests (a kernel iteration; not a full validation)
#   SKIP_CUDA_TESTS=1         skip the CUDA op tests: only the end-to-end checks (Hugging Face, fp16), e.g. to finish
#                             a validation whose first call ran out of time (a full run takes ~10 min on an H100;
#                             CUDA_TEST_FILTER='-CudaPerf/*' leaves out the timing tests)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/gpu}
mkdir -p "$out"
export NOPAD_SKIP_INSTALL=1 NOPAD_BUILD_DIR=build-gpu
status=0
step() { echo "== $*" | tee -a "$out/summary.txt"; }

step "build (CUDA on)"
NOPAD_CMAKE_ARGS="-DNOPAD_CUDA=ON ${NOPAD_CMAKE_EXTRA:-}" bash scripts/setup.sh > "$out/build.log" 2>&1 || { tail -50 "$out/build.log"; exit 1; }
./build-gpu/nopad info | tee -a "$out/summary.txt"

if [ "${SKIP_CUDA_TESTS:-0}" != 1 ]; then
  step "CUDA op tests (nopad_cuda_tests, GPU vs CPU twin)"
  ./build-gpu/nopad_cuda_tests --gtest_brief=0 --gtest_filter="${CUDA_TEST_FILTER:-*}" > "$out/cuda-tests.log" 2>&1 ||
    status=1
  grep -E "^\[ +(OK|FAILED) +\]|PASSED|FAILED|perf|TFLOP" "$out/cuda-tests.log" | tee -a "$out/summary.txt"
else
  step "CUDA op tests skipped (SKIP_CUDA_TESTS=1)"
fi
if [ "${ONLY_CUDA_TESTS:-0}" = 1 ]; then
  step "stopped after the CUDA op tests (ONLY_CUDA_TESTS=1): status $status"
  exit $status
fi

if [ "${SKIP_CTEST:-0}" != 1 ]; then
  step "ctest"
  ctest --test-dir build-gpu -j 8 --output-on-failure --timeout 1200 > "$out/ctest.log" 2>&1 || status=1
  tail -15 "$out/ctest.log" | tee -a "$out/summary.txt"
fi

step "Hugging Face compatibility (transformers $(python3 -c 'import transformers; print(transformers.__version__)'))"
hf=/tmp/nopad-hf
./build-gpu/nopad prepare --input data/wiki-sample/wiki_00 --vocab data/vocab/bert-uncased-vocab.txt \
  --output $hf/data --max-seq-length 128 --dupe-factor 1 --overwrite --quiet > "$out/hf.log" 2>&1
./build-gpu/nopad train --config configs/bert-tiny-sample.toml --set run_dir=$hf/run --set data.train=$hf/data \
  --set data.eval=$hf/data --set train.max_steps=20 --overwrite >> "$out/hf.log" 2>&1 || status=1
ckpt=$hf/run/checkpoints/$(cat $hf/run/checkpoints/latest)
for n in 8 32; do
  python3 scripts/hf_compat.py --nopad ./build-gpu/nopad --checkpoint "$ckpt" --data $hf/data --samples $n \
    2>&1 | tee -a "$out/hf.log" "$out/summary.txt" || status=1
done
# The tanh GELU (hidden_act "gelu_new": nopad's GEMM epilogues in training): the exported config names it, so
# Hugging Face runs its own tanh GELU on the checkpoint and must agree.
python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); c["hidden_act"]="gelu_new"; json.dump(c, open(sys.argv[2],"w"))' \
  data/configs/bert-tiny.json $hf/bert-tiny-gelu-new.json
./build-gpu/nopad train --config configs/bert-tiny-sample.toml --set run_dir=$hf/run-tanh --set data.train=$hf/data \
  --set data.eval=$hf/data --set model.config=$hf/bert-tiny-gelu-new.json --set train.max_steps=20 --overwrite \
  >> "$out/hf.log" 2>&1 || status=1
ckpt=$hf/run-tanh/checkpoints/$(cat $hf/run-tanh/checkpoints/latest)
grep -q '"gelu_new"' "$ckpt/config.json" || { echo "hf: gelu_new checkpoint config lacks hidden_act gelu_new" | tee -a "$out/summary.txt"; status=1; }
python3 scripts/hf_compat.py --nopad ./build-gpu/nopad --checkpoint "$ckpt" --data $hf/data --samples 32 \
  2>&1 | sed 's/^/gelu_new: /' | tee -a "$out/hf.log" "$out/summary.txt" || status=1

# fp16 end to end, on the data prepared above. check_fp16 MODE RUN_DIR LOG RC: one summary line, exit 1 on failure.
#   train:    the run finished (exit 0, step 50), fp16 with a dynamic loss scale, every metrics line carries
#             loss_scale, and the loss fell (mean of the first 5 applied steps - mean of the last 10 > 1.0; bert-tiny
#             goes from ~11.0 to ~8.0 in 50 steps of this config on the CPU)
#   overflow: the run finished, "overflow at loss scale" was logged, metrics has skipped steps, the scale fell below
#             its start, and the last step was applied with a finite loss
check_fp16() {
  python3 - "$@" <<'PY'
import json, math, sys
mode, run, log_path, rc = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
log = open(log_path, errors="replace").read()
problems = []
if rc != 0:
    problems.append(f"nopad train exited {rc}: " + " | ".join(log.strip().splitlines()[-2:]))
if "fp16, dynamic loss scale" not in log:
    problems.append("the device line does not say 'fp16, dynamic loss scale'")
try:
    lines = [json.loads(l) for l in open(run + "/metrics.jsonl")]
except OSError as e:
    lines = []
    problems.append(f"no metrics.jsonl: {e}")
steps = [l for l in lines if not l.get("eval")]
if not steps:
    problems.append("no training lines in metrics.jsonl")
missing = [l["step"] for l in steps if "loss_scale" not in l]
if missing:
    problems.append(f"{len(missing)} metrics lines without loss_scale (first: step {missing[0]})")
applied = [l for l in steps if not l.get("skipped") and l.get("loss") is not None]
skipped = [l["step"] for l in steps if l.get("skipped")]
scales = [l["loss_scale"] for l in steps if "loss_scale" in l]
detail = ""
if mode == "train":
    if steps and steps[-1]["step"] != 50:
        problems.append(f"last step {steps[-1]['step']}, expected 50")
    if len(applied) >= 15:
        first = sum(l["loss"] for l in applied[:5]) / 5
        last = sum(l["loss"] for l in applied[-10:]) / 10
        detail = f"loss {first:.3f} -> {last:.3f} (first 5 / last 10 applied steps)"
        if not first - last > 1.0:
            problems.append(f"the loss did not fall enough: {detail}")
    else:
        problems.append(f"only {len(applied)} applied steps")
else:
    if "overflow at loss scale" not in log:
        problems.append("no 'overflow at loss scale' line in the log")
    if not skipped:
        problems.append("no skipped step in metrics.jsonl")
    if scales and not min(scales) < scales[0]:
        problems.append(f"the loss scale never fell below its start {scales[0]}")
    if steps and (steps[-1].get("skipped") or steps[-1].get("loss") is None or not math.isfinite(steps[-1]["loss"])):
        problems.append(f"the last step ({steps[-1]['step']}) was not applied with a finite loss")
    if steps:
        detail = f"last step {steps[-1]['step']} loss {steps[-1].get('loss')}"
if scales:
    detail += f", loss scale {scales[0]:g} -> {scales[-1]:g}"
detail += f", {len(skipped)} overflow steps skipped {skipped[:8]}"
print(f"fp16 {mode}: {'FAILED: ' + '; '.join(problems) if problems else 'OK'} ({len(steps)} steps logged, {detail.strip(', ')})")
sys.exit(1 if problems else 0)
PY
}

step "fp16 training (bert-tiny, 50 steps, train.precision=fp16, dynamic loss scale)"
fp=/tmp/nopad-fp16
./build-gpu/nopad train --config configs/bert-tiny-sample.toml --set run_dir=$fp/run --set data.train=$hf/data \
  --set data.eval=$hf/data --set eval.max_samples=256 --set train.device=cuda --set train.precision=fp16 \
  --set train.max_steps=50 --set log.interval_steps=1 --overwrite > "$out/fp16-train.log" 2>&1
check_fp16 train $fp/run "$out/fp16-train.log" $? 2>&1 | tee -a "$out/summary.txt" || status=1

step "fp16 overflow (loss scale starting at 2^24, the largest allowed: the NSP gradient alone overflows fp16)"
./build-gpu/nopad train --config configs/bert-tiny-sample.toml --set run_dir=$fp/overflow --set data.train=$hf/data \
  --set data.eval=$hf/data --set eval.max_samples=256 --set train.device=cuda --set train.precision=fp16 \
  --set train.loss_scale=dynamic --set train.loss_scale_init=16777216 --set train.max_steps=20 \
  --set log.interval_steps=1 --overwrite > "$out/fp16-overflow.log" 2>&1
check_fp16 overflow $fp/overflow "$out/fp16-overflow.log" $? 2>&1 | tee -a "$out/summary.txt" || status=1

step "bf16 vs fp16 step time (BERT-large, batch 64 of the sample data, 10 timed steps)"
for prec in bf16 fp16; do
  if ./build-gpu/nopad bench model --model data/configs/bert-large-mlperf.json --data $hf/data --batch 64 --steps 10 \
      --warmup 3 --precision $prec > "$out/bench-$prec.json" 2> "$out/bench-$prec.log"; then
    python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print("perf bench bert-large batch 64 %s: %.2f ms/step, %.1f seq/s, %.1f TFLOP/s, %d skipped, final loss %s" % (j["precision"], j["step_ms"], j["seqs_per_s"], j["model_tflops"], j["skipped_steps"], j["final_loss"]))' \
      "$out/bench-$prec.json" | tee -a "$out/summary.txt"
  else
    echo "perf bench $prec FAILED: $(tail -1 "$out/bench-$prec.log")" | tee -a "$out/summary.txt"
    status=1
  fi
done
# The energy meter (core/energy.h, NVML): on a GPU machine the report carries the board's power and the SM clock
# over the timed steps, within what an H100 / H200 can draw and clock.
python3 - "$out/bench-bf16.json" <<'PY' 2>&1 | tee -a "$out/summary.txt" || status=1
import json, sys
j = json.load(open(sys.argv[1]))
problems = [k for k in ("power_w", "energy_j_per_seq", "sm_clock_mhz", "power_capped") if k not in j]
if not problems:
    if not 50 < j["power_w"] < 1500: problems.append(f"power_w {j['power_w']}")
    if not 100 < j["sm_clock_mhz"] < 3000: problems.append(f"sm_clock_mhz {j['sm_clock_mhz']}")
    if not 0 < j["energy_j_per_seq"] < 100: problems.append(f"energy_j_per_seq {j['energy_j_per_seq']}")
    if not 0 <= j["power_capped"] <= 1: problems.append(f"power_capped {j['power_capped']}")
print(("energy meter: FAILED: " + ", ".join(problems)) if problems else
      f"energy meter: OK ({j['power_w']:.0f} W, {j['energy_j_per_seq']:.3f} J/seq, SM {j['sm_clock_mhz']:.0f} MHz, "
      f"power cap active in {100 * j['power_capped']:.0f}% of samples)")
sys.exit(1 if problems else 0)
PY

step "done, status $status"
exit $status
