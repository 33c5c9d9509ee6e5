"""python/nopad_order.py draws the same global batches as nopad's loader, and python/nopad_shards.py numbers and
packs the samples as nopad does. On the wiki sample prepared into many small shards, for several seeds (including
one above 2**63), batch sizes and run lengths that cross epochs (the short tail of each epoch dropped; a batch of the
whole dataset; a batch of all but one sample), the ids of `nopad bench loader --dump-ids` equal Python's line for
line, and the bench's token checksum and mean length equal those of Python's batches of the same ids (so the global
id -> shard sample mapping agrees too). Run by CTest with NOPAD_BINARY and NOPAD_SOURCE_DIR set."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import nopad_order
import nopad_shards

from nopad_checks import check, failures
from nopad_test_support import prepare_sample

NOPAD = os.environ["NOPAD_BINARY"]
SRC = os.environ["NOPAD_SOURCE_DIR"]


def bench_ids(data, seed, batch, steps, dump):
    r = subprocess.run([NOPAD, "bench", "loader", "--data", data, "--seed", str(seed), "--batch", str(batch),
                        "--steps", str(steps), "--dump-ids", dump], capture_output=True, text=True)
    check(r.returncode == 0, f"bench loader seed {seed} batch {batch}: {r.stderr}")
    with open(dump) as f:
        lines = [[int(x) for x in l.split()] for l in f.read().splitlines()]
    return lines, json.loads(r.stdout)


def main():
    tmp = tempfile.mkdtemp(prefix="nopad-order-")
    try:
        data = os.path.join(tmp, "data")
        r = prepare_sample(data, "--seqs-per-shard", "300")
        check(r.returncode == 0, f"prepare: {r.stderr}")
        ds = nopad_shards.open_dataset(data)
        n = ds.num_seqs
        check(len(ds.shards) >= 5, f"the sample is cut into several shards ({len(ds.shards)})")
        cases = [(12345, 32, 5), (7, 100, 3 * (n // 100)), (2026, 257, 2 * (n // 257) + 3), (2**63 + 11, 64, 4),
                 (1, n, 3), (99, n - 1, 4)]
        # A batch whose epoch tail is exactly one sample short of a batch (the boundary of the drop rule).
        k = next((k for k in range(3, 200) if (n + 1) % k == 0), None)
        if k is not None:
            cases.append((5, (n + 1) // k, 2 * k))
        dump = os.path.join(tmp, "ids.txt")
        for seed, batch, steps in cases:
            nopad_batches, bench = bench_ids(data, seed, batch, steps, dump)
            total = steps + 10  # the bench draws 10 warm-up batches first
            py = nopad_order.global_batches(n, seed, batch, total)
            check(len(nopad_batches) == total, f"seed {seed} batch {batch}: {len(nopad_batches)} lines, expected {total}")
            first_bad = next((k for k, (a, b) in enumerate(zip(nopad_batches, py)) if a != b), None)
            check(first_bad is None, f"seed {seed} batch {batch}: batch {first_bad} differs")
            epochs = (total * batch) // n if batch <= n else 0
            # The timed batches' checksum (token at the middle row of each batch) and mean length, from Python.
            checksum, tokens = 0, 0
            for ids in py[10:]:
                b = ds.build_batch(ids)
                checksum += int(b["tokens"][len(b["tokens"]) // 2])
                tokens += len(b["tokens"])
            check(bench["checksum"] == checksum, f"seed {seed} batch {batch}: token checksum {bench['checksum']} vs "
                  f"Python {checksum}")
            check(abs(bench["mean_length"] - round(tokens / (steps * batch), 1)) < 0.051,
                  f"seed {seed} batch {batch}: mean length {bench['mean_length']} vs Python {tokens / (steps * batch)}")
            print(f"seed {seed} batch {batch}: {total} batches (~{epochs} epoch rollovers) compared")
        # The rollover: with batch n-1 every epoch yields one batch and drops one sample, a new permutation each time.
        sampler, cur = nopad_order.EpochSampler(n, 99), nopad_order.Cursor()
        b0, b1 = sampler.next_global_batch(cur, n - 1), sampler.next_global_batch(cur, n - 1)
        check(cur == nopad_order.Cursor(1, n - 1) and b0 != b1, f"one batch per epoch at batch n-1 ({cur})")
        # Sanity: the order depends on the seed and is a permutation.
        p1, p2 = nopad_order.epoch_permutation(n, 1, 0), nopad_order.epoch_permutation(n, 2, 0)
        check(sorted(p1) == list(range(n)) and p1 != p2 and p1 != list(range(n)), "seeded permutations")
        # Packing: mlm_positions are rows of the packed batch and land on the labelled tokens' rows.
        b = ds.build_batch([n - 1, 0, 5])
        s = ds.sample(n - 1)
        check(list(b["cu_seqlens"][:2]) == [0, len(s["tokens"])] and b["max_seqlen"] == max(
            len(ds.sample(i)["tokens"]) for i in (n - 1, 0, 5)), "cu_seqlens and max_seqlen")
        k0 = len(s["mlm_positions"])
        check(list(b["mlm_positions"][:k0]) == list(s["mlm_positions"]), "first sample's mask rows")
        s1 = ds.sample(0)
        check(list(b["mlm_positions"][k0:k0 + len(s1["mlm_positions"])]) ==
              [int(p) + len(s["tokens"]) for p in s1["mlm_positions"]], "second sample's mask rows are offset")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} failure(s)")
        sys.exit(1)
    print("test_batch_order: all checks passed")


if __name__ == "__main__":
    main()
