"""`nopad report` plots: several runs overlaid and every text inside the image. Runs with known metrics.jsonl lines
(long folder names, one with characters outside ASCII, one without evaluations, one with a non-finite loss) are
reported together; each of the six plots has one polyline per run with as many points as the run logged for it, and a
legend naming every run (" (no data)" after an empty one); two runs whose folders share a name get their parents'
names. Each SVG is checked structurally (every text element's extent, estimated with the width bound nopad lays the
plot out with, lies inside the viewBox) and rendered to PNG with rsvg-convert (Debian's librsvg2-bin, installed by
scripts/setup.sh with the DejaVu fonts): the outermost pixel rows and columns are background, each legend text is
drawn (dark pixels where it stands) and ends before its estimated extent. A one-run report with a long folder name
(its accuracy legend used to run off the image) and a report of six runs (legend in several rows) get the same
checks. Several runs without --output are refused, writing nothing."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.dom.minidom

from nopad_checks import check, failures

NOPAD = os.environ["NOPAD_BINARY"]
PLOTS = ["loss.svg", "accuracy.svg", "eval_loss.svg", "throughput.svg", "learning_rate.svg", "grad_norm.svg"]

try:
    from PIL import Image
except ImportError as e:
    sys.exit(f"test_report_plots: Pillow is missing ({e}): run scripts/setup.sh (pip install pillow)")
RSVG = shutil.which("rsvg-convert")
if RSVG is None:
    sys.exit("test_report_plots: rsvg-convert is missing: run scripts/setup.sh (Debian package librsvg2-bin)")


def text_width(text, font_px):
    """The upper bound of a text's width that report.cpp's svg_text_width() defines, per class of character."""
    em = 0.0
    for ch in text:
        if ord(ch) >= 0x80:
            em += 1.0
        elif ch == " ":
            em += 0.33
        elif ch in "ijlI.,:;'|":
            em += 0.32
        elif ch in "frt()[]{}-/\\!":
            em += 0.42
        elif ch in "mwMW%@":
            em += 1.02
        elif ch in "+=<>~#^&":
            em += 0.86
        elif "A" <= ch <= "Z":
            em += 0.80
        else:
            em += 0.66
    return em * font_px


def write_run(path, steps, evals=True, null_loss_at=(), rate=100.0):
    """A run folder with metrics.jsonl only: `steps` training lines (8 sequences a step) and, with evals, an eval line
    every 4 steps. Returns {plot: expected point count}."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for s in range(1, steps + 1):
            loss = None if s in null_loss_at else 11.0 - 0.05 * s
            f.write(json.dumps({"step": s, "samples": 8 * s, "loss": loss, "mlm_loss": loss, "nsp_loss": 0.7,
                                "mlm_accuracy": 0.01 * s, "lr": 1e-3 * min(s, 5) / 5, "grad_norm": 2.0 + 0.1 * s,
                                "seq_per_s": rate + s, "tokens_per_s": 64 * (rate + s), "elapsed_s": 0.1 * s}) + "\n")
            if evals and s % 4 == 0:
                f.write(json.dumps({"eval": True, "step": s, "samples": 8 * s, "mlm_accuracy": 0.02 * s,
                                    "nsp_accuracy": 0.5, "eval_loss": 11.5 - 0.04 * s, "mlm_loss": 10.8 - 0.04 * s,
                                    "nsp_loss": 0.7, "eval_samples": 32}) + "\n")
    n_evals = steps // 4 if evals else 0
    return {"loss.svg": steps - len(null_loss_at), "accuracy.svg": n_evals, "eval_loss.svg": n_evals,
            "throughput.svg": steps, "learning_rate.svg": steps, "grad_norm.svg": steps}


def texts_of(doc):
    """(element, text, x, y, anchor, font_px, rotated) of every <text> of an SVG."""
    root = doc.documentElement
    default_px = float(root.getAttribute("font-size") or 16)
    out = []
    for t in doc.getElementsByTagName("text"):
        s = "".join(n.data for n in t.childNodes if n.nodeType == n.TEXT_NODE)
        px = float(t.getAttribute("font-size") or default_px)
        anchor = t.getAttribute("text-anchor") or "start"
        m = re.match(r"translate\(([-\d.e]+),([-\d.e]+)\) rotate\(-90\)", t.getAttribute("transform"))
        if m:
            out.append((t, s, float(m.group(1)), float(m.group(2)), anchor, px, True))
        else:
            out.append((t, s, float(t.getAttribute("x")), float(t.getAttribute("y")), anchor, px, False))
    return out


def text_box(text, x, y, anchor, px, rotated):
    """(left, top, right, bottom) of a text: ascent 0.8 em above the baseline, descent 0.25 em below it."""
    w = text_width(text, px)
    start = {"start": 0.0, "middle": -w / 2, "end": -w}[anchor]
    if rotated:  # rotate(-90) about (x, y): the text runs upwards from y - start
        return (x - 0.8 * px, y - start - w, x + 0.25 * px, y - start)
    return (x + start, y - 0.8 * px, x + start + w, y + 0.25 * px)


def check_svg(path, labels, counts, what):
    """Structure and pixels of one plot: labels are the expected legend texts, counts the polylines' point counts."""
    doc = xml.dom.minidom.parse(path)
    root = doc.documentElement
    vb = [float(v) for v in root.getAttribute("viewBox").split()]
    W, H = vb[2], vb[3]
    check(vb[:2] == [0, 0] and float(root.getAttribute("width")) == W and float(root.getAttribute("height")) == H,
          f"{what}: the viewBox is the canvas: {vb}")
    polys = doc.getElementsByTagName("polyline")
    got = [len(p.getAttribute("points").split()) for p in polys]
    check(got == counts, f"{what}: points per polyline {got}, expected {counts}")
    texts = texts_of(doc)
    legend = [t for t in texts if t[0].getAttribute("class") == "legend"]
    check([t[1] for t in legend] == labels, f"{what}: legend {[t[1] for t in legend]}, expected {labels}")
    for _, s, x, y, anchor, px, rot in texts:
        l, t, r, b = text_box(s, x, y, anchor, px, rot)
        check(l >= 0 and t >= 0 and r <= W and b <= H,
              f"{what}: text {s!r} extends to ({l:.1f}, {t:.1f}, {r:.1f}, {b:.1f}) outside 0 0 {W} {H}")

    png = path[:-4] + ".png"
    r = subprocess.run([RSVG, "-o", png, path], capture_output=True, text=True)
    check(r.returncode == 0, f"{what}: rsvg-convert: {r.stderr}")
    if r.returncode != 0:
        return
    img = Image.open(png).convert("RGB")
    check(img.size == (round(W), round(H)), f"{what}: the PNG is {img.size}, the SVG {W} x {H}")
    px_ = img.load()
    w, h = img.size

    def light(p):
        return min(p) >= 245

    border = [(x, y) for x in range(w) for y in (0, 1, h - 2, h - 1)] + \
             [(x, y) for y in range(h) for x in (0, 1, w - 2, w - 1)]
    cut = [xy for xy in border if not light(px_[xy])]
    check(not cut, f"{what}: drawn pixels at the image border (something cut off), e.g. {cut[:5]}")
    # Each legend text: dark pixels from where it starts, none past its estimated end (up to the next entry).
    for i, (_, s, x, y, _, fpx, _) in enumerate(legend):
        est_end = x + text_width(s, fpx)
        nxt = [t[2] - 26 for t in legend[i + 1:] if t[3] == y]  # the next entry's swatch on the same row
        right = min(nxt[0] if nxt else w, w)
        ink = [cx for cx in range(max(0, int(x) - 2), int(right))
               for cy in range(max(0, int(y - 13)), min(h, int(y + 5))) if min(px_[cx, cy]) < 140]
        check(ink, f"{what}: legend text {s!r} is not drawn")
        if ink:
            check(min(ink) >= x - 2 and max(ink) <= est_end + 1,
                  f"{what}: legend text {s!r} drawn over columns {min(ink)}-{max(ink)}, estimated {x:.0f}-"
                  f"{est_end:.0f}")


def report(runs, out=None):
    cmd = [NOPAD, "report", *runs] + (["--output", out] if out else [])
    return subprocess.run(cmd, capture_output=True, text=True)


def main():
    tmp = tempfile.mkdtemp(prefix="nopad-report-plots-")
    try:
        sweep = os.path.join(tmp, "sweep")
        a = os.path.join(sweep, "bert-tiny-lr0.001-batch4096-warmup1000-seed1234-WWWMMM-with-a-long-descriptive-name")
        b = os.path.join(sweep, "second_run-überlänge-lr0.002-%@-and-its-own-rather-long-name")
        want_a = write_run(a, 24, null_loss_at=(7,))
        want_b = write_run(b, 16, evals=True, rate=150.0)
        out = os.path.join(tmp, "out")
        r = report([a, b], out)
        check(r.returncode == 0, f"report of two runs: {r.returncode} {r.stderr}")
        names = [os.path.basename(a), os.path.basename(b)]
        for plot in PLOTS:
            check_svg(os.path.join(out, plot), names, [want_a[plot], want_b[plot]], f"two runs, {plot}")
        md = open(os.path.join(out, "report.md")).read()
        rows = [l for l in md.splitlines() if l.startswith("| ") and not l.startswith("| run |")]
        check(len(rows) == 2 and rows[0].startswith(f"| {names[0]} | {a} | 24 (24) | 192 |")
              and rows[1].startswith(f"| {names[1]} | {b} | 16 (16) | 128 |"), f"one table row per run: {rows}")
        check("(1 not finite)" in rows[0] and "| 6 |" in rows[0], f"run a's non-finite loss and 6 evals: {rows[0]}")
        check(md in r.stdout, "report.md is the printed summary")

        # Two folders of one name, a run without evaluations, and the same run twice.
        x, y = os.path.join(tmp, "x", "run"), os.path.join(tmp, "y", "run")
        want_x = write_run(x, 8, evals=False)
        want_y = write_run(y, 12)
        out2 = os.path.join(tmp, "out2")
        r = report([x, y + "/", x], out2)
        check(r.returncode == 0, f"report of x/run, y/run/, x/run: {r.stderr}")
        for plot in PLOTS:
            labels = ["x/run (1)", "y/run", "x/run (2)"]
            if plot in ("accuracy.svg", "eval_loss.svg"):
                labels = [labels[0] + " (no data)", labels[1], labels[2] + " (no data)"]
            check_svg(os.path.join(out2, plot), labels, [want_x[plot], want_y[plot], want_x[plot]],
                      f"same-named runs, {plot}")

        # Six runs: the legend wraps into rows, the canvas grows to hold them.
        six = [os.path.join(tmp, "six", f"run-{i}-with-a-name-long-enough-to-wrap-the-legend") for i in range(6)]
        wants = [write_run(p, 8 + i, rate=100.0 + 10 * i) for i, p in enumerate(six)]
        out3 = os.path.join(tmp, "out3")
        r = report(six, out3)
        check(r.returncode == 0, f"report of six runs: {r.stderr}")
        for plot in PLOTS:
            check_svg(os.path.join(out3, plot), [os.path.basename(p) for p in six], [w[plot] for w in wants],
                      f"six runs, {plot}")
        doc = xml.dom.minidom.parse(os.path.join(out3, "loss.svg"))
        rows_y = {t[3] for t in texts_of(doc) if t[0].getAttribute("class") == "legend"}
        check(len(rows_y) > 1, f"six long names take several legend rows: {sorted(rows_y)}")

        # One run, as `nopad report RUN`: its own series names, the report in RUN/report.
        r = report([a])
        check(r.returncode == 0, f"report of one run: {r.stderr}")
        one = {"loss.svg": ["training loss"],
               "accuracy.svg": ["masked-LM accuracy (training batches)", "masked-LM accuracy (eval)"],
               "eval_loss.svg": ["eval loss"], "throughput.svg": ["sequences/s"],
               "learning_rate.svg": ["learning rate"], "grad_norm.svg": ["gradient norm"]}
        for plot in PLOTS:
            counts = [24, want_a[plot]] if plot == "accuracy.svg" else [want_a[plot]]
            check_svg(os.path.join(a, "report", plot), one[plot], counts, f"one run, {plot}")

        # Several runs need --output: refused before anything is written.
        r = report([x, y])
        err = [l for l in r.stderr.splitlines() if l.strip()]
        check(r.returncode == 1 and len(err) == 1 and "--output" in err[0],
              f"two runs without --output: one error line, exit 1: {r.returncode} {r.stderr!r}")
        check(not os.path.exists(os.path.join(x, "report")) and not os.path.exists(os.path.join(y, "report")),
              "nothing written without --output")
        # A missing run among several: one error naming it, nothing written.
        out4 = os.path.join(tmp, "out4")
        r = report([x, os.path.join(tmp, "missing")], out4)
        check(r.returncode == 1 and "missing" in r.stderr and "metrics.jsonl cannot be read" in r.stderr
              and not os.path.exists(out4), f"a missing run among two: {r.returncode} {r.stderr!r}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} failure(s)")
        sys.exit(1)
    print("test_report_plots: all checks passed")


if __name__ == "__main__":
    main()
