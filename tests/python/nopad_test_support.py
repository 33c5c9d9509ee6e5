"""Helpers shared by the Python tests that run a nopad build (NOPAD_BINARY and NOPAD_SOURCE_DIR set): the mpiexec
command line, the bert-tiny-sized dataset they train on (MLPerf's wiki sample prepared at 64 tokens), the short
bert-tiny `nopad train` / `nopad bench model` runs on it (and the single-process reference run), a free TCP port and a
run's per-step losses. check() and failures are in nopad_checks.py."""
import json
import os
import shutil
import socket
import subprocess
import sys

NOPAD = os.environ["NOPAD_BINARY"]
SRC = os.environ["NOPAD_SOURCE_DIR"]


def mpiexec(test_name):
    exe = shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        sys.exit(f"{test_name}: no mpiexec on PATH: install Open MPI (Debian: openmpi-bin libopenmpi-dev; "
                 "scripts/setup.sh does)")
    return [exe, "--oversubscribe", "--allow-run-as-root"]


def prepare_sample(out, *extra):
    """`nopad prepare` of data/wiki-sample/wiki_00 into `out` (64 tokens, 10 predictions, one duplicate); extra
    arguments are appended (e.g. "--seqs-per-shard", "1000"). Returns the CompletedProcess."""
    return subprocess.run([NOPAD, "prepare", "--input", os.path.join(SRC, "data/wiki-sample/wiki_00"), "--vocab",
                           os.path.join(SRC, "data/vocab/bert-uncased-vocab.txt"), "--output", out,
                           "--max-seq-length", "64", "--max-predictions", "10", "--dupe-factor", "1", "--quiet",
                           *extra], capture_output=True, text=True)


def tiny_train_cmd(run_dir, data, extra=()):
    """`nopad train` of bert-tiny on the CPU, 6 steps of 8 sequences, a metrics line per step, no checkpoints."""
    return [NOPAD, "train", "--config", os.path.join(SRC, "configs/bert-tiny-sample.toml"), "--overwrite",
            "--set", f"run_dir={run_dir}", "--set", f"data.train={data}", "--set", "data.eval=",
            "--set", "train.device=cpu", "--set", "train.threads=1", "--set", "train.global_batch=8",
            "--set", "train.max_steps=6", "--set", "log.interval_steps=1", "--set", "checkpoint.interval_steps=0",
            *extra]


def run_tiny_train(run_dir, data, extra=(), env=None):
    """tiny_train_cmd run as one process from the source directory. Returns the CompletedProcess."""
    return subprocess.run(tiny_train_cmd(run_dir, data, extra), capture_output=True, text=True, cwd=SRC, env=env)


def tiny_bench_cmd(data, batch):
    """`nopad bench model` of bert-tiny on the CPU: 1 warm-up and 4 timed steps of `batch` sequences (per rank)."""
    return [NOPAD, "bench", "model", "--model", os.path.join(SRC, "data/configs/bert-tiny.json"), "--data", data,
            "--batch", str(batch), "--steps", "4", "--warmup", "1", "--device", "cpu", "--threads", "1"]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def losses(run_dir):
    """The loss of every line of run_dir/metrics.jsonl."""
    return [json.loads(l)["loss"] for l in open(os.path.join(run_dir, "metrics.jsonl")) if l.strip()]
