"""scripts/project_ttt.py (the projected MLPerf BERT time-to-train of the scale-out measurement): MLPerf's eval interval
rule at the batches the rules quote (150k at 448, 175k at 3,072), the RCP samples exactly at an RCP batch and linear
between two, the count of evaluations and trained samples, the minutes for a given rate (evaluations measured and
estimated), the olympic mean of an RCP file written here, the built-in table against mlperf-logging's newest file when
that is installed, and refusals (a batch outside the RCPs, a bad rate, a missing file) with exit status 2 and a
message. Needs no GPU or nopad binary."""
import json
import math
import os
import subprocess
import sys
import tempfile

from nopad_checks import check, failures

SRC = os.environ.get("NOPAD_SOURCE_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SCRIPT = os.path.join(SRC, "scripts", "project_ttt.py")
sys.path.insert(0, os.path.join(SRC, "scripts"))
import project_ttt as pt  # noqa: E402


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)


# MLPerf's eval interval examples.
check(pt.eval_interval(448) == 150_000, f"interval at 448: {pt.eval_interval(448)}")
check(pt.eval_interval(3072) == 175_000, f"interval at 3072: {pt.eval_interval(3072)}")

table = {256: 2_500_000, 448: 2_400_000, 1536: 2_800_000}
s, src = pt.rcp_samples(table, 448)
check(s == 2_400_000 and "RCP at batch 448" in src, f"exact RCP: {s} {src}")
s, src = pt.rcp_samples(table, 992)  # halfway between 448 and 1536
check(abs(s - 2_600_000) < 1e-6 and "448" in src and "1536" in src, f"interpolated RCP: {s} {src}")

# 448 at 8,000 seq/s: 2.4M samples -> 16 evaluations of 150k -> 2.4M trained; 5 min of training, 16 x 2 s of evals.
r = pt.project(8000.0, 448, table, eval_s=2.0)
check(r["evals"] == 16 and r["trained_samples"] == 2_400_000, f"evals {r['evals']}, trained {r['trained_samples']}")
check(abs(r["train_minutes"] - 5.0) < 1e-9, f"train minutes {r['train_minutes']}")
check(abs(r["minutes"] - (5.0 + 32.0 / 60)) < 1e-9 and not r["eval_seconds_estimated"], f"minutes {r['minutes']}")
# Not a multiple of the interval: trained up to the next evaluation; estimated evals at 3x the training rate.
r = pt.project(6000.0, 992, table)
check(r["evals"] == math.ceil(2_600_000 / pt.eval_interval(992)), f"evals at 992: {r['evals']}")
check(r["trained_samples"] == r["evals"] * pt.eval_interval(992) >= 2_600_000, f"trained {r['trained_samples']}")
check(r["eval_seconds_estimated"] and abs(r["eval_seconds_each"] - 10_000 / 18_000) < 1e-12,
      f"estimated eval seconds {r['eval_seconds_each']}")

with tempfile.TemporaryDirectory() as tmp:
    # An RCP file in mlperf-logging's format: the olympic mean drops the fastest and the slowest run.
    path = os.path.join(tmp, "rcps_bert.json")
    json.dump({"bert_ref_448": {"BS": 448, "Epochs to converge": [1_000_000, 2_000_000, 2_200_000, 2_400_000,
                                                                  9_000_000]},
               "bert_ref_1536": {"BS": 1536, "Epochs to converge": [3_000_000, 3_000_000, 3_000_000]}},
              open(path, "w"))
    loaded = pt.load_rcps(path)
    check(loaded == {448: 2_200_000, 1536: 3_000_000}, f"olympic means {loaded}")
    p = run("--seqs-per-s", "4000", "--global-batch", "448", "--rcp-file", path, "--json")
    check(p.returncode == 0, f"--json run failed: {p.stderr}")
    if p.returncode == 0:
        j = json.loads(p.stdout)
        check(j["rcp_samples"] == 2_200_000 and j["evals"] == 15 and j["rcp_file"] == path, f"json line {j}")
    p = run("--seqs-per-s", "4000", "--global-batch", "448", "--rcp-file", path)
    check(p.returncode == 0 and "total" in p.stdout and "min" in p.stdout, f"text output: {p.stdout} {p.stderr}")

    for args, what in ((["--seqs-per-s", "4000", "--global-batch", "100", "--rcp-file", path], "outside the RCP"),
                       (["--seqs-per-s", "0", "--global-batch", "448", "--rcp-file", path], "positive"),
                       (["--seqs-per-s", "4000", "--global-batch", "448", "--eval-s", "-1", "--rcp-file", path],
                        "non-negative"),
                       (["--seqs-per-s", "4000", "--global-batch", "448", "--rcp-file", os.path.join(tmp, "none")],
                        "cannot read RCPs")):
        p = run(*args)
        check(p.returncode == 2 and what in p.stderr, f"refusal {args}: status {p.returncode}, {p.stderr.strip()}")

# The built-in means are the newest mlperf-logging file's olympic means (when the package is installed).
newest = pt.default_rcp_source()
if newest is None:
    print("  mlperf-logging not installed: the built-in table is not compared")
else:
    got = pt.load_rcps(newest)
    for bs, mean in pt.RCP_MEANS.items():
        check(bs in got and abs(got[bs] - mean) <= 1000, f"built-in RCP at {bs}: {mean} vs {got.get(bs)} in {newest}")

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("project_ttt: all checks passed")
