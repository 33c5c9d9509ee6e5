"""A data-parallel job whose rank hangs ends itself: `nopad train` under mpiexec with 2 CPU ranks and dist.timeout_s = 1;
once steps are logged, rank 1 is stopped (SIGSTOP). Rank 0 then waits inside a host collective that cannot complete;
its watchdog (dist.timeout_s + 30 s) must end it with a message naming the rank and the limit, and the launcher the
job, within 60 s, with a non-zero status. Run by CTest with NOPAD_BINARY and NOPAD_SOURCE_DIR set; needs mpiexec."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

NOPAD = os.environ["NOPAD_BINARY"]
SRC = os.environ["NOPAD_SOURCE_DIR"]


def main():
    exe = shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        sys.exit("test_dist_hang: no mpiexec on PATH: install Open MPI (scripts/setup.sh does)")
    tmp = tempfile.mkdtemp(prefix="nopad-hang-")
    data, run = os.path.join(tmp, "data"), os.path.join(tmp, "run")
    subprocess.run([NOPAD, "prepare", "--input", os.path.join(SRC, "data/wiki-sample/wiki_00"), "--vocab",
                    os.path.join(SRC, "data/vocab/bert-uncased-vocab.txt"), "--output", data, "--max-seq-length",
                    "128", "--dupe-factor", "1", "--quiet"], check=True)
    env = dict(os.environ, OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [exe, "-np", "2", "--oversubscribe", "--allow-run-as-root", NOPAD, "train", "--config",
           os.path.join(SRC, "configs/bert-tiny-sample.toml"), "--set", f"data.train={data}", "--set", 'data.eval=""',
           "--set", f"run_dir={run}", "--set", "train.device=cpu", "--set", "train.threads=1", "--set",
           "train.global_batch=8", "--set", "train.max_steps=100000", "--set", "log.interval_steps=1", "--set",
           "dist.timeout_s=1", "--overwrite"]
    log_path = os.path.join(tmp, "log")
    with open(log_path, "w") as log:
        # From the source tree: the config names its model file relative to it.
        job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=SRC)
    failures = []
    rank1 = None
    try:
        deadline = time.time() + 120
        metrics = os.path.join(run, "metrics.jsonl")
        while time.time() < deadline and job.poll() is None:
            if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 3:
                break
            time.sleep(0.5)
        if job.poll() is not None:
            failures.append(f"the job ended before the test stopped a rank (status {job.returncode})")
        else:
            # Rank 1: the process of this job whose environment says so.
            out = subprocess.run(["pgrep", "-f", f"run_dir={run}"], capture_output=True, text=True).stdout.split()
            for pid in out:
                try:
                    env_vars = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                except OSError:
                    continue
                if b"OMPI_COMM_WORLD_RANK=1" in env_vars:
                    rank1 = int(pid)
            if rank1 is None:
                failures.append("rank 1's process was not found")
            else:
                os.kill(rank1, signal.SIGSTOP)
                start = time.time()
                try:
                    job.wait(timeout=60)
                    took = time.time() - start
                    print(f"  the job ended {took:.1f} s after rank 1 was stopped, status {job.returncode}")
                    if job.returncode == 0:
                        failures.append("the job ended with status 0")
                except subprocess.TimeoutExpired:
                    failures.append("the job was still running 60 s after rank 1 was stopped")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        if rank1 is not None:
            try:
                os.kill(rank1, signal.SIGKILL)
            except ProcessLookupError:
                pass
    log = open(log_path, errors="replace").read()
    lines = [l for l in log.splitlines() if "no progress for" in l]
    if not lines:
        failures.append("no 'no progress for' message in the job's output")
    elif not ("rank 0 of 2" in lines[0] and "dist.timeout_s" in lines[0] and "limit 31 s" in lines[0]):
        failures.append(f"the message does not name the rank and the limit: {lines[0]}")
    else:
        print("  " + lines[0])
    shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print("\n".join("FAIL: " + f for f in failures))
        print(log[-3000:])
        sys.exit(1)
    print("test_dist_hang: all checks passed")


if __name__ == "__main__":
    main()
