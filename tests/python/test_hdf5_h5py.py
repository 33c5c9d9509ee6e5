"""`nopad convert` on HDF5 files written with h5py the way NVIDIA's / MLPerf's BERT scripts write them (fixed-length
with gzip, variable-length via h5py.vlen_dtype, packed), read back with python/nopad_shards.py and compared sample by
sample; plus corruption detection by nopad_shards' checksum verification.

Standalone: exits non-zero on failure. Environment: NOPAD_BINARY (the nopad executable), NOPAD_SOURCE_DIR (the
repository), PYTHONPATH=<repo>/python.
"""
import json
import os
import subprocess
import sys
import tempfile
import zlib

try:
    import h5py
    import numpy as np
except ImportError as e:  # a missing package is a failure, never a skip
    sys.exit(f"FAIL: this test needs h5py and numpy ({e}); run: pip install h5py numpy")

import nopad_shards

from nopad_checks import check, failures

BINARY = os.environ.get("NOPAD_BINARY")
SOURCE = os.environ.get("NOPAD_SOURCE_DIR")
if not BINARY or not SOURCE:
    sys.exit("FAIL: set NOPAD_BINARY and NOPAD_SOURCE_DIR (CTest does this)")
VOCAB = os.path.join(SOURCE, "data", "vocab", "bert-uncased-vocab.txt")
CLS, SEP = 101, 102  # ids of [CLS] and [SEP] in the BERT uncased vocabulary
VOCAB_SIZE = 30522
SEQ_LEN, MAX_PRED = 512, 76


def random_instances(rng, count, max_len=512, max_masked=76):
    out = []
    for i in range(count):
        n = 8 if i == 0 else max_len if i == 1 else int(rng.integers(8, max_len + 1))
        a = int(rng.integers(2, n))
        tokens = rng.integers(999, VOCAB_SIZE, size=n)
        tokens[0], tokens[a - 1], tokens[n - 1] = CLS, SEP, SEP
        candidates = [p for p in range(1, n - 1) if p != a - 1]
        k = int(rng.integers(0, min(max_masked, len(candidates)) + 1))
        positions = np.sort(rng.choice(candidates, size=k, replace=False)) if k else np.zeros(0, np.int64)
        labels = rng.integers(0, VOCAB_SIZE, size=k)
        out.append({"tokens": tokens, "a_length": a, "nsp_label": int(rng.integers(0, 2)),
                    "mlm_positions": positions, "mlm_labels": labels})
    return out


def segments(inst):
    s = np.ones(len(inst["tokens"]), dtype=np.int8)
    s[:inst["a_length"]] = 0
    return s


def write_fixed(path, insts):
    """create_pretraining_data.py's HDF5 output: padded to 512 / 76, gzip-compressed."""
    n = len(insts)
    ids = np.zeros((n, SEQ_LEN), np.int16)
    mask = np.zeros((n, SEQ_LEN), np.int8)
    segs = np.zeros((n, SEQ_LEN), np.int8)
    pos = np.zeros((n, MAX_PRED), np.int16)
    lab = np.zeros((n, MAX_PRED), np.int16)
    nsp = np.zeros(n, np.int8)
    for i, inst in enumerate(insts):
        L, k = len(inst["tokens"]), len(inst["mlm_positions"])
        ids[i, :L], mask[i, :L], segs[i, :L] = inst["tokens"], 1, segments(inst)
        pos[i, :k], lab[i, :k] = inst["mlm_positions"], inst["mlm_labels"]
        nsp[i] = inst["nsp_label"]
    with h5py.File(path, "w") as f:
        for name, data in [("input_ids", ids), ("input_mask", mask), ("segment_ids", segs),
                           ("masked_lm_positions", pos), ("masked_lm_ids", lab), ("next_sentence_labels", nsp)]:
            f.create_dataset(name, data=data, dtype=data.dtype, compression="gzip")


def vlen_column(rows, dtype):
    col = np.empty(len(rows), dtype=object)
    for i, r in enumerate(rows):
        col[i] = np.asarray(r, dtype=dtype)
    return col


def write_variable(path, insts):
    """convert_fixed2variable.py's output (part_XXXXX_of_04320.hdf5, part_eval_10k.hdf5)."""
    with h5py.File(path, "w") as f:
        f.create_dataset("input_ids", data=vlen_column([x["tokens"] for x in insts], np.int16),
                         dtype=h5py.vlen_dtype(np.dtype("int16")), compression="gzip")
        f.create_dataset("segment_ids", data=vlen_column([segments(x) for x in insts], np.int8),
                         dtype=h5py.vlen_dtype(np.dtype("int8")), compression="gzip")
        f.create_dataset("masked_lm_positions", data=vlen_column([x["mlm_positions"] for x in insts], np.int16),
                         dtype=h5py.vlen_dtype(np.dtype("int16")), compression="gzip")
        f.create_dataset("masked_lm_ids", data=vlen_column([x["mlm_labels"] for x in insts], np.int16),
                         dtype=h5py.vlen_dtype(np.dtype("int16")), compression="gzip")
        f.create_dataset("next_sentence_labels", data=np.array([x["nsp_label"] for x in insts], np.int8),
                         dtype="int8", compression="gzip")


def write_packed(path, insts):
    """Packed rows of 1, 2 and 3 sequences; masked positions offset within the row."""
    rows = {k: [] for k in ["ids", "segs", "pos", "lab", "len", "mlen", "nsp"]}
    i, r = 0, 0
    while i < len(insts):
        group = insts[i:i + 1 + r % 3]
        i += len(group)
        r += 1
        offset, pos = 0, []
        for x in group:
            pos.append(np.asarray(x["mlm_positions"]) + offset)
            offset += len(x["tokens"])
        rows["ids"].append(np.concatenate([x["tokens"] for x in group]))
        rows["segs"].append(np.concatenate([segments(x) for x in group]))
        rows["pos"].append(np.concatenate(pos))
        rows["lab"].append(np.concatenate([x["mlm_labels"] for x in group]))
        rows["len"].append([len(x["tokens"]) for x in group])
        rows["mlen"].append([len(x["mlm_positions"]) for x in group])
        rows["nsp"].append([x["nsp_label"] for x in group])
    i16, i8 = h5py.vlen_dtype(np.dtype("int16")), h5py.vlen_dtype(np.dtype("int8"))
    with h5py.File(path, "w") as f:
        for name, key, dt, npdt in [("input_ids", "ids", i16, np.int16), ("segment_ids", "segs", i8, np.int8),
                                    ("masked_lm_positions", "pos", i16, np.int16),
                                    ("masked_lm_ids", "lab", i16, np.int16),
                                    ("packed_input_len", "len", i16, np.int16),
                                    ("packed_masked_lm_len", "mlen", i16, np.int16),
                                    ("next_sentence_labels", "nsp", i8, np.int8)]:
            f.create_dataset(name, data=vlen_column(rows[key], npdt), dtype=dt, compression="gzip")
    return r


def main():
    rng = np.random.default_rng(1234)
    with tempfile.TemporaryDirectory(prefix="nopad_h5py_") as tmp:
        fixed = random_instances(rng, 25)
        variable = random_instances(rng, 30)
        packed = random_instances(rng, 31, max_len=300)
        paths = [os.path.join(tmp, "fixed.hdf5"), os.path.join(tmp, "part_00000_of_04320.hdf5"),
                 os.path.join(tmp, "packed.hdf5")]
        write_fixed(paths[0], fixed)
        write_variable(paths[1], variable)
        packed_rows = write_packed(paths[2], packed)
        check(packed_rows < len(packed), "packed rows hold several sequences")

        out = os.path.join(tmp, "shards")
        proc = subprocess.run([BINARY, "convert", "--from-hdf5", *paths, "--output", out, "--vocab", VOCAB,
                               "--seqs-per-shard", "20"], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"FAIL: nopad convert exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        print(proc.stdout.strip())

        want = fixed + variable + packed
        ds = nopad_shards.open_dataset(out)
        check(len(ds.shards) == (len(want) + 19) // 20, f"shard count {len(ds.shards)}")
        check(ds.num_seqs == len(want), f"sequence count {ds.num_seqs} != {len(want)}")
        got = list(ds)
        for i, (w, g) in enumerate(zip(want, got)):
            same = (np.array_equal(w["tokens"], g["tokens"]) and w["a_length"] == g["a_length"]
                    and w["nsp_label"] == g["nsp_label"] and np.array_equal(w["mlm_positions"], g["mlm_positions"])
                    and np.array_equal(w["mlm_labels"], g["mlm_labels"])
                    and np.array_equal(segments(w), g["segment_ids"]))
            check(same, f"sample {i} differs after conversion")
        lengths = np.concatenate([s.lengths for s in ds.shards])
        check(np.array_equal(lengths, [len(w["tokens"]) for w in want]), "lengths array")
        first = ds.shards[0]
        check(first.a_length(3) == want[3]["a_length"] and first.nsp_label(3) == want[3]["nsp_label"], "accessors")

        manifest = json.load(open(os.path.join(out, "dataset.json")))
        check(manifest["format"] == "nopad-shards" and manifest["version"] == 1 and manifest["source"] == "hdf5",
              "manifest header")
        check(manifest["num_seqs"] == len(want), "manifest num_seqs")
        check(manifest["num_tokens"] == sum(len(w["tokens"]) for w in want), "manifest num_tokens")
        check(manifest["num_masked"] == sum(len(w["mlm_positions"]) for w in want), "manifest num_masked")
        check(manifest["num_shards"] == len(ds.shards), "manifest num_shards")
        check(manifest["vocab_size"] == VOCAB_SIZE and manifest["vocab_checksum"] == first.vocab_checksum,
              "manifest vocabulary")
        check([x["layout"] for x in manifest["inputs"]] == ["fixed", "variable", "packed"], "manifest layouts")
        # The vocabulary checksum is CRC-32 of the tokens, each followed by "\n" (docs/data-format.md).
        vocab_tokens = open(VOCAB, encoding="utf-8").read().splitlines()
        vocab_crc = zlib.crc32("".join(t + "\n" for t in vocab_tokens).encode("utf-8"))
        check(first.vocab_checksum == vocab_crc, f"vocab checksum {first.vocab_checksum} != CRC-32 {vocab_crc}")

        # Corruption: one flipped byte in the token section must be caught by the checksum verification.
        shard_path = first.path
        sec = first.sections[5]
        raw = bytearray(open(shard_path, "rb").read())
        raw[sec["offset"] + sec["size_bytes"] // 2] ^= 0x40
        bad_path = os.path.join(tmp, "corrupt.nopad")
        open(bad_path, "wb").write(raw)
        try:
            nopad_shards.Shard(bad_path)
            check(False, "a flipped token byte was not detected")
        except nopad_shards.ShardError as e:
            check("section 5" in str(e) and "corrupt.nopad" in str(e), f"corruption message: {e}")
        # Without verification it opens (the index is intact); an explicit verify() still catches it.
        s = nopad_shards.Shard(bad_path, verify=False)
        try:
            s.verify()
            check(False, "verify() missed the flipped byte")
        except nopad_shards.ShardError:
            pass
        # A damaged header is caught by the header CRC.
        raw = bytearray(open(shard_path, "rb").read())
        raw[24] ^= 1
        open(bad_path, "wb").write(raw)
        try:
            nopad_shards.Shard(bad_path)
            check(False, "a flipped header byte was not detected")
        except nopad_shards.ShardError as e:
            check("header checksum" in str(e), f"header corruption message: {e}")

        # The summary entry point works on the folder.
        proc = subprocess.run([sys.executable, "-m", "nopad_shards", out], capture_output=True, text=True)
        check(proc.returncode == 0 and f"{len(want)} sequences" in proc.stdout, f"summary: {proc.stdout}{proc.stderr}")

        # A bad file (float token ids) fails with the file and the field named, leaving no shard.
        bad_h5 = os.path.join(tmp, "float.hdf5")
        with h5py.File(bad_h5, "w") as f:
            f.create_dataset("input_ids", data=np.zeros((2, 8), np.float32))
            for name in ["input_mask", "segment_ids"]:
                f.create_dataset(name, data=np.zeros((2, 8), np.int8))
            for name in ["masked_lm_positions", "masked_lm_ids"]:
                f.create_dataset(name, data=np.zeros((2, 4), np.int16))
            f.create_dataset("next_sentence_labels", data=np.zeros(2, np.int8))
        out2 = os.path.join(tmp, "shards2")
        proc = subprocess.run([BINARY, "convert", "--from-hdf5", paths[1], bad_h5, "--output", out2, "--vocab", VOCAB,
                               "--seqs-per-shard", "5"], capture_output=True, text=True)
        check(proc.returncode == 1, f"bad input exit code {proc.returncode}")
        check("float.hdf5" in proc.stderr and "'input_ids'" in proc.stderr, f"bad input message: {proc.stderr}")
        leftovers = [n for _, _, files in os.walk(out2) for n in files]
        check(leftovers == [], f"files left after a failed conversion: {leftovers}")

    if failures:
        sys.exit(f"FAIL: {len(failures)} check(s) failed")
    print("OK: test_hdf5_h5py")


if __name__ == "__main__":
    main()
