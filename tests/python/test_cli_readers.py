"""The readers and commands of nopad on input that used to crash, hang or mislead: each case ends with one clear error
line (or the documented behaviour) and a non-zero exit where it is an error.
  - `nopad stats` on a shard whose header claims max_seq_length 0xFFFFFFFF (valid checksums): an error, not a crash;
  - `nopad tokenize` on invalid UTF-8: refused with line and byte offset, as `nopad prepare` refuses it;
  - a symbolic link that loops, inside an input folder, given as the input, or among a dataset's shards: named;
  - the staging folder a killed `prepare` left is removed by the next one, with a message; a live one stays;
  - `nopad eval --batch 10000` on 100 samples sizes its buffers to the 100 (it allocated for 10000: about 40 GB,
    and the kernel killed it without a word), and a batch that cannot fit in memory is refused with the memory it
    needs and the batch that fits.
Run by CTest with NOPAD_BINARY and NOPAD_SOURCE_DIR set."""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib

from nopad_checks import check, failures

NOPAD = os.environ["NOPAD_BINARY"]
SRC = os.environ["NOPAD_SOURCE_DIR"]
VOCAB = os.path.join(SRC, "data/vocab/bert-uncased-vocab.txt")
WIKI = os.path.join(SRC, "data/wiki-sample/wiki_00")


def run(*args, stdin=None, timeout=120):
    return subprocess.run([NOPAD, *args], input=stdin, capture_output=True, timeout=timeout)


def expect_error(result, needles, what):
    """Exit code 1 and one stderr line holding "error:" and every needle."""
    err = result.stderr.decode("utf-8", "replace")
    check(result.returncode == 1, f"{what}: exit code {result.returncode}, expected 1 (stderr {err!r})")
    lines = [l for l in err.splitlines() if l.strip()]
    check(len(lines) == 1 and "error:" in lines[0] and all(n in lines[0] for n in needles),
          f"{what}: expected one error line containing {needles!r}, got {err!r}")


def set_header_field(path, offset, fmt, value):
    """Writes one header field of a shard and fixes the header CRC, so that only the field checks can catch it."""
    raw = bytearray(open(path, "rb").read())
    struct.pack_into("<" + fmt, raw, offset, value)
    struct.pack_into("<I", raw, 124, 0)
    struct.pack_into("<I", raw, 124, zlib.crc32(bytes(raw[:128])))
    open(path, "wb").write(raw)


def prepare_sample(tmp):
    data = os.path.join(tmp, "data")
    r = run("prepare", "--input", WIKI, "--vocab", VOCAB, "--output", data, "--dupe-factor", "1",
            "--max-seq-length", "64", "--max-predictions", "10", "--quiet")
    if r.returncode != 0:
        sys.exit(f"FAIL: prepare of the sample: {r.stderr!r}")
    return data


def stats_on_lying_header(tmp, data):
    bad = os.path.join(tmp, "bad")
    os.makedirs(bad)
    shard = os.path.join(bad, "shard_00000.nopad")
    shutil.copy(os.path.join(data, "shard_00000.nopad"), shard)
    set_header_field(shard, 48, "I", 0xFFFFFFFF)  # max_seq_length
    expect_error(run("stats", bad), ["shard_00000.nopad", "max_seq_length is 4294967295"], "stats, max_seq_length")


def tokenize_invalid_utf8():
    good = "Hello world.\n".encode()
    r = run("tokenize", "--vocab", VOCAB, stdin=good + b"Caf\xe9 au lait.\nmore\n")
    expect_error(r, ["not UTF-8", "invalid byte 0xe9", "line 2", "byte offset 16"], "tokenize, Latin-1 byte")
    check(r.stdout.decode().splitlines() == ["7592 2088 1012"], f"tokenize prints the lines before: {r.stdout!r}")
    r = run("tokenize", "--vocab", VOCAB, "--pieces", stdin=b"ok\n\xed\xa0\x80 surrogate\n")
    expect_error(r, ["invalid byte 0xed", "line 2", "byte offset 3"], "tokenize, encoded surrogate")
    r = run("tokenize", "--vocab", VOCAB, stdin="caf\u00e9 \u4e2d\n".encode())
    check(r.returncode == 0 and len(r.stdout.split()) == 2, f"tokenize of valid UTF-8: {r.stdout!r} {r.stderr!r}")


def symlink_loops(tmp, data):
    folder = os.path.join(tmp, "texts")
    os.makedirs(os.path.join(folder, "sub"))
    shutil.copy(WIKI, os.path.join(folder, "sub", "wiki_00"))
    os.symlink("b", os.path.join(folder, "sub", "a"))  # a -> b -> a
    os.symlink("a", os.path.join(folder, "sub", "b"))
    os.symlink("..", os.path.join(folder, "sub", "up"))  # a link to a folder: not followed, so no loop
    out = os.path.join(tmp, "loop-out")
    r = run("prepare", "--input", folder, "--vocab", VOCAB, "--output", out, "--quiet")
    expect_error(r, ["symbolic link that loops", os.path.join(folder, "sub", "")], "prepare, link loop in a folder")
    check(not os.path.exists(out), "a failed prepare left its output folder")
    os.remove(os.path.join(folder, "sub", "a"))
    os.remove(os.path.join(folder, "sub", "b"))
    r = run("prepare", "--input", folder, "--vocab", VOCAB, "--output", out, "--quiet", "--dupe-factor", "1",
            "--max-seq-length", "64", "--max-predictions", "10")
    check(r.returncode == 0, f"prepare of a folder with a link to a folder above: {r.stderr!r}")
    self_link = os.path.join(tmp, "self")
    os.symlink("self", self_link)
    expect_error(run("prepare", "--input", self_link, "--vocab", VOCAB, "--output", out + "2", "--quiet"),
                 ["input " + self_link + " is a symbolic link that loops"], "prepare, input is a link loop")
    expect_error(run("stats", self_link), ["dataset " + self_link + " is a symbolic link that loops"],
                 "stats, dataset is a link loop")
    shards = os.path.join(tmp, "shards-with-loop")
    shutil.copytree(data, shards)
    os.symlink("x.nopad", os.path.join(shards, "x.nopad"))
    expect_error(run("stats", shards), ["shard " + os.path.join(shards, "x.nopad") + " is a symbolic link that loops"],
                 "stats, a shard is a link loop")


def dead_staging_folders(tmp):
    out = os.path.join(tmp, "staged")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its pid belongs to no process now
    dead = os.path.join(out, f".staging-{child.pid}")
    alive = os.path.join(out, f".staging-{os.getpid()}")
    for d in (dead, alive):
        os.makedirs(d)
        open(os.path.join(d, "shard_00000.nopad"), "wb").write(b"\0" * 4096)
    r = run("prepare", "--input", WIKI, "--vocab", VOCAB, "--output", out, "--dupe-factor", "1",
            "--max-seq-length", "64", "--max-predictions", "10", "--quiet")
    err = r.stderr.decode()
    check(r.returncode == 0, f"prepare beside staging folders: {err!r}")
    check(not os.path.exists(dead), "the staging folder of a dead process is still there")
    check(f"removed {dead}" in err and "no longer running" in err, f"no message on the removal: {err!r}")
    check(os.path.exists(alive) and alive not in err, "the staging folder of a live process was touched")
    leftovers = [n for n in os.listdir(out) if n.startswith(".staging-")]
    check(leftovers == [os.path.basename(alive)], f"staging folders left: {leftovers}")


def eval_batch_memory(tmp, data):
    run_dir = os.path.join(tmp, "tiny-run")
    r = subprocess.run([NOPAD, "train", "--config", os.path.join(SRC, "configs/bert-tiny-sample.toml"), "--overwrite",
                        "--set", f"run_dir={run_dir}", "--set", f"data.train={data}", "--set", "data.eval=",
                        "--set", "train.device=cpu", "--set", "train.threads=1", "--set", "train.global_batch=8",
                        "--set", "train.max_steps=1", "--set", "checkpoint.interval_steps=0"],
                       capture_output=True, cwd=SRC)
    if r.returncode != 0:
        sys.exit(f"FAIL: a one-step bert-tiny run for the eval checks: {r.stderr!r}")
    ckpt = os.path.join(run_dir, "checkpoints", "step_00000001")

    def evaluate(*args):
        """The finished eval and its peak resident memory in KiB (wait4 gives that one child's)."""
        p = subprocess.Popen([NOPAD, "eval", "--checkpoint", ckpt, "--data", data, "--threads", "1", "--quiet", *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = p.stdout.read(), p.stderr.read()
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        return subprocess.CompletedProcess(p.args, p.returncode, out, err), usage.ru_maxrss

    small, _ = evaluate("--batch", "32", "--max-samples", "100")
    big, peak_kib = evaluate("--batch", "10000", "--max-samples", "100")
    check(small.returncode == 0 and big.returncode == 0, f"eval: {small.stderr!r} {big.stderr!r}")
    if small.returncode == 0 and big.returncode == 0:
        a, b = json.loads(small.stdout), json.loads(big.stdout)
        check(a["samples"] == b["samples"] == 100 and a["masked"] == b["masked"], f"eval counts {a} {b}")
        check(abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), f"eval loss by batch: {a['loss']} {b['loss']}")
    check(peak_kib < 1_500_000,
          f"eval --batch 10000 of 100 samples peaked at {peak_kib} KiB: its buffers are not sized to the 100")

    # Up to 460 masked positions of 512 per sequence: the MLM head's probabilities take 460 x 30522 x 4 bytes
    # (56 MB) a sequence, so a batch of all 12,000 sequences (670 GB) needs more memory than machines have.
    heavy = os.path.join(tmp, "heavy")
    r = run("prepare", "--input", os.path.dirname(WIKI), "--vocab", VOCAB, "--output", heavy, "--dupe-factor", "10",
            "--max-seq-length", "512", "--max-predictions", "460", "--masked-lm-prob", "0.9", "--quiet")
    check(r.returncode == 0, f"prepare of the heavily masked data: {r.stderr!r}")
    r = run("eval", "--checkpoint", ckpt, "--data", heavy, "--batch", "1000000", "--quiet", timeout=60)
    expect_error(r, ["--batch 1000000 needs about ", " GiB of memory", " is available (", "use --batch "],
                 "eval --batch beyond the memory")
    err = r.stderr.decode()
    if "use --batch " in err:
        fits = int(err.split("use --batch ")[1].split()[0])
        check(1 <= fits < 1000000, f"the batch that fits: {fits}")


def main():
    tmp = tempfile.mkdtemp(prefix="nopad-cli-readers-")
    try:
        data = prepare_sample(tmp)
        stats_on_lying_header(tmp, data)
        tokenize_invalid_utf8()
        symlink_loops(tmp, data)
        dead_staging_folders(tmp)
        eval_batch_memory(tmp, data)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        sys.exit(f"FAIL: {len(failures)} check(s) failed")
    print("OK: test_cli_readers")


if __name__ == "__main__":
    main()
