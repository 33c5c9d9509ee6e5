"""Data-parallel `nopad train` under mpiexec equals one process on the same global batch: bert-tiny on the shipped
wiki sample (CPU engine), the same config run by 1 process and by 2 and 4 ranks with each balancing mode. Checks the
loss of every step (1e-4 relative: only float summation order differs), the final weights (read from the rank-0
checkpoint), that only rank 0 wrote metrics and printed progress, and that ranks given different configs refuse to
start. Run by CTest with NOPAD_BINARY and NOPAD_SOURCE_DIR set; needs mpiexec (scripts/setup.sh installs Open MPI)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from nopad_checks import check, failures
from nopad_test_support import NOPAD, SRC, losses, mpiexec, prepare_sample
from nopad_twin import read_safetensors


def train(ranks, run_dir, data, extra=(), check_rc=True):
    cmd = [NOPAD, "train", "--config", os.path.join(SRC, "configs/bert-tiny-sample.toml"), "--overwrite",
           "--set", f"run_dir={run_dir}", "--set", f"data.train={data}", "--set", "data.eval=\"\"",
           "--set", "train.device=cpu", "--set", "train.threads=1", "--set", "train.global_batch=8",
           "--set", "train.grad_accumulation=2", "--set", "train.max_steps=6", "--set", "log.interval_steps=1",
           "--set", "checkpoint.interval_steps=0", *extra]
    if ranks > 1:
        cmd = mpiexec("test_train_mpi") + ["-np", str(ranks)] + cmd
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=SRC)
    if check_rc and r.returncode != 0:
        print(r.stdout, r.stderr)
    return r


def weights(run_dir):
    ck = os.path.join(run_dir, "checkpoints")
    latest = open(os.path.join(ck, "latest")).read().strip()
    return read_safetensors(os.path.join(ck, latest, "model.safetensors"))


def main():
    tmp = tempfile.mkdtemp(prefix="nopad-mpi-train-")
    try:
        data = os.path.join(tmp, "data")
        r = prepare_sample(data)
        check(r.returncode == 0, f"prepare: {r.stderr}")
        info = subprocess.run([NOPAD, "info"], capture_output=True, text=True).stdout
        if "mpi: built" not in info:
            sys.exit("test_train_mpi: this nopad was built without MPI (nopad info: " + info.strip().splitlines()[-1] +
                     "); install libopenmpi-dev and reconfigure")

        one = os.path.join(tmp, "one")
        r = train(1, one, data)
        check(r.returncode == 0, "single-process training runs")
        ref_loss, ref_w = losses(one), weights(one)
        check(len(ref_loss) == 6, f"6 metrics lines, got {len(ref_loss)}")

        for ranks, balance in [(2, "cost"), (4, "none"), (4, "stratified"), (4, "cost")]:
            what = f"{ranks} ranks, dist.balance {balance}"
            run_dir = os.path.join(tmp, f"np{ranks}-{balance}")
            r = train(ranks, run_dir, data, ("--set", f"dist.balance={balance}"))
            check(r.returncode == 0, f"{what}: exit code {r.returncode}")
            if r.returncode != 0:
                continue
            check(f"data parallel: {ranks} ranks" in r.stderr, f"{what}: says it runs data parallel")
            check(r.stderr.count("per-rank timing over 6 steps: compute ") == 1 and "slowest rank" in r.stderr,
                  f"{what}: one closing per-rank timing line: {r.stderr[-600:]!r}")
            check(r.stderr.count("done: step 6") == 1, f"{what}: one 'done' line (rank 0 only): {r.stderr!r}")
            check(r.stdout.count("final: step 6") == 1, f"{what}: one final line: {r.stdout!r}")
            got = losses(run_dir)
            check(len(got) == len(ref_loss), f"{what}: {len(got)} metrics lines (one writer), expected {len(ref_loss)}")
            # Per-rank timing: every step line has the mean and slowest rank's compute time and the reduction time.
            lines = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if l.strip()]
            for l in lines:
                ok = all(k in l for k in ("compute_ms", "compute_ms_max", "compute_imbalance", "reduce_ms",
                                          "reduce_ms_max"))
                check(ok, f"{what}: step {l.get('step')} lacks per-rank timing: {sorted(l)}")
                if ok:
                    check(0 < l["compute_ms"] <= l["compute_ms_max"] and l["compute_imbalance"] >= 1.0 and
                          0 <= l["reduce_ms"] <= l["reduce_ms_max"], f"{what}: step {l['step']} timing {l}")
            for step, (a, b) in enumerate(zip(ref_loss, got), 1):
                check(abs(a - b) <= 1e-4 * abs(a), f"{what}: step {step} loss {b} vs one process {a}")
            w = weights(run_dir)
            # Every tensor, the attention key biases included: their gradient is exactly zero (q.(k + b) shifts all of
            # a query's scores by q.b, which softmax ignores; ops.h), so they stay as initialised in every run.
            worst, worst_name = max((float(np.max(np.abs(w[k] - ref_w[k]))) /
                                     max(1e-12, float(np.max(np.abs(ref_w[k])))), k) for k in ref_w)
            print(f"  {what}: losses {['%.5f' % x for x in got]}; weights max rel diff {worst:.2e} ({worst_name})")
            check(worst <= 1e-3, f"{what}: final weights differ from one process's by {worst:.2e} (relative)")

        # dist.clip = bucket: every gradient bucket is clipped before its all-reduce (each rank's share to
        # max_grad_norm / ranks). With a threshold far below every bucket's norm, one process reports a gradient norm
        # of exactly max_grad_norm * sqrt(buckets) at every step (LAMB's own clipping is off); 2 ranks' summed buckets
        # are at most max_grad_norm each, so their norm can only be smaller.
        c = 1e-4
        norms = {}
        for ranks in (1, 2):
            run_dir = os.path.join(tmp, f"bucket-clip-np{ranks}")
            r = train(ranks, run_dir, data, ("--set", "dist.clip=bucket", "--set", f"optim.max_grad_norm={c}"))
            check(r.returncode == 0, f"dist.clip=bucket, {ranks} rank(s): exit code {r.returncode}: {r.stderr[-300:]}")
            if r.returncode == 0:
                norms[ranks] = [json.loads(l)["grad_norm"] for l in open(os.path.join(run_dir, "metrics.jsonl"))
                                if l.strip()]
        if 1 in norms and 2 in norms:
            one_norm = norms[1][0]
            buckets = (one_norm / c) ** 2
            check(abs(buckets - round(buckets)) < 1e-2 and round(buckets) >= 3,
                  f"one process: every step's gradient norm is max_grad_norm * sqrt(buckets): {norms[1]}")
            check(all(abs(n - one_norm) <= 1e-4 * one_norm for n in norms[1]), f"the same at every step: {norms[1]}")
            check(all(0.1 * c < n <= one_norm * (1 + 1e-4) for n in norms[2]),
                  f"2 ranks: every summed bucket within max_grad_norm: {norms[2]} vs {one_norm}")
            print(f"  dist.clip=bucket: 1 process {one_norm:.4e} (= {c} x sqrt({round(buckets)})), 2 ranks "
                  f"{['%.4e' % n for n in norms[2]]}")
        # dist.reduce = bf16: 2 ranks sum their gradients in bf16. The same run as fp32's up to bf16 rounding of the
        # gradients: losses within 1e-3 relative over 6 steps, but not identical after the first update.
        run_dir = os.path.join(tmp, "np2-bf16")
        r = train(2, run_dir, data, ("--set", "dist.reduce=bf16"))
        check(r.returncode == 0, f"dist.reduce=bf16, 2 ranks: exit code {r.returncode}: {r.stderr[-300:]}")
        if r.returncode == 0:
            check("gradients summed in bf16" in r.stderr, f"dist.reduce=bf16 is announced: {r.stderr[-600:]!r}")
            got = losses(run_dir)
            check(len(got) == len(ref_loss) and got[0] == got[0], f"bf16 reduction: {len(got)} metrics lines")
            check(all(abs(a - b) <= 1e-3 * abs(a) for a, b in zip(ref_loss, got)),
                  f"bf16 reduction: losses {got} vs one process {ref_loss}")
            check(any(a != b for a, b in zip(ref_loss[1:], got[1:])), f"bf16 reduction changed nothing: {got}")
            print(f"  dist.reduce=bf16, 2 ranks: losses {['%.5f' % x for x in got]}")
        # data.placement = partitioned: the same data cut into 4 shards, each rank's folder holding only its shards
        # (i % 2 == rank) and the manifest; data.train names them with {rank}. 2 ranks exchanging samples must
        # train as one process on the whole dataset (loss for loss), and a rank missing a shard is refused by name.
        multi = os.path.join(tmp, "multi")
        r = prepare_sample(multi, "--seqs-per-shard", "1000")
        check(r.returncode == 0, f"prepare (4 shards): {r.stderr}")
        shards = sorted(f for f in os.listdir(multi) if f.endswith(".nopad"))
        check(len(shards) == 4, f"4 shards, got {shards}")
        r = subprocess.run(["bash", os.path.join(SRC, "scripts/partition-shards.sh"), multi,
                            os.path.join(tmp, "part"), "2"], capture_output=True, text=True)
        check(r.returncode == 0, f"partition-shards.sh: {r.stderr}")
        for rank in (0, 1):
            got_files = sorted(os.listdir(os.path.join(tmp, "part", f"rank{rank}")))
            want_files = sorted(["dataset.json", "vocab.txt"] + [f for i, f in enumerate(shards) if i % 2 == rank])
            check(got_files == want_files, f"partition-shards.sh: rank{rank} holds {got_files}, want {want_files}")
        r = subprocess.run(["bash", os.path.join(SRC, "scripts/partition-shards.sh"), multi,
                            os.path.join(tmp, "part"), "2"], capture_output=True, text=True)
        check(r.returncode != 0 and "is not empty" in r.stderr, f"partition-shards.sh refuses a used OUT_DIR: "
              f"{r.stderr!r}")
        ref_dir = os.path.join(tmp, "multi-one")
        r = train(1, ref_dir, multi)
        check(r.returncode == 0, f"one process on the 4-shard data: {r.stderr[-300:]}")
        run_dir = os.path.join(tmp, "np2-partitioned")
        r = train(2, run_dir, os.path.join(tmp, "part", "rank{rank}"), ("--set", "data.placement=partitioned"))
        check(r.returncode == 0, f"data.placement=partitioned, 2 ranks: exit {r.returncode}: {r.stderr[-500:]}")
        if r.returncode == 0 and os.path.exists(os.path.join(ref_dir, "metrics.jsonl")):
            want, got = losses(ref_dir), losses(run_dir)
            check(len(got) == len(want) == 6 and all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(want, got)),
                  f"partitioned: losses {got} vs one process on all shards {want}")
            print(f"  data.placement=partitioned, 2 ranks: losses {['%.5f' % x for x in got]} (one process: "
                  f"{['%.5f' % x for x in want]})")
        os.remove(os.path.join(tmp, "part", "rank1", shards[3]))
        r = train(2, os.path.join(tmp, "np2-missing"), os.path.join(tmp, "part", "rank{rank}"),
                  ("--set", "data.placement=partitioned"), check_rc=False)
        check(r.returncode != 0 and "shard 3 of 4" in r.stderr and "is missing from" in r.stderr,
              f"a rank missing its shard is refused by name: {r.stderr[-600:]!r}")

        for extra, msg in ((("--set", "dist.reduce=fp16"), "dist.reduce must be fp32 or bf16"),
                           (("--set", "data.placement=local"), "data.placement must be shared or partitioned"),
                           (("--set", "dist.clip=layer"), "dist.clip must be global or bucket"),
                           (("--set", "dist.clip=bucket", "--set", "optim.max_grad_norm=0"),
                            "dist.clip = bucket clips to optim.max_grad_norm")):
            r = train(1, os.path.join(tmp, "bad-clip"), data, extra, check_rc=False)
            check(r.returncode != 0 and msg in r.stderr, f"{extra}: refused with '{msg}': {r.stderr[-300:]!r}")

        # Ranks that disagree on the config refuse to start, naming the rank; nothing is trained.
        bad = os.path.join(tmp, "mismatch")
        cmd = mpiexec("test_train_mpi") + [
            "-np", "1", NOPAD, "train", "--config", os.path.join(SRC, "configs/bert-tiny-sample.toml"), "--overwrite",
            "--set", f"run_dir={bad}", "--set", f"data.train={data}", "--set", "data.eval=\"\"", "--set",
            "train.device=cpu", "--set", "train.global_batch=8", "--set", "optim.lr=0.05", ":",
            "-np", "1", NOPAD, "train", "--config", os.path.join(SRC, "configs/bert-tiny-sample.toml"), "--overwrite",
            "--set", f"run_dir={bad}", "--set", f"data.train={data}", "--set", "data.eval=\"\"", "--set",
            "train.device=cpu", "--set", "train.global_batch=8", "--set", "optim.lr=0.07"]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=SRC)
        check(r.returncode != 0, "a config mismatch between ranks exits non-zero")
        check("the config (with its --set overrides) differs between ranks: rank(s) 1" in r.stderr,
              f"the mismatch error names rank 1: {r.stderr[-600:]!r}")
        check(not os.path.exists(os.path.join(bad, "metrics.jsonl")), "nothing trained after a mismatch")

        # train.threads = 0 under mpirun: each rank takes its share of the node's cores, not all of them.
        r = train(2, os.path.join(tmp, "threads"), data, ("--set", "train.threads=0"))
        want = max(1, (os.cpu_count() or 1) // 2)
        check(r.returncode == 0 and f"device: cpu ({want} threads)" in r.stderr,
              f"2 ranks on {os.cpu_count()} cores take {want} threads each: {r.stderr[:300]!r}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} failure(s)")
        sys.exit(1)
    print("test_train_mpi: all checks passed")


if __name__ == "__main__":
    main()
