"""The nopad binary as a user meets it: --help lists the commands, the data commands work end to end on the
shipped sample, and bad input gives one clear error line, a non-zero exit and no half-written output.
Run by CTest with NOPAD_BINARY and NOPAD_SOURCE_DIR set."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

from nopad_checks import check, failures

NOPAD = os.environ["NOPAD_BINARY"]
SRC = os.environ["NOPAD_SOURCE_DIR"]
VOCAB = os.path.join(SRC, "data/vocab/bert-uncased-vocab.txt")
WIKI = os.path.join(SRC, "data/wiki-sample/wiki_00")


def run(*args, stdin=None):
    return subprocess.run([NOPAD, *args], input=stdin, capture_output=True, text=True)



def expect_error(result, needle, what):
    check(result.returncode == 1, f"{what}: exit code {result.returncode}, expected 1")
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    check(len(lines) == 1 and "error:" in lines[0] and needle in lines[0],
          f"{what}: expected one error line containing {needle!r}, got {result.stderr!r}")


def main():
    tmp = tempfile.mkdtemp(prefix="nopad-cli-")
    try:
        r = run("--help")
        check(r.returncode == 0, "--help exits 0")
        for cmd in ("tokenize", "prepare", "stats", "convert", "bench", "info"):
            check(cmd in r.stdout, f"--help lists {cmd}")

        r = run("tokenize", "--vocab", VOCAB, "--pieces", stdin="Hello, unaffable world!\n")
        check(r.returncode == 0 and r.stdout.split() == ["hello", ",", "una", "##ffa", "##ble", "world", "!"],
              f"tokenize --pieces: {r.stdout!r}")

        out = os.path.join(tmp, "data")
        r = run("prepare", "--input", WIKI, "--vocab", VOCAB, "--output", out, "--dupe-factor", "1",
                "--max-seq-length", "128", "--quiet")
        check(r.returncode == 0 and "instances" in r.stdout, f"prepare: {r.stdout} {r.stderr}")
        r = run("stats", out, "--json", "--workload", os.path.join(tmp, "lengths.txt"))
        check(r.returncode == 0, f"stats: {r.stderr}")
        stats = json.loads(r.stdout)
        lines = open(os.path.join(tmp, "lengths.txt")).read().split("\n")[:-1]
        check(len(lines) == stats["num_seqs"], "one workload line per sequence")
        check(sum(int(l.split()[0]) for l in lines) == stats["num_tokens"], "workload lengths sum to the tokens")
        check(all(1 <= int(l.split()[1]) <= 76 for l in lines), "masked counts in [1, 76]")
        check(stats["max_length"] <= 128 and 0 < stats["padding_fraction"] < 1, f"stats values {stats}")

        # A second prepare into the same folder is refused and leaves the dataset alone.
        shard = os.path.join(out, "shard_00000.nopad")
        before = open(shard, "rb").read()
        r = run("prepare", "--input", WIKI, "--vocab", VOCAB, "--output", out, "--quiet")
        expect_error(r, "--overwrite", "prepare into an existing dataset")
        check(open(shard, "rb").read() == before, "existing shard untouched")

        # A corrupted shard is reported with its name and the damaged section.
        bad = os.path.join(tmp, "bad")
        os.makedirs(bad)
        data = bytearray(before)
        data[len(data) // 2] ^= 0xFF
        open(os.path.join(bad, "shard_00000.nopad"), "wb").write(data)
        expect_error(run("stats", bad), "checksum mismatch", "stats on a corrupted shard")
        open(os.path.join(bad, "shard_00000.nopad"), "wb").write(before[:1000])
        expect_error(run("stats", bad), "truncated", "stats on a truncated shard")

        # A vocabulary without [MASK], an empty text, a non-UTF-8 text: one line each, nothing written.
        vocab = os.path.join(tmp, "vocab.txt")
        open(vocab, "w").write("[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\n")
        out2 = os.path.join(tmp, "out2")
        expect_error(run("prepare", "--input", WIKI, "--vocab", vocab, "--output", out2), "[MASK]", "vocab")
        empty = os.path.join(tmp, "empty.txt")
        open(empty, "w").write("\n\n")
        expect_error(run("prepare", "--input", empty, "--vocab", VOCAB, "--output", out2), "no text", "empty")
        latin = os.path.join(tmp, "latin1.txt")
        open(latin, "wb").write(b"Caf\xe9 au lait.\n")
        expect_error(run("prepare", "--input", latin, "--vocab", VOCAB, "--output", out2), "offset 3", "latin-1")
        check(not os.path.exists(out2), "no output folder left behind by a failed prepare")
        expect_error(run("stats", os.path.join(tmp, "missing")), "does not exist", "stats on a missing folder")

        # A folder where a file is expected, a padded length shorter than the data, a mistyped command word.
        expect_error(run("prepare", "--input", WIKI, "--vocab", tmp, "--output", out2), "is a folder",
                     "prepare --vocab FOLDER")
        expect_error(run("stats", out, "--padded-length", "5"), "shorter than the longest sequence",
                     "stats --padded-length below the longest sequence")
        for args, needle, command in ((["trian"], 'unknown command "trian"', "train"),
                                      (["bench", "bogus"], 'unknown command "bogus" after bench', "loader")):
            r = run(*args)
            err = [l for l in r.stderr.splitlines() if l.strip()]
            check(r.returncode != 0 and len(err) == 1 and needle in err[0] and command in err[0],
                  f"nopad {' '.join(args)}: one line naming the word and the commands, got {r.returncode} {r.stderr!r}")
        # A shard added to a dataset after its manifest was written (or one lost): the manifest no longer matches.
        extra = os.path.join(tmp, "extra")
        shutil.copytree(out, extra)
        shutil.copy(os.path.join(extra, "shard_00000.nopad"), os.path.join(extra, "shard_09999.nopad"))
        expect_error(run("stats", extra), "the shards in the folder hold", "stats on a folder with an extra shard")
        r = run("bench", "loader", "--data", out, "--steps", "0")
        check(r.returncode != 0 and "--steps" in r.stderr and "mean_length" not in r.stdout,
              f"bench loader --steps 0 is refused: {r.returncode} {r.stdout!r} {r.stderr!r}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("cli: all checks passed")


if __name__ == "__main__":
    main()
