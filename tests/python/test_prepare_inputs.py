"""`nopad prepare` on the inputs users hold: MLPerf's wiki sample as is, gzip'd (two members), xz'd, zstd'd and piped
through `--input -` gives byte-identical shards; the same articles as JSON lines (Hugging Face datasets' layout) give
the same shards as the WikiExtractor file; a folder mixing a .gz WikiExtractor file and a .jsonl file is read with
--format auto; and what prepare must not train on (JSON lines as plain text, a binary file, Parquet, bzip2, a
truncated .gz, a missing or nested --text-field) fails with one error line, exit 1 and no output folder.
Run by CTest with NOPAD_BINARY and NOPAD_SOURCE_DIR set; needs the zstd command (scripts/setup.sh installs it)."""
import bz2
import gzip
import json
import lzma
import os
import shutil
import subprocess
import sys
import tempfile

from nopad_checks import check, failures

NOPAD = os.environ["NOPAD_BINARY"]
SRC = os.environ["NOPAD_SOURCE_DIR"]
VOCAB = os.path.join(SRC, "data/vocab/bert-uncased-vocab.txt")
WIKI = os.path.join(SRC, "data/wiki-sample")


def prepare(inputs, out, *extra, stdin=None):
    """`nopad prepare` of `inputs` into `out` at 64 tokens, one duplicate. Returns the CompletedProcess (bytes)."""
    args = [NOPAD, "prepare"]
    for i in inputs:
        args += ["--input", i]
    args += ["--vocab", VOCAB, "--output", out, "--max-seq-length", "64", "--max-predictions", "10",
             "--dupe-factor", "1", "--seqs-per-shard", "2000", "--quiet", *extra]
    return subprocess.run(args, input=stdin, capture_output=True)


def shards(out):
    """{name: bytes} of the shard files of a dataset folder."""
    return {n: open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out)) if n.endswith(".nopad")}


def manifest(out):
    return json.load(open(os.path.join(out, "dataset.json")))


def wiki_to_jsonl(text):
    """WikiExtractor text -> JSON lines: one record per <doc>, "text" its paragraph lines joined by newlines (the
    title line left out), plus "id", "title" and a nested "meta" object; every other record \\u-escapes non-ASCII."""
    records, doc = [], None
    for line in text.split("\n"):
        s = line.strip()
        if s.startswith("<doc "):
            doc = {"id": s.split('id="')[1].split('"')[0], "title": None, "paragraphs": []}
        elif s == "</doc>":
            records.append(doc)
            doc = None
        elif s:
            check(doc is not None, f"wiki sample line outside a <doc>: {s[:60]!r}")
            if doc["title"] is None:
                doc["title"] = s
            else:
                doc["paragraphs"].append(s)
    out = []
    for i, d in enumerate(records):
        rec = {"id": d["id"], "title": d["title"], "text": "\n".join(d["paragraphs"]), "meta": {"source": "wiki"}}
        out.append(json.dumps(rec, ensure_ascii=(i % 2 == 0)))
    return "\n".join(out) + "\n", len(records)


def expect_error(result, needles, what, out):
    err = result.stderr.decode("utf-8", "replace")
    lines = [l for l in err.splitlines() if l.strip()]
    check(result.returncode == 1, f"{what}: exit code {result.returncode}, expected 1 ({err!r})")
    check(len(lines) == 1 and "error:" in lines[0] and all(n in lines[0] for n in needles),
          f"{what}: expected one error line containing {needles!r}, got {err!r}")
    check(not os.path.exists(out), f"{what}: the failed prepare left {out} behind")


def main():
    zstd = shutil.which("zstd")
    if zstd is None:
        sys.exit("test_prepare_inputs: no zstd command on PATH: install the Debian package zstd (scripts/setup.sh "
                 "does)")
    tmp = tempfile.mkdtemp(prefix="nopad-inputs-")
    try:
        r = subprocess.run([NOPAD, "prepare", "--help"], capture_output=True, text=True)
        check(r.returncode == 0 and "jsonl" in r.stdout and "--text-field" in r.stdout and "zstd" in r.stdout and
              "- for standard input" in r.stdout, f"prepare --help names jsonl, --text-field, zstd and -: {r.stdout}")

        wiki_00 = os.path.join(WIKI, "wiki_00")
        raw = open(wiki_00, "rb").read()
        plain = os.path.join(tmp, "plain")
        r = prepare([wiki_00], plain)
        check(r.returncode == 0, f"prepare wiki_00: {r.stderr!r}")
        reference = shards(plain)
        check(len(reference) >= 2 and all(len(b) > 1000 for b in reference.values()),
              f"the reference dataset has shards: {[len(b) for b in reference.values()]}")

        # (a) The same text compressed three ways (gzip in two members), by file and through standard input.
        half = raw.index(b"</doc>", len(raw) // 2) + 7
        files = {"wiki_00.gz": gzip.compress(raw[:half]) + gzip.compress(raw[half:]),
                 "wiki_00.xz": lzma.compress(raw, format=lzma.FORMAT_XZ)}
        for name, data in files.items():
            open(os.path.join(tmp, name), "wb").write(data)
        subprocess.run([zstd, "-q", "-3", wiki_00, "-o", os.path.join(tmp, "wiki_00.zst")], check=True)
        files["wiki_00.zst"] = open(os.path.join(tmp, "wiki_00.zst"), "rb").read()
        check(files["wiki_00.zst"][:4] == b"\x28\xb5\x2f\xfd", "the zstd command wrote a zstd frame")
        for name in files:
            out = os.path.join(tmp, "out-" + name)
            r = prepare([os.path.join(tmp, name)], out)
            check(r.returncode == 0 and shards(out) == reference, f"{name}: shards equal the plain file's {r.stderr!r}")
        for what, data in (("plain", raw), ("gzip", files["wiki_00.gz"]), ("zstd", files["wiki_00.zst"])):
            out = os.path.join(tmp, "stdin-" + what)
            r = prepare(["-"], out, stdin=data)
            check(r.returncode == 0 and shards(out) == reference, f"--input - ({what}): shards equal {r.stderr!r}")
            check(r.returncode == 0 and manifest(out)["inputs"] == ["<stdin>"],
                  f"--input - ({what}) is <stdin> in dataset.json")

        # (b) The articles as JSON lines give the WikiExtractor file's shards, with --format auto and jsonl.
        jsonl, num_docs = wiki_to_jsonl(raw.decode("utf-8"))
        check(num_docs >= 30, f"wiki_00 holds {num_docs} articles")
        jsonl_path = os.path.join(tmp, "wiki_00.jsonl")
        open(jsonl_path, "w", encoding="utf-8").write(jsonl)
        for fmt in ("auto", "jsonl"):
            out = os.path.join(tmp, "jsonl-" + fmt)
            r = prepare([jsonl_path], out, "--format", fmt)
            check(r.returncode == 0 and shards(out) == reference,
                  f"JSON lines, --format {fmt}: shards equal {r.stderr!r}")
        out = os.path.join(tmp, "jsonl-stdin")
        r = prepare(["-"], out, "--format", "jsonl", "--text-field", "text", stdin=gzip.compress(jsonl.encode()))
        check(r.returncode == 0 and shards(out) == reference, f"gzip'd JSON lines on stdin: {r.stderr!r}")
        bad_out = os.path.join(tmp, "bad")
        expect_error(prepare([jsonl_path], bad_out, "--text-field", "meta"),
                     [jsonl_path, "line 1", 'field "meta" is a JSON object, not a string'], "--text-field meta",
                     bad_out)
        expect_error(prepare([jsonl_path], bad_out, "--text-field", "meta.source"),
                     [jsonl_path, "line 1", 'has no field "meta.source"', '"id", "meta", "text", "title"',
                      "--text-field NAME"], "--text-field meta.source", bad_out)
        lines = jsonl.split("\n")
        missing = os.path.join(tmp, "missing.jsonl")
        open(missing, "w").write("\n".join(lines[:2] + ["", '{"id": "x", "body": "No text here."}'] + lines[2:]))
        expect_error(prepare([missing], bad_out), [missing, "line 4", 'has no field "text"', '"body", "id"'],
                     "a record without the text field", bad_out)

        # (c) A folder mixing a gzip'd WikiExtractor file and JSON lines: each file detected on its own.
        mixed = os.path.join(tmp, "mixed")
        os.makedirs(os.path.join(mixed, "a"))
        open(os.path.join(mixed, "a", "wiki_00.gz"), "wb").write(files["wiki_00.gz"])
        wiki_01_jsonl, _ = wiki_to_jsonl(open(os.path.join(WIKI, "wiki_01"), encoding="utf-8").read())
        open(os.path.join(mixed, "b.jsonl"), "w", encoding="utf-8").write(wiki_01_jsonl)
        out_mixed, out_both = os.path.join(tmp, "out-mixed"), os.path.join(tmp, "out-both")
        r = prepare([mixed], out_mixed)
        check(r.returncode == 0, f"prepare of a mixed folder: {r.stderr!r}")
        r = prepare([wiki_00, os.path.join(WIKI, "wiki_01")], out_both)
        check(r.returncode == 0 and shards(out_mixed) == shards(out_both),
              "a folder of wiki_00.gz and wiki_01 as JSON lines gives the shards of wiki_00 and wiki_01")
        check(manifest(out_mixed)["inputs"] == [os.path.join(mixed, "a", "wiki_00.gz"), os.path.join(mixed, "b.jsonl")],
              f"the mixed folder's inputs in dataset.json: {manifest(out_mixed)['inputs']}")

        # (d) Refusals: one line naming the file and what to do, exit 1, no output folder.
        expect_error(prepare([jsonl_path], bad_out, "--format", "lines"),
                     [jsonl_path, "is JSON lines", "--format jsonl --text-field NAME"], "JSON lines as --format lines",
                     bad_out)
        binary = os.path.join(tmp, "model.bin")
        open(binary, "wb").write(bytes(range(256)) * 64)
        expect_error(prepare([binary], bad_out), [binary, "is a binary file, not text"], "a binary file", bad_out)
        parquet = os.path.join(tmp, "train.parquet")
        open(parquet, "wb").write(b"PAR1\x15\x04\x15\x10\x15\x14L\x15\x02\x15\x00" + b"\x00" * 64 + b"PAR1")
        expect_error(prepare([parquet], bad_out),
                     [parquet, "is a Parquet file", "datasets.Dataset.from_parquet", "--input - --format jsonl"],
                     "a Parquet file", bad_out)
        bz = os.path.join(tmp, "wiki_00.bz2")
        open(bz, "wb").write(bz2.compress(raw[:20000]))
        expect_error(prepare([bz], bad_out), [bz, "is bzip2-compressed", "bzcat"], "a bzip2 file", bad_out)
        truncated = os.path.join(tmp, "cut.gz")
        open(truncated, "wb").write(files["wiki_00.gz"][:len(files["wiki_00.gz"]) // 3])
        expect_error(prepare([truncated], bad_out),
                     [truncated, "ends before the end of its gzip stream: the file is truncated"], "a truncated .gz",
                     bad_out)
        # A bad file inside a folder fails the whole run too, naming that file.
        shutil.copy(truncated, os.path.join(mixed, "c.gz"))
        expect_error(prepare([mixed], bad_out), [os.path.join(mixed, "c.gz"), "truncated"], "a folder with a cut .gz",
                     bad_out)
        expect_error(prepare(["-", "-"], bad_out, stdin=raw), ["standard input can be read only once"],
                     "--input - twice", bad_out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("prepare inputs: all checks passed")


if __name__ == "__main__":
    main()
