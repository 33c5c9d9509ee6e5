"""`nopad convert --from-hdf5` on damaged and unusual HDF5 files written with h5py:
  - variable-length rows whose stored length, global-heap address, object index or heap object size is damaged, in a
    contiguous dataset and in a gzip-compressed chunk (rewritten with h5py's direct chunk write): one error naming the
    file, the dataset and the row, no shard (libhdf5's own conversion segfaulted, or ran out of memory, on these);
  - valid variable-length files that exercise the reader's own parsing: a user block (addresses shifted), big-endian
    and unsigned element types, shuffle and gzip chunks of several rows (a partial last one), an empty row: read
    exactly;
  - libhdf5's own errors come with its error stack ("HDF5 says: ..."), e.g. for an LZF-compressed fixed dataset.
Standalone: exits non-zero on failure. Environment: NOPAD_BINARY, NOPAD_SOURCE_DIR, PYTHONPATH=<repo>/python."""
import os
import shutil
import struct
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
CLS, SEP = 101, 102


def instances(rng, count):
    out = []
    for i in range(count):
        n = int(rng.integers(8, 40))
        a = int(rng.integers(3, n - 2))
        tokens = rng.integers(999, 30000, size=n)
        tokens[0], tokens[a - 1], tokens[n - 1] = CLS, SEP, SEP
        positions = np.sort(rng.choice([p for p in range(1, n - 1) if p != a - 1], size=3, replace=False))
        out.append({"tokens": tokens, "a": a, "nsp": i % 2, "pos": positions,
                    "lab": rng.integers(0, 30000, size=3)})
    return out


def segments(x):
    s = np.ones(len(x["tokens"]), dtype=np.int64)
    s[:x["a"]] = 0
    return s


def column(rows, dtype):
    col = np.empty(len(rows), dtype=object)
    for i, r in enumerate(rows):
        col[i] = np.asarray(r, dtype=dtype)
    return col


def write_variable(path, insts, ids_dtype="<i2", userblock=0, **storage):
    """The variable-length layout; `storage` goes to every create_dataset (compression, shuffle, chunks, ...)."""
    kw = {"userblock_size": userblock} if userblock else {}
    with h5py.File(path, "w", **kw) as f:
        for name, rows, dt in [("input_ids", [x["tokens"] for x in insts], ids_dtype),
                               ("segment_ids", [segments(x) for x in insts], "u1"),
                               ("masked_lm_positions", [x["pos"] for x in insts], ">i4"),
                               ("masked_lm_ids", [x["lab"] for x in insts], "<u2")]:
            f.create_dataset(name, data=column(rows, np.dtype(dt)), dtype=h5py.vlen_dtype(np.dtype(dt)), **storage)
        f.create_dataset("next_sentence_labels", data=np.array([x["nsp"] for x in insts], np.int8))


def convert(tmp, path, out_name="out"):
    out = os.path.join(tmp, out_name)
    shutil.rmtree(out, ignore_errors=True)
    try:
        p = subprocess.run([BINARY, "convert", "--from-hdf5", path, "--output", out, "--vocab", VOCAB],
                           capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return None, out
    return p, out


def expect_converted(tmp, path, insts, what):
    p, out = convert(tmp, path)
    if p is None or p.returncode != 0:
        check(False, f"{what}: convert failed: {p and p.stderr!r}")
        return
    got = list(nopad_shards.open_dataset(out))
    check(len(got) == len(insts), f"{what}: {len(got)} sequences, expected {len(insts)}")
    for i, (w, g) in enumerate(zip(insts, got)):
        same = (np.array_equal(w["tokens"], g["tokens"]) and w["a"] == g["a_length"] and w["nsp"] == g["nsp_label"]
                and np.array_equal(w["pos"], g["mlm_positions"]) and np.array_equal(w["lab"], g["mlm_labels"]))
        check(same, f"{what}: sample {i} differs")


def expect_damage_error(tmp, path, needles, what):
    p, out = convert(tmp, path)
    if p is None:
        check(False, f"{what}: convert ran for over 60 s")
        return
    lines = [l for l in p.stderr.splitlines() if l.strip() and "%" not in l]
    check(p.returncode == 1, f"{what}: exit code {p.returncode}, expected 1 ({p.stderr[-300:]!r})")
    check(len(lines) == 1 and all(n in lines[0] for n in needles),
          f"{what}: expected one error line with {needles}, got {p.stderr[-400:]!r}")
    left = [n for _, _, files in os.walk(out) for n in files] if os.path.isdir(out) else []
    check(left == [], f"{what}: files left: {left}")


def patch(src, dst, edits):
    raw = bytearray(open(src, "rb").read())
    for offset, fmt, value in edits:
        struct.pack_into("<" + fmt, raw, offset, value)
    open(dst, "wb").write(raw)


def heap_objects(raw, gcol):
    """(offset of the object's header, index, size) of the objects of the global heap collection at `gcol`."""
    size = struct.unpack_from("<Q", raw, gcol + 8)[0]
    pos, out = gcol + 16, []
    while pos + 16 <= gcol + size:
        index, _, _, n = struct.unpack_from("<HHIQ", raw, pos)
        if index == 0:
            break
        out.append((pos, index, n))
        pos += 16 + (n + 7) // 8 * 8
    return out


def damaged_contiguous(tmp, insts):
    good = os.path.join(tmp, "contiguous.hdf5")
    write_variable(good, insts)
    expect_converted(tmp, good, insts, "contiguous variable-length file")
    with h5py.File(good, "r") as f:
        at = f["input_ids"].id.get_offset()  # descriptors: u32 length, u64 collection address, u32 object index
    raw = open(good, "rb").read()
    length, gcol, index = struct.unpack_from("<IQI", raw, at + 16 * 3)
    check(raw[gcol:gcol + 4] == b"GCOL", "the descriptors point at a global heap collection")
    bad = os.path.join(tmp, "bad.hdf5")
    where = ["bad.hdf5", "dataset 'input_ids', row 3", "damaged variable-length data"]
    for field, fmt, value, needle in [(0, "I", 0x7FFFFFFF, "heap object"), (0, "I", length + 1, "heap object"),
                                      (4, "Q", 1 << 40, "outside the file"), (4, "Q", 0, "no global heap collection"),
                                      (12, "I", 999, "has no object 999")]:
        patch(good, bad, [(at + 16 * 3 + field, fmt, value)])
        expect_damage_error(tmp, bad, where + [needle], f"descriptor field at +{field} = {value}")
    # The heap object itself: a size running past its collection, and a damaged collection size.
    objects = heap_objects(raw, gcol)
    header = next(o for o in objects if o[1] == index)[0]
    patch(good, bad, [(header + 8, "Q", 1 << 33)])
    expect_damage_error(tmp, bad, ["bad.hdf5", "dataset 'input_ids', row 0", "runs past its end"],
                        "heap object size")
    patch(good, bad, [(gcol + 8, "Q", 1 << 50)])
    expect_damage_error(tmp, bad, ["bad.hdf5", "dataset 'input_ids', row 0", "claims"], "heap collection size")


def damaged_chunk(tmp, insts):
    """gzip chunks: the descriptors are rewritten inside a compressed chunk with h5py's direct chunk write."""
    good = os.path.join(tmp, "chunked.hdf5")
    write_variable(good, insts, compression="gzip", chunks=(4,))
    expect_converted(tmp, good, insts, "gzip variable-length file, chunks of 4 rows")
    bad = os.path.join(tmp, "badchunk.hdf5")
    for row, field, fmt, value, needle in [(5, 0, "I", 0xFFFFFFF0, "heap object"),
                                           (6, 4, "Q", (1 << 63) + 5, "outside the file")]:
        shutil.copy(good, bad)
        with h5py.File(bad, "r+") as f:
            d = f["masked_lm_ids"]
            mask, chunk = d.id.read_direct_chunk((4,))
            desc = bytearray(zlib.decompress(chunk))
            struct.pack_into("<" + fmt, desc, 16 * (row - 4) + field, value)
            d.id.write_direct_chunk((4,), zlib.compress(bytes(desc)), mask)
        expect_damage_error(tmp, bad, ["badchunk.hdf5", f"dataset 'masked_lm_ids', row {row}",
                                       "damaged variable-length data", needle], f"chunk row {row} field +{field}")
    # A chunk that does not inflate.
    shutil.copy(good, bad)
    with h5py.File(bad, "r+") as f:
        d = f["segment_ids"]
        mask, chunk = d.id.read_direct_chunk((0,))
        d.id.write_direct_chunk((0,), b"\x78\x9c" + bytes(len(chunk)), mask)
    expect_damage_error(tmp, bad, ["dataset 'segment_ids', row 0", "does not decompress"], "undecodable chunk")


def unusual_but_valid(tmp, insts):
    p = os.path.join(tmp, "userblock.hdf5")
    write_variable(p, insts, ids_dtype=">i8", userblock=512)
    expect_converted(tmp, p, insts, "user block, big-endian int64 ids")
    p = os.path.join(tmp, "filters.hdf5")
    write_variable(p, insts, ids_dtype="<u4", compression="gzip", shuffle=True, chunks=(3,))
    expect_converted(tmp, p, insts, "shuffle + gzip, chunks of 3 rows (an edge chunk of 0 rows beyond 12)")
    p = os.path.join(tmp, "shuffle.hdf5")
    write_variable(p, insts, shuffle=True, chunks=(5,))
    expect_converted(tmp, p, insts, "shuffle alone, chunks of 5 rows (a partial last chunk)")
    # An empty masked row (length 0 in the descriptor, no heap object).
    none = [dict(x, pos=np.zeros(0, np.int64), lab=np.zeros(0, np.int64)) if i == 2 else x
            for i, x in enumerate(insts)]
    p = os.path.join(tmp, "empty-row.hdf5")
    write_variable(p, none)
    expect_converted(tmp, p, none, "a row without masked positions")


def library_errors(tmp, insts):
    """An LZF-compressed fixed dataset: the system libhdf5 has no LZF filter; its error stack says so."""
    p = os.path.join(tmp, "lzf.hdf5")
    n = len(insts)
    with h5py.File(p, "w") as f:
        ids = np.zeros((n, 64), np.int16)
        for i, x in enumerate(insts):
            ids[i, :len(x["tokens"])] = x["tokens"]
        f.create_dataset("input_ids", data=ids, compression="lzf")
        for name in ["input_mask", "segment_ids"]:
            f.create_dataset(name, data=np.zeros((n, 64), np.int8))
        for name in ["masked_lm_positions", "masked_lm_ids"]:
            f.create_dataset(name, data=np.zeros((n, 4), np.int16))
        f.create_dataset("next_sentence_labels", data=np.zeros(n, np.int8))
    expect_damage_error(tmp, p, ["lzf.hdf5", "'input_ids'", "HDF5 says: H5Dread(): ", "filter 'lzf' is not registered"],
                        "LZF filter")
    # Variable-length data in a filter nopad cannot undo is refused before any data is read.
    p = os.path.join(tmp, "lzf-vlen.hdf5")
    write_variable(p, insts, compression="lzf")
    expect_damage_error(tmp, p, ["lzf-vlen.hdf5", "dataset 'input_ids' is compressed with the HDF5 filter 32000",
                                 "h5repack"], "LZF variable-length data")


def main():
    rng = np.random.default_rng(50)
    insts = instances(rng, 12)
    with tempfile.TemporaryDirectory(prefix="nopad_h5bad_") as tmp:
        damaged_contiguous(tmp, insts)
        damaged_chunk(tmp, insts)
        unusual_but_valid(tmp, insts)
        library_errors(tmp, insts)
    if failures:
        sys.exit(f"FAIL: {len(failures)} check(s) failed")
    print("OK: test_hdf5_damaged")


if __name__ == "__main__":
    main()
