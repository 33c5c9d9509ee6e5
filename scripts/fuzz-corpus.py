#!/usr/bin/env python3
"""Writes the seed corpus of nopad's fuzz targets, tests/fuzz/corpus/<target>/ (docs/fuzzing.md): small valid inputs
(a few KB each) from nopad's own writers and test data, plus a few that each refusal path starts from. The files are
committed; this script regenerates them (the same bytes on every run).

  shard_reader   shards written by `nopad prepare` (2- and 4-byte token ids) and `nopad convert --from-tfrecord`
  text_input     prepare's inputs: sentence lines, WikiExtractor, JSON lines; gzip (two members), xz, zstd
  tokenizer      short texts: English, accents, CJK, punctuation, control bytes, invalid UTF-8, a word > 100 chars
  tfrecord       records of tests/data/tfrecord/sample.tfrecord (TensorFlow wrote them), the bad-*.tfrecord fixtures
  hdf5           fixed, variable-length and packed files written with h5py as NVIDIA's and MLPerf's scripts do
  tf_checkpoint  tensor bundles (a tiny BERT, written below in TensorFlow's format; TensorFlow's object-based
                 fixture); each seed is u32 N, N bytes of .index, then the .data-00000-of-00001 bytes
  config         the example configs of configs/, and one with --set overrides after a NUL byte

Needs numpy, h5py and the zstd tool (scripts/setup.sh installs them) and a built nopad: NOPAD_BINARY, else
build/nopad or build-cpu/nopad.
Usage: python3 scripts/fuzz-corpus.py
"""
import gzip
import json
import lzma
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import h5py
import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
OUT = os.path.join(ROOT, "tests", "fuzz", "corpus")
VOCAB = os.path.join(ROOT, "data", "vocab", "bert-uncased-vocab.txt")
CLS, SEP, VOCAB_SIZE = 101, 102, 30522


def nopad_binary():
    for b in [os.environ.get("NOPAD_BINARY"), os.path.join(ROOT, "build", "nopad"),
              os.path.join(ROOT, "build-cpu", "nopad")]:
        if b and os.access(b, os.X_OK):
            return b
    sys.exit("fuzz-corpus: no nopad binary (build it with bash scripts/setup.sh, or set NOPAD_BINARY)")


def put(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def read(path):
    with open(path, "rb") as f:
        return f.read()


# --- text ------------------------------------------------------------------------------------------------------

def wiki_docs(count, max_chars):
    """The first documents of data/wiki-sample/wiki_00 (WikiExtractor output), each cut to about max_chars."""
    text = read(os.path.join(ROOT, "data", "wiki-sample", "wiki_00")).decode("utf-8")
    docs = []
    for chunk in text.split("</doc>")[:count]:
        chunk = chunk.strip("\n")
        lines, size = [], 0
        for line in chunk.split("\n"):
            if size > max_chars:
                break
            lines.append(line[:max_chars])
            size += len(lines[-1])
        docs.append("\n".join(lines) + "\n</doc>\n")
    return docs


def sentences_of(doc):
    body = [l for l in doc.split("\n")[2:] if l and not l.startswith("</doc")]
    out = []
    for para in body:
        out += [s.strip() + "." for s in para.split(". ") if s.strip()]
    return out


def text_corpus():
    docs = wiki_docs(3, 700)
    wiki = "".join(docs)
    lines = "\n\n".join("\n".join(sentences_of(d)[:6]) for d in docs) + "\n"
    records = [{"id": str(i), "title": d.split("title=\"")[1].split("\"")[0], "text": "\n".join(sentences_of(d)[:4])}
               for i, d in enumerate(docs)]
    records.append({"id": "u", "text": "Caf\u00e9 na\u00efve \u4e2d\u6587 \"quoted\"\ttab. Second sentence!"})
    jsonl = "".join(json.dumps(r, ensure_ascii=(i % 2 == 0)) + "\n" for i, r in enumerate(records))
    put("text_input", "lines.txt", lines.encode())
    put("text_input", "wiki.txt", wiki.encode())
    put("text_input", "records.jsonl", jsonl.encode())
    put("text_input", "bom-crlf.txt", b"\xef\xbb\xbf" + lines[:600].replace("\n", "\r\n").encode())
    put("text_input", "abbreviations.txt",
        "Dr. J. R. R. Tolkien wrote it... and then? \"Yes!\" (It sold.) Mr. Smith paid $3.50 e.g. for tea. "
        "U.S. law... Next one.\n\nA second doc.\n".encode())
    put("text_input", "array.json", json.dumps(records[:2]).encode() + b"\n")
    put("text_input", "lines.txt.gz", gzip.compress(lines.encode(), mtime=0) + gzip.compress(b"more.\n", mtime=0))
    put("text_input", "wiki.txt.xz", lzma.compress(wiki.encode(), preset=6))
    zst = subprocess.run(["zstd", "-q", "-c", "-19", "--no-check"], input=jsonl.encode(), stdout=subprocess.PIPE,
                         check=True).stdout
    put("text_input", "records.jsonl.zst", zst)


def tokenizer_corpus():
    texts = {
        "english.txt": "The quick brown fox jumps over the lazy dog; it's 3.14 o'clock, isn't it? "
                       "Unaffable, untranslatable, xylophonists.",
        "accents.txt": "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve \u00c5ngstr\u00f6m, \u0130stanbul, "
                       "stra\u00dfe, \u1e9e, \u01c5, e\u0301 (combining).",
        "cjk.txt": "\u4e2d\u6587\u5b57 \u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \ud55c\uad6d\uc5b4 "
                   "\U00020000\U0002a700 mixed\u4e2dtext",
        "punctuation.txt": "!!!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ \u2014\u201c\u201d\u2018\u2019\u00bf\u00a1 "
                           "[CLS] [SEP] [MASK] ##ing",
        "whitespace.txt": "a\tb\nc\rd\u00a0e\u2003f\u3000g\u200bh\u2028i\ufeffj \u0000k\u0007l\ufffdm",
        "long-word.txt": "x" * 101 + " " + "ab" * 50 + " " + "\u00e9" * 101 + " end",
        "scripts.txt": "\u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u0939\u093f\u0928\u094d\u0926\u0940 "
                       "\u0440\u0443\u0441\u0441\u043a\u0438\u0439 \u03b5\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac "
                       "\U0001f600\U0001f44d\u200d",
    }
    for name, t in texts.items():
        put("tokenizer", name, t.encode("utf-8", "surrogatepass"))
    put("tokenizer", "invalid-utf8.txt", b"ok \xff\xfe bad \xc3\x28 \xe2\x82 \xf0\x9f\x98 \xed\xa0\x80 \xc0\xaf end")


# --- TFRecord and shards -------------------------------------------------------------------------------------

def tfrecord_records(path):
    """The framed records of a TFRecord file, each with its length, CRCs and data."""
    data, out, off = read(path), [], 0
    while off < len(data):
        (n,) = struct.unpack_from("<Q", data, off)
        out.append(data[off:off + 16 + n])
        off += 16 + n
    return out


def tfrecord_corpus():
    fixtures = os.path.join(ROOT, "tests", "data", "tfrecord")
    records = tfrecord_records(os.path.join(fixtures, "sample.tfrecord"))
    put("tfrecord", "one.tfrecord", records[0])
    put("tfrecord", "three.tfrecord", b"".join(records[1:4]))
    for name in ["bad-float-ids", "bad-missing-feature", "bad-segments", "bad-weights"]:
        put("tfrecord", name + ".tfrecord", read(os.path.join(fixtures, name + ".tfrecord")))
    put("tfrecord", "gzip.tfrecord.gz", read(os.path.join(fixtures, "sample.tfrecord.gz")))
    return records


def shard_corpus(records, tmp):
    nopad = nopad_binary()
    text = os.path.join(tmp, "text.txt")
    with open(text, "w") as f:
        f.write("\n\n".join("\n".join(sentences_of(d)[:8]) for d in wiki_docs(4, 2000)) + "\n")

    def shard_of(folder):
        shards = sorted(p for p in os.listdir(folder) if p.endswith(".nopad"))
        return read(os.path.join(folder, shards[0]))

    for name, args in [("prepare-32.nopad", ["--max-seq-length", "32", "--max-predictions", "5"]),
                       ("prepare-64.nopad", ["--max-seq-length", "64", "--max-predictions", "10",
                                             "--short-seq-prob", "0.5"])]:
        out = os.path.join(tmp, name)
        subprocess.run([nopad, "prepare", "--input", text, "--vocab", VOCAB, "--output", out, "--dupe-factor", "1",
                        "--seqs-per-shard", "12", "--threads", "1", "--quiet"] + args, check=True,
                       stdout=subprocess.DEVNULL)
        put("shard_reader", name, shard_of(out))
    # A vocabulary of more than 65,535 tokens: shards then store 4-byte token ids.
    big_vocab = os.path.join(tmp, "vocab-70000.txt")
    with open(big_vocab, "w") as f:
        f.write(read(VOCAB).decode() + "".join(f"zzextra{i}\n" for i in range(70000 - VOCAB_SIZE)))
    out = os.path.join(tmp, "wide")
    subprocess.run([nopad, "prepare", "--input", text, "--vocab", big_vocab, "--output", out, "--dupe-factor", "1",
                    "--seqs-per-shard", "8", "--threads", "1", "--quiet", "--max-seq-length", "24",
                    "--max-predictions", "4"], check=True, stdout=subprocess.DEVNULL)
    put("shard_reader", "prepare-4-byte-tokens.nopad", shard_of(out))
    tfr = os.path.join(tmp, "two.tfrecord")
    with open(tfr, "wb") as f:
        f.write(b"".join(records[4:6]))
    out = os.path.join(tmp, "from-tfrecord")
    subprocess.run([nopad, "convert", "--from-tfrecord", tfr, "--vocab", VOCAB, "--output", out, "--threads", "1"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    put("shard_reader", "tfrecord.nopad", shard_of(out))


# --- HDF5 ------------------------------------------------------------------------------------------------------

def instances(rng, count, max_len):
    out = []
    for _ in range(count):
        n = int(rng.integers(5, max_len + 1))
        a = int(rng.integers(2, n - 1))
        tokens = rng.integers(999, VOCAB_SIZE, size=n)
        tokens[0], tokens[a - 1], tokens[n - 1] = CLS, SEP, SEP
        k = int(rng.integers(0, 4))
        positions = np.sort(rng.choice(np.arange(1, n - 1), size=k, replace=False))
        out.append((tokens, a, positions, rng.integers(0, VOCAB_SIZE, size=k), int(rng.integers(0, 2))))
    return out


def segs(tokens, a):
    s = np.ones(len(tokens), np.int8)
    s[:a] = 0
    return s


def vlen(rows, dt):
    col = np.empty(len(rows), dtype=object)
    for i, r in enumerate(rows):
        col[i] = np.asarray(r, dtype=dt)
    return col


def h5(path, columns, compression=None, libver="earliest"):
    # track_times off: the same bytes on every run. The earliest file format (h5py's default, what NVIDIA's and
    # MLPerf's files use) has no metadata checksums, so mutations reach the readers behind them.
    with h5py.File(path, "w", libver=libver) as f:
        for name, data, dt in columns:
            chunks = data.shape if compression else None  # one chunk each: small B-trees
            f.create_dataset(name, data=data, dtype=dt, compression=compression, chunks=chunks, track_times=False)


def hdf5_corpus(tmp):
    rng = np.random.default_rng(50)
    s, p = 16, 4
    fixed = instances(rng, 5, s)
    ids, mask, seg = (np.zeros((5, s), np.int16), np.zeros((5, s), np.int8), np.zeros((5, s), np.int8))
    pos, lab, nsp = np.zeros((5, p), np.int16), np.zeros((5, p), np.int16), np.zeros(5, np.int8)
    for i, (t, a, ps, ls, y) in enumerate(fixed):
        ids[i, :len(t)], mask[i, :len(t)], seg[i, :len(t)] = t, 1, segs(t, a)
        pos[i, :len(ps)], lab[i, :len(ls)], nsp[i] = ps, ls, y
    cols = [("input_ids", ids, ids.dtype), ("input_mask", mask, mask.dtype), ("segment_ids", seg, seg.dtype),
            ("masked_lm_positions", pos, pos.dtype), ("masked_lm_ids", lab, lab.dtype),
            ("next_sentence_labels", nsp, nsp.dtype)]
    # The gzip one in the newest format: its chunk index is 2 KB, not the 15 KB of v1 B-trees.
    files = [("fixed.hdf5", cols, None), ("fixed-gzip.hdf5", cols, "gzip", "latest")]

    var = instances(rng, 5, 12)
    i16, i8 = h5py.vlen_dtype(np.dtype("int16")), h5py.vlen_dtype(np.dtype("int8"))
    files.append(("variable.hdf5", [
        ("input_ids", vlen([x[0] for x in var], np.int16), i16),
        ("segment_ids", vlen([segs(x[0], x[1]) for x in var], np.int8), i8),
        ("masked_lm_positions", vlen([x[2] for x in var], np.int16), i16),
        ("masked_lm_ids", vlen([x[3] for x in var], np.int16), i16),
        ("next_sentence_labels", np.array([x[4] for x in var], np.int8), np.int8)], None))

    packed = instances(rng, 6, 10)
    rows = {k: [] for k in ["ids", "segs", "pos", "lab", "len", "mlen", "nsp"]}
    for group in (packed[0:1], packed[1:3], packed[3:6]):
        off, ps = 0, []
        for t, a, pp, _, _ in group:
            ps.append(np.asarray(pp) + off)
            off += len(t)
        rows["ids"].append(np.concatenate([g[0] for g in group]))
        rows["segs"].append(np.concatenate([segs(g[0], g[1]) for g in group]))
        rows["pos"].append(np.concatenate(ps))
        rows["lab"].append(np.concatenate([g[3] for g in group]))
        rows["len"].append([len(g[0]) for g in group])
        rows["mlen"].append([len(g[2]) for g in group])
        rows["nsp"].append([g[4] for g in group])
    files.append(("packed.hdf5", [
        ("input_ids", vlen(rows["ids"], np.int16), i16), ("segment_ids", vlen(rows["segs"], np.int8), i8),
        ("masked_lm_positions", vlen(rows["pos"], np.int16), i16),
        ("masked_lm_ids", vlen(rows["lab"], np.int16), i16),
        ("packed_input_len", vlen(rows["len"], np.int16), i16),
        ("packed_masked_lm_len", vlen(rows["mlen"], np.int16), i16),
        ("next_sentence_labels", vlen(rows["nsp"], np.int8), i8)], None))
    files.append(("variable-latest.hdf5", files[2][1], None, "latest"))
    for name, columns, compression, *libver in files:
        path = os.path.join(tmp, name)
        h5(path, columns, compression, *libver)
        put("hdf5", name, read(path))


# --- TensorFlow checkpoints --------------------------------------------------------------------------------------

def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


CRC32C_TABLE = _crc32c_table()


def crc32c(data):
    c = 0xFFFFFFFF
    for b in data:
        c = CRC32C_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def varint(v):
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def field(number, wire, payload):
    tag = varint(number << 3 | wire)
    if wire == 0:
        return tag + varint(payload)
    if wire == 2:
        return tag + varint(len(payload)) + payload
    if wire == 5:
        return tag + struct.pack("<I", payload)
    raise ValueError(wire)


def table_block(entries):
    """A LevelDB table block: keys prefix-compressed against the previous one, restart points every 4 entries."""
    out, restarts, last = bytearray(), [], b""
    for i, (key, value) in enumerate(entries):
        shared = 0
        if i % 4 == 0:
            restarts.append(len(out))
        else:
            while shared < min(len(key), len(last)) and key[shared] == last[shared]:
                shared += 1
        out += varint(shared) + varint(len(key) - shared) + varint(len(value)) + key[shared:] + value
        last = key
    if not restarts:
        restarts.append(0)
    for r in restarts:
        out += struct.pack("<I", r)
    return bytes(out + struct.pack("<I", len(restarts)))


def tensor_bundle(tensors, per_block=6):
    """(index bytes, data bytes) of a TensorFlow V2 checkpoint holding `tensors`: name -> (tf dtype code, shape,
    raw little-endian bytes)."""
    data = bytearray()
    entries = [(b"", field(1, 0, 1) + field(3, 2, field(1, 0, 1)))]  # BundleHeaderProto: 1 shard, version 1
    for name in sorted(tensors):
        code, shape, raw = tensors[name]
        shape_proto = b"".join(field(2, 2, field(1, 0, d)) for d in shape)
        entry = field(1, 0, code) + (field(2, 2, shape_proto) if shape else b"")
        entry += (field(4, 0, len(data)) if data else b"") + field(5, 0, len(raw)) + field(6, 5, masked_crc(raw))
        entries.append((name.encode(), entry))
        data += raw
    index, handles = bytearray(), []
    for b in range(0, len(entries), per_block):
        chunk = entries[b:b + per_block]
        block = table_block(chunk)
        handles.append((chunk[-1][0], len(index), len(block)))
        index += block + b"\x00" + struct.pack("<I", masked_crc(block + b"\x00"))
    meta = table_block([])
    meta_handle = (len(index), len(meta))
    index += meta + b"\x00" + struct.pack("<I", masked_crc(meta + b"\x00"))
    top = table_block([(key, varint(off) + varint(size)) for key, off, size in handles])
    top_handle = (len(index), len(top))
    index += top + b"\x00" + struct.pack("<I", masked_crc(top + b"\x00"))
    footer = varint(meta_handle[0]) + varint(meta_handle[1]) + varint(top_handle[0]) + varint(top_handle[1])
    index += footer.ljust(40, b"\x00") + struct.pack("<Q", 0xDB4775248B80FB57)
    return bytes(index), bytes(data)


# tests/fuzz/tf_checkpoint_fuzz_body.h loads these weights into the same model (tf_fuzz_bert_config).
TINY_BERT = {"hidden_size": 4, "intermediate_size": 8, "vocab_size": 8, "max_position_embeddings": 8,
             "type_vocab_size": 2, "num_hidden_layers": 1}


def tiny_bert_variables(c):
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    out = [("bert/embeddings/word_embeddings", [v, h]), ("bert/embeddings/token_type_embeddings",
                                                        [c["type_vocab_size"], h]),
           ("bert/embeddings/position_embeddings", [c["max_position_embeddings"], h]),
           ("bert/embeddings/LayerNorm/gamma", [h]), ("bert/embeddings/LayerNorm/beta", [h])]

    def dense(prefix, n_in, n_out):
        return [(prefix + "/kernel", [n_in, n_out]), (prefix + "/bias", [n_out])]

    def norm(prefix):
        return [(prefix + "/gamma", [h]), (prefix + "/beta", [h])]

    for l in range(c["num_hidden_layers"]):
        t = f"bert/encoder/layer_{l}"
        for part in ("query", "key", "value"):
            out += dense(f"{t}/attention/self/{part}", h, h)
        out += dense(f"{t}/attention/output/dense", h, h) + norm(f"{t}/attention/output/LayerNorm")
        out += dense(f"{t}/intermediate/dense", h, f) + dense(f"{t}/output/dense", f, h)
        out += norm(f"{t}/output/LayerNorm")
    out += dense("bert/pooler/dense", h, h) + dense("cls/predictions/transform/dense", h, h)
    out += norm("cls/predictions/transform/LayerNorm")
    out += [("cls/predictions/output_bias", [v]), ("cls/seq_relationship/output_weights", [2, h]),
            ("cls/seq_relationship/output_bias", [2])]
    return out


def pattern(shape, k):
    i = np.arange(int(np.prod(shape)), dtype=np.int64)
    return (((37 * i + 101 * k) % 251 - 125) / 500.0).astype(np.float32).reshape(shape)


def seed_of(index, data):
    return struct.pack("<I", len(index)) + index + data


def tf_checkpoint_corpus():
    bert = {}
    for k, (name, shape) in enumerate(tiny_bert_variables(TINY_BERT)):
        bert[name] = (1, shape, pattern(shape, k).tobytes())
    bert["bert/encoder/layer_0/output/dense/kernel/adam_m"] = (1, [8, 4], pattern([8, 4], 99).tobytes())
    bert["global_step"] = (9, [], struct.pack("<q", 3))
    put("tf_checkpoint", "tiny-bert", seed_of(*tensor_bundle(bert)))

    half = pattern([3, 5], 3000)
    bf16 = (pattern([7], 3001).view(np.uint32) >> 16).astype(np.uint16)
    other = {"extra/half": (19, [3, 5], half.astype(np.float16).tobytes()),
             "extra/bfloat16": (14, [7], bf16.tobytes()),
             "extra/float64": (2, [2, 2], pattern([2, 2], 5).astype(np.float64).tobytes()),
             "extra/int32": (3, [3], np.arange(3, dtype=np.int32).tobytes()),
             "extra/scalar": (1, [], pattern([1], 6).tobytes()),
             "extra/empty": (1, [0, 4], b"")}
    put("tf_checkpoint", "dtypes", seed_of(*tensor_bundle(other, per_block=3)))

    fixtures = os.path.join(ROOT, "tests", "data", "tf-bert-checkpoint")
    obj = os.path.join(fixtures, "object-based", "ckpt")
    put("tf_checkpoint", "object-based", seed_of(read(obj + ".index"), read(obj + ".data-00000-of-00001")))
    # TensorFlow's own index of the fixture (its 1.3 MB of data left out: the reader stops at the first tensor).
    put("tf_checkpoint", "tensorflow-index-only", seed_of(read(os.path.join(fixtures, "model.ckpt-3.index")), b""))


# --- config ------------------------------------------------------------------------------------------------------

def config_corpus():
    configs = os.path.join(ROOT, "configs")
    for name in sorted(os.listdir(configs)):
        if name.endswith(".toml"):
            put("config", name, read(os.path.join(configs, name)))
    put("config", "overrides.toml",
        b"# a comment\nrun_dir = \"runs/a\"  # trailing\n[optim]\nlr = 4.25e-4\n[train]\nseed = -1\n"
        b"\x00optim.lr=1e-3\nrun_dir=/tmp/x\ndata.eval=\ntrain.max_steps=+7\nmodel.config=\"quoted \\\" path\"\n")


def main():
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    with tempfile.TemporaryDirectory(prefix="nopad-fuzz-corpus-") as tmp:
        text_corpus()
        tokenizer_corpus()
        records = tfrecord_corpus()
        shard_corpus(records, tmp)
        hdf5_corpus(tmp)
        tf_checkpoint_corpus()
        config_corpus()
    total = 0
    for target in sorted(os.listdir(OUT)):
        files = os.listdir(os.path.join(OUT, target))
        size = sum(os.path.getsize(os.path.join(OUT, target, f)) for f in files)
        total += size
        print(f"fuzz-corpus: {target}: {len(files)} files, {size} bytes")
    print(f"fuzz-corpus: {total} bytes in {OUT}")


if __name__ == "__main__":
    main()
