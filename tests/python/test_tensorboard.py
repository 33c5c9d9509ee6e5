"""`nopad train` writes TensorBoard event files (RUN_DIR/tensorboard/) that TensorBoard's own readers read as the run
metrics.jsonl describes: every numeric field of every training line as train/<key> (lr as train/learning_rate) and of
every eval line as eval/<key> (eval_loss as eval/loss), at the line's step, with the line's value rounded to float32,
nothing else. Then the run is resumed from its mid-way checkpoint after it had logged further (a job pre-empted after
its checkpoint): TensorBoard's readers (EventAccumulator, and the plugin accumulator its server's Python path uses)
drop the first file's points past the checkpoint on the second file's SessionLog START, so each tag has one value per
step, and it is the resumed run's (its throughput differs from the first run's). Every record's checksums are checked
with TensorBoard's masked CRC-32C. Also: log.tensorboard = false writes none, log.tensorboard_dir moves them, and
--overwrite deletes the run's old event files. Needs the tensorboard package (scripts/setup.sh installs it)."""
import glob
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np

from nopad_checks import check, failures
from nopad_test_support import NOPAD, SRC, prepare_sample

try:
    from tensorboard.backend.event_processing import event_accumulator, event_file_loader, event_multiplexer
    from tensorboard.backend.event_processing import plugin_event_accumulator
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    from tensorboard.util import tensor_util
except ImportError as e:
    sys.exit(f"test_tensorboard: the tensorboard package is missing ({e}): run scripts/setup.sh (pip install "
             "tensorboard)")

SKIPPED_KEYS = {"eval", "step", "samples", "eval_samples"}


def train(mode, run, data, steps, *extra):
    """bert-tiny on the CPU, 8 sequences a step, a metrics line every step, an evaluation every 8 steps and a
    checkpoint every 12; mode is --overwrite or --resume."""
    return subprocess.run([NOPAD, "train", "--config", os.path.join(SRC, "configs/bert-tiny-sample.toml"), mode,
                           "--set", f"run_dir={run}", "--set", f"data.train={data}", "--set", f"data.eval={data}",
                           "--set", "train.device=cpu", "--set", "train.threads=2", "--set", "train.global_batch=8",
                           "--set", f"train.max_steps={steps}", "--set", "eval.interval_samples=64", "--set",
                           "eval.max_samples=16", "--set", "log.interval_steps=1", "--set",
                           "checkpoint.interval_steps=12", "--set", "checkpoint.keep=0", *extra],
                          capture_output=True, text=True, cwd=SRC)


def expected_scalars(run):
    """{tag: {step: float32 value}} from run/metrics.jsonl, as nopad maps the fields to tags."""
    want = {}
    for line in open(os.path.join(run, "metrics.jsonl")):
        j = json.loads(line)
        prefix = "eval/" if j.get("eval") else "train/"
        for key, v in j.items():
            if key in SKIPPED_KEYS or v is None or isinstance(v, str):
                continue
            name = {"lr": "learning_rate"}.get(key, key)
            if j.get("eval") and key == "eval_loss":
                name = "loss"
            steps = want.setdefault(prefix + name, {})
            check(j["step"] not in steps, f"metrics.jsonl has one {prefix + name} per step ({j['step']})")
            steps[j["step"]] = float(np.float32(float(v)))
    return want


def accumulated(logdir):
    """{tag: [(step, value)]} as EventAccumulator reads logdir (every point kept, orphaned ones purged)."""
    acc = event_accumulator.EventAccumulator(logdir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def multiplexed(logdir):
    """{run: {tag: [(step, value)]}} as `tensorboard --logdir logdir` finds runs (every folder below it with event
    files is one)."""
    mux = event_multiplexer.EventMultiplexer(size_guidance={event_accumulator.SCALARS: 0})
    mux.AddRunsFromDirectory(logdir)
    mux.Reload()
    return {run: {tag: [(s.step, s.value) for s in mux.Scalars(run, tag)] for tag in tags["scalars"]}
            for run, tags in mux.Runs().items()}


def plugin_accumulated(logdir):
    """The same through plugin_event_accumulator (simple_value migrated to scalar tensors, as TensorBoard's server
    reads them without its Rust data server)."""
    acc = plugin_event_accumulator.EventAccumulator(logdir, size_guidance={plugin_event_accumulator.TENSORS: 0})
    acc.Reload()
    return {tag: [(t.step, float(tensor_util.make_ndarray(t.tensor_proto))) for t in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]}


def compare(got, want, what):
    """got {tag: [(step, value)]} against want {tag: {step: value}}: the same tags, one point per logged step."""
    check(set(got) == set(want), f"{what}: tags {sorted(got)} vs metrics.jsonl's {sorted(want)}")
    for tag in sorted(set(got) & set(want)):
        steps = [s for s, _ in got[tag]]
        check(steps == sorted(want[tag]), f"{what}: {tag} steps {steps} vs metrics.jsonl's {sorted(want[tag])}")
        bad = [(s, v, want[tag].get(s)) for s, v in got[tag] if want[tag].get(s) != v]
        check(not bad, f"{what}: {tag} values differ from metrics.jsonl (step, event, line): {bad[:3]}")


def check_records(path):
    """Every TFRecord of an event file: whole, with the length's and the data's masked CRC-32C right. Returns the
    number of records."""
    data = open(path, "rb").read()
    at, n = 0, 0
    while at < len(data):
        if len(data) - at < 16:
            check(False, f"{path}: a truncated record at byte {at}")
            break
        (length,) = struct.unpack_from("<Q", data, at)
        (len_crc,) = struct.unpack_from("<I", data, at + 8)
        check(len_crc == masked_crc32c(data[at:at + 8]), f"{path}: the length CRC of the record at byte {at}")
        payload = data[at + 12:at + 12 + length]
        (data_crc,) = struct.unpack_from("<I", data, at + 12 + length)
        check(data_crc == masked_crc32c(payload), f"{path}: the data CRC of the record at byte {at}")
        at += 16 + length
        n += 1
    return n


def event_files(logdir):
    return sorted(glob.glob(os.path.join(logdir, "*tfevents*")))


def raw_events(path):
    return list(event_file_loader.EventFileLoader(path).Load())


def main():
    tmp = tempfile.mkdtemp(prefix="nopad-tensorboard-")
    try:
        data = os.path.join(tmp, "data")
        r = prepare_sample(data)
        check(r.returncode == 0, f"prepare: {r.stderr}")
        run = os.path.join(tmp, "run")
        tb = os.path.join(run, "tensorboard")

        # 1. A fresh run of 24 steps: checkpoints at 12 and 24, evaluations at 8, 16, 24.
        r = train("--overwrite", run, data, 24)
        check(r.returncode == 0, f"training: {r.stderr[-500:]}")
        files = event_files(tb)
        check(len(files) == 1 and files[0].endswith(".nopad"), f"one event file in RUN_DIR/tensorboard: {files}")
        first = raw_events(files[0])
        check(first[0].file_version == "brain.Event:2", f"the first record is the file version: {first[0]}")
        check(first[1].HasField("session_log") and first[1].session_log.status == first[1].session_log.START
              and first[1].step == 1, f"then a SessionLog START at step 1: {first[1]}")
        check(check_records(files[0]) == len(first), "every record of the first file read")
        want_first = expected_scalars(run)
        for tag in ("train/loss", "train/mlm_loss", "train/nsp_loss", "train/mlm_accuracy", "train/learning_rate",
                    "train/grad_norm", "train/seq_per_s", "train/tokens_per_s", "train/elapsed_s",
                    "eval/mlm_accuracy", "eval/nsp_accuracy", "eval/loss", "eval/mlm_loss", "eval/nsp_loss"):
            check(tag in want_first, f"metrics.jsonl gives {tag}")
        check(sorted(want_first["train/loss"]) == list(range(1, 25)), "24 training lines")
        check(sorted(want_first["eval/mlm_accuracy"]) == [8, 16, 24], "evaluations at steps 8, 16, 24")
        compare(accumulated(tb), want_first, "first run, EventAccumulator")
        runs = multiplexed(run)
        check(list(runs) == ["tensorboard"], f"--logdir RUN_DIR: one run, RUN_DIR/tensorboard: {list(runs)}")
        compare(runs.get("tensorboard", {}), want_first, "first run, --logdir RUN_DIR")
        compare(plugin_accumulated(tb), want_first, "first run, plugin_event_accumulator")

        # 2. Pre-empted after its step-12 checkpoint: resume from it to step 30. metrics.jsonl drops steps 13-24 and
        # logs 13-30 anew; the first event file still holds 13-24, the second START at 13 then 13-30.
        with open(os.path.join(run, "checkpoints", "latest"), "w") as f:
            f.write("step_00000012\n")
        r = train("--resume", run, data, 30)
        check(r.returncode == 0 and "resuming from" in r.stderr, f"resumed training: {r.stderr[-500:]}")
        files = event_files(tb)
        check(len(files) == 2, f"a second event file: {files}")
        second = raw_events(files[-1])
        check(second[1].HasField("session_log") and second[1].session_log.status == second[1].session_log.START
              and second[1].step == 13, f"the resumed run's START is at step 13: {second[1]}")
        check(check_records(files[-1]) == len(second), "every record of the second file read")
        want = expected_scalars(run)
        check(sorted(want["train/loss"]) == list(range(1, 31)), "metrics.jsonl: one line per step 1-30")
        check(sorted(want["eval/mlm_accuracy"]) == [8, 16, 24, 30], "evaluations at 8, then 16, 24 and 30 resumed")
        resumed_rates = {s: want["train/seq_per_s"][s] for s in range(13, 25)}
        check(any(resumed_rates[s] != want_first["train/seq_per_s"][s] for s in resumed_rates),
              "the resumed steps' throughput differs from the first run's (so the check below can tell them apart)")
        got = accumulated(tb)
        compare(got, want, "resumed run, EventAccumulator")
        check(all(len({s for s, _ in pts}) == len(pts) for pts in got.values()), "one value per step after the resume")
        compare(plugin_accumulated(tb), want, "resumed run, plugin_event_accumulator")
        runs = multiplexed(tmp)  # the parent of several runs
        check(os.path.join("run", "tensorboard") in runs, f"--logdir of the runs' parent: {list(runs)}")
        compare(runs.get(os.path.join("run", "tensorboard"), {}), want, "resumed run, --logdir PARENT")
        # Without the purge the first file's steps 13-24 would be there twice: they are in the files.
        raw_steps = [e.step for f in files for e in raw_events(f) if e.HasField("summary")
                     and any(v.tag == "train/loss" for v in e.summary.value)]
        check(sorted(raw_steps) == sorted(list(range(1, 25)) + list(range(13, 31))),
              f"the files hold both runs' steps 13-24: {sorted(raw_steps)}")

        # 3. log.tensorboard = false writes no event file; log.tensorboard_dir puts them elsewhere; --overwrite
        # deletes the run's own.
        off = os.path.join(tmp, "off")
        r = train("--overwrite", off, data, 2, "--set", "log.tensorboard=false")
        check(r.returncode == 0 and not os.path.exists(os.path.join(off, "tensorboard")),
              f"log.tensorboard = false: no RUN_DIR/tensorboard: {r.stderr[-300:]}")
        elsewhere = os.path.join(tmp, "tb-elsewhere")
        r = train("--overwrite", off, data, 2, "--set", f"log.tensorboard_dir={elsewhere}")
        check(r.returncode == 0 and len(event_files(elsewhere)) == 1
              and not os.path.exists(os.path.join(off, "tensorboard")),
              f"log.tensorboard_dir: the event file there: {event_files(elsewhere)} {r.stderr[-300:]}")
        compare(accumulated(elsewhere), expected_scalars(off), "log.tensorboard_dir")
        r = train("--overwrite", run, data, 2)
        check(r.returncode == 0 and len(event_files(tb)) == 1, f"--overwrite deletes the old event files: "
              f"{event_files(tb)} {r.stderr[-300:]}")
        compare(accumulated(tb), expected_scalars(run), "overwritten run")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} failure(s)")
        sys.exit(1)
    print("test_tensorboard: all checks passed")


if __name__ == "__main__":
    main()
