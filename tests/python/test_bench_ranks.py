"""`nopad bench model` on several ranks (mpiexec, CPU engine, bert-tiny on the shipped wiki sample): one report from
rank 0 (one JSON line on stdout, the per-rank table on stderr), the global batch split with --batch sequences per rank,
per-rank compute and reduction times whose max/mean is consistent, and the same learning as one process running the
whole global batch: 2 ranks x 8 sequences end the timed steps at the same loss as 1 process x 16 (only float summation
order differs), in every balancing mode and with the bf16 reduction close to it. Bad options are refused. Run by CTest
with NOPAD_BINARY and NOPAD_SOURCE_DIR set; needs mpiexec."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

from nopad_checks import check, failures
from nopad_test_support import NOPAD, SRC, mpiexec, prepare_sample


def bench(data, ranks, batch, extra=()):
    cmd = [NOPAD, "bench", "model", "--model", os.path.join(SRC, "data/configs/bert-tiny.json"), "--data", data,
           "--batch", str(batch), "--steps", "5", "--warmup", "2", "--device", "cpu", "--threads", "1", *extra]
    if ranks > 1:
        cmd = mpiexec("test_bench_ranks") + ["-np", str(ranks)] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def main():
    tmp = tempfile.mkdtemp(prefix="nopad-bench-ranks-")
    try:
        data = os.path.join(tmp, "data")
        r = prepare_sample(data)
        check(r.returncode == 0, f"prepare: {r.stderr}")

        r = bench(data, 1, 16)
        check(r.returncode == 0, f"one process: {r.stderr[-400:]}")
        one = json.loads(r.stdout)
        for mode in ("none", "stratified", "cost"):
            r = bench(data, 2, 8, ("--balance", mode))
            check(r.returncode == 0, f"2 ranks, {mode}: exit {r.returncode}: {r.stderr[-400:]}")
            if r.returncode != 0:
                continue
            lines = [l for l in r.stdout.splitlines() if l.strip()]
            check(len(lines) == 1, f"2 ranks, {mode}: one JSON line (rank 0 only), got {len(lines)}")
            j = json.loads(lines[0])
            check(j["ranks"] == 2 and j["batch"] == 8 and j["global_batch"] == 16 and j["balance"] == mode,
                  f"2 ranks, {mode}: the report's layout {j}")
            check(len(j["per_rank"]) == 2 and [p["rank"] for p in j["per_rank"]] == [0, 1], f"per_rank {j['per_rank']}")
            comp = [p["compute_ms"] for p in j["per_rank"]]
            check(all(c > 0 for c in comp) and j["compute_ms_max"] >= j["compute_ms"] > 0 and
                  j["compute_imbalance"] >= 1.0 and j["reduce_ms_max"] >= j["reduce_ms"] >= 0,
                  f"2 ranks, {mode}: timing fields {j}")
            check(abs(j["compute_ms"] - sum(comp) / 2) <= 1e-6 * j["compute_ms"], "compute_ms is the ranks' mean")
            check(sum(p["tokens"] for p in j["per_rank"]) * 1.0 == j["mean_length"] * 5 * 16,
                  f"the ranks' tokens add up to the global batches': {j}")
            check(abs(j["seqs_per_s_per_rank"] * 2 - j["seqs_per_s"]) <= 1e-9 * j["seqs_per_s"], "per-rank seq/s")
            check(abs(j["final_loss"] - one["final_loss"]) <= 1e-5 * abs(one["final_loss"]),
                  f"2 ranks, {mode}: final loss {j['final_loss']} vs one process {one['final_loss']}")
            check(r.stderr.count("compute per step:") == 1 and "rank     compute ms" in r.stderr,
                  f"2 ranks, {mode}: one per-rank table: {r.stderr[-600:]!r}")
            print(f"  2 ranks, balance {mode}: final loss {j['final_loss']:.6f} (one process "
                  f"{one['final_loss']:.6f}), compute max/mean {j['compute_imbalance']:.4f}")

        r = bench(data, 2, 8, ("--reduce", "bf16"))
        check(r.returncode == 0, f"2 ranks, bf16: {r.stderr[-400:]}")
        if r.returncode == 0:
            j = json.loads(r.stdout)
            check(j["reduce"] == "bf16" and "gradients summed in bf16" in r.stderr, "bf16 reduction is reported")
            check(abs(j["final_loss"] - one["final_loss"]) <= 1e-3 * abs(one["final_loss"]),
                  f"bf16: final loss {j['final_loss']} vs {one['final_loss']}")

        for extra, msg in ((("--reduce", "fp16"), "--reduce must be fp32 or bf16"),
                           (("--balance", "random"), "unknown balance mode 'random'"),
                           (("--breakdown",), "measure one GPU"),
                           (None, "is larger than the dataset")):
            r = bench(data, 2, 100000) if extra is None else bench(data, 2, 8, extra)
            check(r.returncode != 0 and msg in r.stderr, f"{extra}: refused with '{msg}': {r.stderr[-800:]!r}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        sys.exit(f"test_bench_ranks: {len(failures)} failure(s)")
    print("test_bench_ranks: OK")


if __name__ == "__main__":
    main()
