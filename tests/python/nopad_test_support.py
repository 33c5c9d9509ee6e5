"""Helpers shared by the Python tests that launch nopad under mpiexec or a torchrun-style environment: the mpiexec
command line, and the bert-tiny-sized dataset they train on (MLPerf's wiki sample prepared at 64 tokens)."""
import os
import shutil
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
