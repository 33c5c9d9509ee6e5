"""The throughput a run logs is the throughput it gets: every metrics.jsonl line's seq_per_s is the sequences read since
the line before over the training time since then, so the lines' times, samples / seq_per_s summed, add up to the run's
own clock (elapsed_s of the last line) less what evaluations and checkpoints took, and tokens_per_s / seq_per_s is the
window's mean length. A bert-tiny CPU run, without and with evaluations and checkpoints in between."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

from nopad_checks import check, failures
from nopad_test_support import prepare_sample

NOPAD = os.environ["NOPAD_BINARY"]
SRC = os.environ["NOPAD_SOURCE_DIR"]


def train(run, data, *extra):
    r = subprocess.run([NOPAD, "train", "--config", os.path.join(SRC, "configs/bert-tiny-sample.toml"), "--overwrite",
                        "--set", f"run_dir={run}", "--set", f"data.train={data}", "--set", "train.device=cpu",
                        "--set", "train.global_batch=16", "--set", "train.max_steps=30", "--set",
                        "log.interval_steps=5", *extra], capture_output=True, text=True, cwd=SRC)
    check(r.returncode == 0, f"train: {r.stderr[-300:]}")
    return [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl")) if not json.loads(l).get("eval")]


def window_times(lines):
    times, prev = [], 0
    for l in lines:
        times.append((l["samples"] - prev) / l["seq_per_s"])
        prev = l["samples"]
    return times


def main():
    tmp = tempfile.mkdtemp(prefix="nopad-throughput-")
    try:
        data = os.path.join(tmp, "data")
        r = prepare_sample(data)
        check(r.returncode == 0, f"prepare: {r.stderr}")
        lines = train(os.path.join(tmp, "plain"), data, "--set", "data.eval=", "--set", "checkpoint.interval_steps=0")
        check([l["step"] for l in lines] == [5, 10, 15, 20, 25, 30], f"a line every 5 steps: {[l['step'] for l in lines]}")
        total, clock = sum(window_times(lines)), lines[-1]["elapsed_s"]
        check(abs(total - clock) <= 0.02 + 0.02 * clock,
              f"without pauses the lines' times add up to the run's clock: {total:.3f} s vs elapsed_s {clock:.3f} s")
        for l in lines:
            mean_len = l["tokens_per_s"] / l["seq_per_s"]
            check(8 <= mean_len <= 64, f"tokens_per_s / seq_per_s is a mean length of the 64-token data: {mean_len}")
        print(f"no pauses: lines {total:.3f} s, clock {clock:.3f} s")

        lines = train(os.path.join(tmp, "paused"), data, "--set", f"data.eval={data}", "--set",
                      "eval.interval_samples=80", "--set", "eval.max_samples=256", "--set",
                      "checkpoint.interval_steps=10")
        total, clock = sum(window_times(lines)), lines[-1]["elapsed_s"]
        check(total < clock, f"evaluations and checkpoints are not counted as training: {total:.3f} s vs {clock:.3f} s")
        check(total > 0.2 * clock, f"... but the training is: {total:.3f} s of {clock:.3f} s")
        print(f"with evaluations and checkpoints: lines {total:.3f} s, clock {clock:.3f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} check(s) failed", file=sys.stderr)
        sys.exit(1)
    print("throughput log checks passed")


if __name__ == "__main__":
    main()
