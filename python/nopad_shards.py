"""Reader of nopad shard files (*.nopad), numpy only; the byte layout is documented in docs/data-format.md and
defined by src/data/shard.h / shard.cpp.

    import nopad_shards
    shard = nopad_shards.Shard("out/shard_00000.nopad")         # verifies header and section checksums
    shard.num_seqs, shard.lengths                                 # lengths: np.ndarray[int64] of N
    shard.tokens(0), shard.a_length(0), shard.nsp_label(0)
    shard.mlm_positions(0), shard.mlm_labels(0), shard.sample(0)  # sample: dict of the above
    for s in nopad_shards.open_dataset("out"): ...                # every sample of every shard, in order

Every inconsistency raises ShardError naming the file. `python3 nopad_shards.py DIR` prints a summary of a folder.
"""
import glob
import os
import struct
import sys
import zlib

import numpy as np

MAGIC = b"NOPADSHD"
VERSION = 1
HEADER_BYTES = 128
ALIGN = 64
# magic, version, header_bytes, num_seqs, num_tokens, num_masked, vocab_size, vocab_checksum, max_seq_length,
# token_bytes, num_sections, flags, reserved[60], header_crc -- little-endian, packed.
_HEADER = struct.Struct("<8sIIQQQIIIIII60sI")
_ENTRY = struct.Struct("<IIQQII")  # id, elem_bytes, offset, size_bytes, crc32, reserved
assert _HEADER.size == HEADER_BYTES and _ENTRY.size == 32

SECTIONS = {
    1: "token_offsets",
    2: "mlm_offsets",
    3: "a_lengths",
    4: "nsp_labels",
    5: "tokens",
    6: "mlm_positions",
    7: "mlm_labels",
}
NUM_SECTIONS = len(SECTIONS)
MAX_SEQ_LENGTH = 65535  # masked positions are u16


class ShardError(Exception):
    """A file that is not a valid nopad shard (the message names the file and what is wrong)."""


class Shard:
    """A memory-mapped nopad shard. verify=True checks every section's CRC-32 when opening."""

    def __init__(self, path, verify=True, expect_vocab_checksum=None):
        self.path = str(path)
        size = os.path.getsize(self.path)
        if size < HEADER_BYTES:
            raise ShardError(f"shard {self.path} is truncated: {size} bytes, smaller than the {HEADER_BYTES}-byte header")
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = bytes(self._mm[:HEADER_BYTES])
        (magic, version, header_bytes, self.num_seqs, self.num_tokens, self.num_masked, self.vocab_size,
         self.vocab_checksum, self.max_seq_length, self.token_bytes, num_sections, self.flags, _reserved,
         header_crc) = _HEADER.unpack(raw)
        if magic != MAGIC:
            raise ShardError(f"file {self.path} is not a nopad shard (bad magic at offset 0)")
        if version != VERSION:
            raise ShardError(f"shard {self.path} has format version {version}; this reader reads version {VERSION}")
        if zlib.crc32(raw[:-4] + b"\0\0\0\0") != header_crc:
            raise ShardError(f"shard {self.path} is corrupted: header checksum mismatch (offset 0..127)")
        if header_bytes != HEADER_BYTES or num_sections != NUM_SECTIONS or self.token_bytes not in (2, 4):
            raise ShardError(f"shard {self.path} has an unexpected header layout")
        max_vocab = 65536 if self.token_bytes == 2 else 2**31 - 1
        if not 1 <= self.vocab_size <= max_vocab:
            raise ShardError(f"shard {self.path} is corrupted: header field vocab_size is {self.vocab_size}, outside "
                             f"[1, {max_vocab}] for {self.token_bytes}-byte token ids")
        if self.max_seq_length > MAX_SEQ_LENGTH:
            raise ShardError(f"shard {self.path} is corrupted: header field max_seq_length is {self.max_seq_length}, "
                             f"above the format's limit of {MAX_SEQ_LENGTH} tokens")
        if expect_vocab_checksum is not None and self.vocab_checksum != expect_vocab_checksum:
            raise ShardError(f"shard {self.path} was built with another vocabulary (checksum {self.vocab_checksum}, "
                             f"expected {expect_vocab_checksum})")
        table_end = HEADER_BYTES + NUM_SECTIONS * _ENTRY.size
        if size < table_end:
            raise ShardError(f"shard {self.path} is truncated inside its section table ({size} bytes)")

        n, t, m, tb = self.num_seqs, self.num_tokens, self.num_masked, self.token_bytes
        expected = {1: (n + 1) * 8, 2: (n + 1) * 8, 3: n * 2, 4: n, 5: t * tb, 6: m * 2, 7: m * tb}
        dtypes = {1: "<u8", 2: "<u8", 3: "<u2", 4: "u1", 5: f"<u{tb}", 6: "<u2", 7: f"<u{tb}"}
        self.sections = {}
        arrays = {}
        for s in range(NUM_SECTIONS):
            at = HEADER_BYTES + s * _ENTRY.size
            sid, elem_bytes, offset, size_bytes, crc, _ = _ENTRY.unpack(bytes(self._mm[at:at + _ENTRY.size]))
            if sid != s + 1:
                raise ShardError(f"shard {self.path}: section table entry at offset {at} has id {sid}, expected {s + 1}")
            if size_bytes != expected[sid]:
                raise ShardError(f"shard {self.path}: section {sid} ({SECTIONS[sid]}) is {size_bytes} bytes, "
                                 f"expected {expected[sid]} from the header counts")
            if offset % ALIGN or offset < table_end or offset > size or size_bytes > size - offset:
                raise ShardError(f"shard {self.path} is truncated or corrupted: section {sid} at offset {offset} "
                                 f"(+{size_bytes} bytes) lies outside the {size}-byte file")
            self.sections[sid] = {"name": SECTIONS[sid], "elem_bytes": elem_bytes, "offset": offset,
                                  "size_bytes": size_bytes, "crc32": crc}
            arrays[sid] = np.frombuffer(self._mm, dtype=dtypes[sid], count=size_bytes // np.dtype(dtypes[sid]).itemsize,
                                        offset=offset)
        if verify:
            self.verify()
        self._token_offsets, self._mlm_offsets = arrays[1], arrays[2]
        self._a_lengths, self._nsp_labels = arrays[3], arrays[4]
        self._tokens, self._mlm_positions, self._mlm_labels = arrays[5], arrays[6], arrays[7]

        to, mo = self._token_offsets.astype(np.int64), self._mlm_offsets.astype(np.int64)
        if to[0] != 0 or to[-1] != t or mo[0] != 0 or mo[-1] != m:
            raise ShardError(f"shard {self.path} is corrupted: offsets do not span the payload")
        self.lengths = np.diff(to)
        masked = np.diff(mo)
        bad = ((self.lengths < 2) | (self.lengths > self.max_seq_length) | (masked < 0) | (masked > self.lengths) |
               (self._a_lengths < 2) | (self._a_lengths > self.lengths) | (self._nsp_labels > 1))
        if bad.any():
            i = int(np.argmax(bad))
            raise ShardError(f"shard {self.path} is corrupted: index entry of sample {i} is inconsistent")
        longest = int(self.lengths.max()) if n else 0
        if self.max_seq_length != longest:
            raise ShardError(f"shard {self.path} is corrupted: header field max_seq_length is {self.max_seq_length}, "
                             f"but its longest sample has {longest} tokens")

    def verify(self):
        """Checks every section's CRC-32; raises ShardError naming the first bad section."""
        for sid, sec in self.sections.items():
            data = self._mm[sec["offset"]:sec["offset"] + sec["size_bytes"]]
            if zlib.crc32(memoryview(np.ascontiguousarray(data))) != sec["crc32"]:
                raise ShardError(f"shard {self.path} is corrupted: checksum mismatch in section {sid} "
                                 f"({sec['name']}, bytes {sec['offset']}..{sec['offset'] + sec['size_bytes']})")

    def __len__(self):
        return self.num_seqs

    def _index(self, i):
        if not -self.num_seqs <= i < self.num_seqs:
            raise IndexError(f"sample {i} outside shard {self.path} of {self.num_seqs} samples")
        return i % self.num_seqs

    def tokens(self, i):
        i = self._index(i)
        return self._tokens[int(self._token_offsets[i]):int(self._token_offsets[i + 1])]

    def a_length(self, i):
        return int(self._a_lengths[self._index(i)])

    def nsp_label(self, i):
        return int(self._nsp_labels[self._index(i)])

    def mlm_positions(self, i):
        i = self._index(i)
        return self._mlm_positions[int(self._mlm_offsets[i]):int(self._mlm_offsets[i + 1])]

    def mlm_labels(self, i):
        i = self._index(i)
        return self._mlm_labels[int(self._mlm_offsets[i]):int(self._mlm_offsets[i + 1])]

    def sample(self, i):
        """One sample as a dict: tokens, segment_ids, a_length, nsp_label, mlm_positions, mlm_labels."""
        tokens = self.tokens(i)
        a = self.a_length(i)
        segments = np.ones(len(tokens), dtype=np.uint8)
        segments[:a] = 0
        return {"tokens": tokens, "segment_ids": segments, "a_length": a, "nsp_label": self.nsp_label(i),
                "mlm_positions": self.mlm_positions(i), "mlm_labels": self.mlm_labels(i)}

    def __iter__(self):
        for i in range(self.num_seqs):
            yield self.sample(i)

    def __repr__(self):
        return (f"Shard({self.path!r}, num_seqs={self.num_seqs}, num_tokens={self.num_tokens}, "
                f"num_masked={self.num_masked}, vocab_size={self.vocab_size}, token_bytes={self.token_bytes})")


class Dataset:
    """Every *.nopad shard of a folder, sorted by name; iterates over all samples in order."""

    def __init__(self, directory, verify=True):
        self.directory = str(directory)
        if os.path.isfile(self.directory):
            paths = [self.directory]
        else:
            paths = sorted(glob.glob(os.path.join(self.directory, "*.nopad")))
        if not paths:
            raise ShardError(f"dataset folder {self.directory} holds no .nopad shards")
        self.shards = [Shard(p, verify=verify) for p in paths]
        # offsets[k] = global id of shard k's first sample (nopad::Dataset numbers samples in shard-name order).
        self.offsets = np.concatenate([[0], np.cumsum([s.num_seqs for s in self.shards])]).astype(np.int64)

    @property
    def num_seqs(self):
        return int(self.offsets[-1])

    def locate(self, i):
        """(shard index, index within it) of global sample i."""
        if not 0 <= i < self.num_seqs:
            raise IndexError(f"sample {i} outside dataset {self.directory} of {self.num_seqs} samples")
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return k, int(i - self.offsets[k])

    def sample(self, i):
        k, j = self.locate(i)
        return self.shards[k].sample(j)

    def build_batch(self, ids):
        """The unpadded batch of the given global ids, in that order, as nopad's build_batch makes it (data/batch.h):
        numpy int32 arrays tokens, positions, segments [T]; cu_seqlens [B+1]; mlm_positions (rows of the packed
        batch, not positions within a sequence) and mlm_labels [M]; nsp_labels [B]; sample_ids [B] (int64); and
        max_seqlen (int)."""
        tokens, positions, segments, mlm_pos, mlm_lab, nsp = [], [], [], [], [], []
        cu = [0]
        for i in ids:
            k, j = self.locate(int(i))
            sh = self.shards[k]
            t = sh.tokens(j)
            n, a = len(t), sh.a_length(j)
            tokens.append(t)
            positions.append(np.arange(n, dtype=np.int32))
            seg = np.ones(n, dtype=np.int32)
            seg[:a] = 0
            segments.append(seg)
            mlm_pos.append(sh.mlm_positions(j).astype(np.int32) + cu[-1])
            mlm_lab.append(sh.mlm_labels(j))
            nsp.append(sh.nsp_label(j))
            cu.append(cu[-1] + n)
        cat = lambda parts: np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)
        lengths = np.diff(cu)
        return {"tokens": cat(tokens), "positions": cat(positions), "segments": cat(segments),
                "cu_seqlens": np.asarray(cu, dtype=np.int32), "max_seqlen": int(lengths.max()) if len(ids) else 0,
                "mlm_positions": cat(mlm_pos), "mlm_labels": cat(mlm_lab),
                "nsp_labels": np.asarray(nsp, dtype=np.int32), "sample_ids": np.asarray(ids, dtype=np.int64)}

    def __len__(self):
        return self.num_seqs

    def __iter__(self):
        for shard in self.shards:
            yield from shard


def open_dataset(directory, verify=True):
    return Dataset(directory, verify=verify)


def _summary(directory):
    ds = open_dataset(directory)
    tokens = sum(s.num_tokens for s in ds.shards)
    masked = sum(s.num_masked for s in ds.shards)
    lengths = np.concatenate([s.lengths for s in ds.shards])
    nsp = np.concatenate([np.asarray(s._nsp_labels) for s in ds.shards])
    print(f"{directory}: {len(ds.shards)} shards, {ds.num_seqs} sequences, {tokens} tokens, {masked} masked")
    print(f"  length min/mean/max {lengths.min()}/{lengths.mean():.1f}/{lengths.max()}, "
          f"random-next fraction {nsp.mean():.3f}")
    print(f"  vocab_size {ds.shards[0].vocab_size}, vocab_checksum {ds.shards[0].vocab_checksum}, checksums OK")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python3 nopad_shards.py DATASET_DIR_OR_SHARD")
    try:
        _summary(sys.argv[1])
    except ShardError as e:
        sys.exit(f"error: {e}")
