"""`nopad train` launched the torchrun way (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in each process's
environment, no mpirun): 2 CPU ranks over the TCP communicator train bert-tiny on the same global batches as one
process; every step's loss agrees (1e-4 relative: only the summation order differs), rank 0 alone writes metrics,
both ranks say they run data parallel over tcp. A second pair started with a wrong WORLD_SIZE on one side is refused
with a message. The same launch also runs data.placement = partitioned (each rank reading only its folder of shards,
samples exchanged over tcp: losses equal to one process on the whole dataset) and `nopad bench model` across the 2
ranks (one report; the same final loss as one process on the whole global batch). Run by CTest with NOPAD_BINARY and
NOPAD_SOURCE_DIR set; needs no MPI."""
import json
import os
import subprocess
import sys
import tempfile

from nopad_checks import check, failures
from nopad_test_support import (NOPAD, SRC, free_port, losses, prepare_sample, run_tiny_train, tiny_bench_cmd,
                                tiny_train_cmd)


def launch(run_dir, data, world_sizes, argv=None):
    """Starts one process per entry of world_sizes (rank i told WORLD_SIZE=world_sizes[i]); returns their results."""
    port = free_port()
    procs = []
    for rank, world in enumerate(world_sizes):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_"))}
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NOPAD_BOOTSTRAP_TIMEOUT_S="20")
        procs.append(subprocess.Popen(argv or tiny_train_cmd(run_dir, data), env=env, cwd=SRC, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate()
        out.append((p.returncode, o, e))
    return out


def main():
    tmp = tempfile.mkdtemp(prefix="nopad-torchrun-")
    data = os.path.join(tmp, "data")
    r = prepare_sample(data)
    check(r.returncode == 0, f"prepare: {r.stderr}")
    one = os.path.join(tmp, "one")
    r = run_tiny_train(one, data)
    check(r.returncode == 0, f"single process: {r.stderr[-500:]}")
    ref = losses(one) if r.returncode == 0 else []

    two = os.path.join(tmp, "two")
    res = launch(two, data, [2, 2])
    for rank, (rc, o, e) in enumerate(res):
        check(rc == 0, f"rank {rank} exit {rc}: {e[-800:]}")
    if all(rc == 0 for rc, _, _ in res):
        check("data parallel: 2 ranks (torchrun, tcp" in res[0][2], f"rank 0 does not say 'torchrun, tcp': {res[0][2]!r}")
        got = losses(two)
        check(len(got) == len(ref) == 6, f"{len(got)} metrics lines (one writer) vs {len(ref)}")
        for step, (a, b) in enumerate(zip(ref, got), 1):
            check(abs(a - b) <= 1e-4 * abs(a), f"step {step}: loss {b} with 2 ranks vs {a} in one process")
        print(f"  losses one process {['%.5f' % x for x in ref]}, 2 ranks over tcp {['%.5f' % x for x in got]}")

    # data.placement = partitioned over tcp: 4 shards split by scripts/partition-shards.sh, {rank} in data.train;
    # the 2 ranks exchange samples and must train as one process on the whole (4-shard) dataset.
    multi = os.path.join(tmp, "multi")
    r = prepare_sample(multi, "--seqs-per-shard", "1000")
    check(r.returncode == 0, f"prepare (4 shards): {r.stderr}")
    r = subprocess.run(["bash", os.path.join(SRC, "scripts/partition-shards.sh"), multi, os.path.join(tmp, "part"),
                        "2"], capture_output=True, text=True)
    check(r.returncode == 0, f"partition-shards.sh: {r.stderr}")
    one_multi = os.path.join(tmp, "one-multi")
    r = run_tiny_train(one_multi, multi)
    check(r.returncode == 0, f"single process on the 4-shard data: {r.stderr[-500:]}")
    part_dir = os.path.join(tmp, "two-partitioned")
    res = launch(part_dir, None, [2, 2], tiny_train_cmd(part_dir, os.path.join(tmp, "part", "rank{rank}"),
                                              ("--set", "data.placement=partitioned")))
    for rank, (rc, o, e) in enumerate(res):
        check(rc == 0, f"partitioned, rank {rank} exit {rc}: {e[-800:]}")
    if all(rc == 0 for rc, _, _ in res) and r.returncode == 0:
        want, got = losses(one_multi), losses(part_dir)
        check(len(got) == len(want) == 6 and all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(want, got)),
              f"partitioned over tcp: losses {got} vs one process {want}")
        print(f"  partitioned over tcp: losses {['%.5f' % x for x in got]}")

    # nopad bench model launched the torchrun way: one report (rank 0), 2 ranks x 4 sequences = 1 process x 8.
    r = subprocess.run(tiny_bench_cmd(data, 8), capture_output=True, text=True, cwd=SRC)
    check(r.returncode == 0, f"bench, one process: {r.stderr[-400:]}")
    res = launch(None, None, [2, 2], tiny_bench_cmd(data, 4))
    for rank, (rc, o, e) in enumerate(res):
        check(rc == 0, f"bench, rank {rank} exit {rc}: {e[-800:]}")
    if r.returncode == 0 and all(rc == 0 for rc, _, _ in res):
        one_b = json.loads(r.stdout)
        reports = [o for _, o, _ in res if o.strip()]
        check(len(reports) == 1, f"bench over tcp: {len(reports)} reports (want rank 0's only)")
        if reports:
            j = json.loads(reports[0])
            check(j["ranks"] == 2 and j["launcher"] == "torchrun" and j["global_batch"] == 8, f"bench report {j}")
            check(abs(j["final_loss"] - one_b["final_loss"]) <= 1e-5 * abs(one_b["final_loss"]),
                  f"bench over tcp: final loss {j['final_loss']} vs one process {one_b['final_loss']}")

    # Rank 1 believes the job has 3 ranks: rank 0 refuses it, and neither trains.
    bad = launch(os.path.join(tmp, "bad"), data, [2, 3])
    check(all(rc != 0 for rc, _, _ in bad), f"a WORLD_SIZE mismatch was not refused: {[rc for rc, _, _ in bad]}")
    check("WORLD_SIZE" in bad[0][2], f"rank 0's message does not name WORLD_SIZE: {bad[0][2][-400:]!r}")
    if failures:
        sys.exit(1)
    print("test_train_torchrun: all checks passed")


if __name__ == "__main__":
    main()
