"""scripts/ncu_sass_summary.py on a synthetic ncu source export: a kernel-name line, the header, a 2-instruction
prologue, a 4-instruction loop body (2 HGMMA) executed 100 times and a 3-instruction epilogue executed 10 times, with
samples and stall reasons set per instruction. Checks the totals, the stall-reason and opcode shares, the code blocks
(offsets, counts, HGMMA, samples), the top instructions with their stall reasons, --range, and the errors for a file
that is not such an export. Needs no GPU."""
import csv
import os
import subprocess
import sys
import tempfile

from nopad_checks import check, failures

SRC = os.environ.get("NOPAD_SOURCE_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SCRIPT = os.path.join(SRC, "scripts", "ncu_sass_summary.py")

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "# Samples", "Instructions Executed", "stall_long_sb", "stall_wait", "stall_barrier",
          "stall_long_sb (Not Issued)"]
# (source, samples, executed, long_sb, wait, barrier)
CODE = [
    ("LDC R1, c[0x0][0x28]", 1, 4, 0, 1, 0),
    ("S2R R2, SR_TID.X", 0, 4, 0, 0, 0),
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ], R4", 5, 100, 0, 5, 0),
    ("@!P0  BRA 0x7f0000000400", 50, 100, 48, 2, 0),
    ("HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8], R24", 10, 100, 0, 10, 0),
    ("HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8], R24, gsb0", 4, 100, 0, 4, 0),
    ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 20, 10, 0, 0, 20),
    ("STS [R5], R6", 6, 10, 0, 6, 0),
    ("EXIT", 4, 10, 0, 4, 0),
]  # 100 samples in all


def export(path, rows=CODE, header=HEADER, kernel=True):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        if kernel:
            w.writerow(["Kernel Name", "void k<1>(int)"])
        w.writerow(header)
        for i, (src, samples, executed, lsb, wait, bar) in enumerate(rows):
            w.writerow([hex(0x7F0000000000 + 16 * i), "      " + src, samples, samples, samples, executed, lsb, wait,
                        bar, lsb])


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)


with tempfile.TemporaryDirectory() as tmp:
    good = os.path.join(tmp, "k-sass.csv")
    export(good)
    r = run(good, "--top", "3", "--range", "0x20:0x40")
    out = r.stdout
    check(r.returncode == 0, f"exit 0 on a good export (got {r.returncode}: {r.stderr})")
    check("kernel: void k<1>(int)" in out, "the kernel's name")
    check("9 instructions in the code, 438 warp instructions executed, 100 samples" in out,
          "the totals (9 instructions; 2x4 + 4x100 + 3x10 executed; 100 samples)")
    check("by stall reason: long_sb 48.0%, wait 32.0%, barrier 20.0%" in out, "the stall-reason shares")
    check("by opcode:       BRA 50.0%, WARPGROUP.DEPBAR.LE 20.0%, HGMMA.64x256x16.F32.BF16 14.0%" in out,
          "the opcode shares (HGMMA's two instructions summed, the predicate stripped from BRA)")
    # Blocks by samples: the loop (offsets 0x20-0x50, 4 instructions, 2 HGMMA, 69%), the epilogue (0x60-0x80, 30%),
    # the prologue (0x00-0x10, 1%).
    lines = out.splitlines()
    at = lines.index(next(l for l in lines if l.startswith("code blocks")))
    blocks = [l.split() for l in lines[at + 2: at + 5]]
    check(blocks[0] == ["0x00020-0x00050", "100", "4", "2", "69.0%"], f"the loop block first ({blocks[0]})")
    check(blocks[1] == ["0x00060-0x00080", "10", "3", "0", "30.0%"], f"the epilogue block second ({blocks[1]})")
    check(blocks[2] == ["0x00000-0x00010", "4", "2", "0", "1.0%"], f"the prologue block last ({blocks[2]})")
    at = lines.index("instructions with the most samples:")
    top = lines[at + 1: at + 4]
    check(top[0].startswith("0x00030  50.0% exec        100  @!P0  BRA") and top[0].rstrip().endswith(
        "long_sb=48 wait=2"), f"the top instruction with its stall reasons ({top[0]!r})")
    check(top[1].startswith("0x00060  20.0%") and "barrier=20" in top[1], f"the second ({top[1]!r})")
    check(len([l for l in top if l.startswith("0x")]) == 3, "--top 3 lists three")
    at = lines.index("instructions 0x20-0x40:")
    rng = [l for l in lines[at + 1:] if l.startswith("0x")]
    check([l.split()[0] for l in rng] == ["0x00020", "0x00030"], f"--range 0x20:0x40 prints 0x20 and 0x30 ({rng})")

    # Not an export: a missing column, no rows, a bad --range; each a message and a non-zero exit.
    bad = os.path.join(tmp, "bad.csv")
    export(bad, header=[h for h in HEADER if h != "Instructions Executed"])
    r = run(bad)
    check(r.returncode != 0 and "no 'Instructions Executed' column" in r.stderr, f"a missing column ({r.stderr!r})")
    empty = os.path.join(tmp, "empty.csv")
    open(empty, "w").close()
    r = run(empty)
    check(r.returncode != 0 and "no rows" in r.stderr, f"an empty file ({r.stderr!r})")
    r = run(good, "--range", "0x20")
    check(r.returncode != 0 and "--range 0x20" in r.stderr, f"a bad --range ({r.stderr!r})")
    # Without the kernel-name line (some ncu versions leave it out) the export still reads.
    plain = os.path.join(tmp, "plain.csv")
    export(plain, kernel=False)
    r = run(plain)
    check(r.returncode == 0 and "100 samples" in r.stdout, "an export without the kernel-name line")

if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("ncu_sass_summary: all checks passed")
