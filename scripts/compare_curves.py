#!/usr/bin/env python3
"""Compares the training-loss curves of two nopad runs (metrics.jsonl with a line per step, log.interval_steps = 1)
made on the same data, seed and config, e.g. the GPU (bf16) and CPU (fp32) runs of scripts/curve.sh.

Prints a markdown table of the mean loss over windows of steps for both runs, their difference, and the step-to-step
noise of each window (the standard deviation of the per-step losses around a straight-line fit of the window, over
sqrt of the window length: the standard error of the window mean). The curves agree "within noise" when every
window's difference is within 3 combined standard errors. Optionally writes an SVG plot (no plotting package
needed). Exit status 0 when they agree, 1 when not, 2 on bad input.

  python3 scripts/compare_curves.py A/metrics.jsonl B/metrics.jsonl --names gpu cpu --window 25 --svg curves.svg
"""
import argparse
import json
import math
import sys


def read_losses(path):
    losses = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                j = json.loads(line)
            except ValueError:
                sys.exit(f"{path}:{n}: not a JSON line")
            if "loss" in j and "step" in j and not j.get("eval"):
                losses[int(j["step"])] = float(j["loss"])
    if not losses:
        sys.exit(f"{path}: no per-step loss lines (train with log.interval_steps = 1)")
    return losses


def window_stats(values):
    """Mean and standard error of the mean around a linear trend (the curve falls inside a window)."""
    n = len(values)
    mean = sum(values) / n
    if n < 3:
        return mean, float("nan")
    xs = range(n)
    xm = (n - 1) / 2
    sxx = sum((x - xm) ** 2 for x in xs)
    slope = sum((x - xm) * (v - mean) for x, v in zip(xs, values)) / sxx
    resid = [v - (mean + slope * (x - xm)) for x, v in zip(xs, values)]
    sd = math.sqrt(sum(r * r for r in resid) / (n - 2))
    return mean, sd / math.sqrt(n)


def svg(path, runs, names, window):
    W, H, pad = 720, 420, 50
    steps = sorted(set().union(*[r.keys() for r in runs]))
    lo = min(min(r.values()) for r in runs)
    hi = max(max(r.values()) for r in runs)
    sx = lambda s: pad + (s - steps[0]) / max(1, steps[-1] - steps[0]) * (W - 2 * pad)
    sy = lambda v: H - pad - (v - lo) / max(1e-9, hi - lo) * (H - 2 * pad)
    colors = ["#d62728", "#1f77b4", "#2ca02c", "#ff7f0e"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<line x1="{pad}" y1="{H-pad}" x2="{W-pad}" y2="{H-pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{H-pad}" stroke="black"/>',
           f'<text x="{W/2}" y="{H-12}" text-anchor="middle">step</text>',
           f'<text x="14" y="{H/2}" transform="rotate(-90 14 {H/2})" text-anchor="middle">training loss</text>']
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        out.append(f'<text x="{pad-6}" y="{sy(v)+4:.1f}" text-anchor="end">{v:.2f}</text>')
        s = steps[0] + (steps[-1] - steps[0]) * k / 4
        out.append(f'<text x="{sx(s):.1f}" y="{H-pad+16}" text-anchor="middle">{s:.0f}</text>')
    for i, (r, name) in enumerate(zip(runs, names)):
        c = colors[i % len(colors)]
        pts = " ".join(f"{sx(s):.1f},{sy(v):.1f}" for s, v in sorted(r.items()))
        out.append(f'<polyline fill="none" stroke="{c}" stroke-opacity="0.35" stroke-width="1" points="{pts}"/>')
        ks = sorted(r)
        means = [(sum(ks[j:j + window]) / len(ks[j:j + window]), sum(r[s] for s in ks[j:j + window]) / len(ks[j:j + window]))
                 for j in range(0, len(ks), window)]
        pts = " ".join(f"{sx(s):.1f},{sy(v):.1f}" for s, v in means)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2.5" points="{pts}"/>')
        out.append(f'<text x="{W-pad-150}" y="{pad+18*i}" fill="{c}">{name} (thin: per step, thick: mean of {window})</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--names", nargs=2, default=["a", "b"])
    p.add_argument("--window", type=int, default=25)
    p.add_argument("--svg", default=None)
    args = p.parse_args()
    if args.window < 3:
        sys.exit("--window must be at least 3")
    a, b = read_losses(args.a), read_losses(args.b)
    common = sorted(set(a) & set(b))
    if len(common) < args.window:
        print(f"only {len(common)} common steps", file=sys.stderr)
        sys.exit(2)
    na, nb = args.names
    print(f"| steps | {na} mean loss | {nb} mean loss | difference | noise (combined s.e.) | within 3 s.e. |")
    print("|---|---|---|---|---|---|")
    ok = True
    worst = 0.0
    for j in range(0, len(common) - args.window + 1, args.window):
        w = common[j:j + args.window]
        ma, ea = window_stats([a[s] for s in w])
        mb, eb = window_stats([b[s] for s in w])
        se = math.sqrt(ea * ea + eb * eb)
        d = ma - mb
        good = abs(d) <= 3 * se
        ok &= good
        worst = max(worst, abs(d) / se if se > 0 else float("inf"))
        print(f"| {w[0]}-{w[-1]} | {ma:.4f} | {mb:.4f} | {d:+.4f} | {se:.4f} | {'yes' if good else 'NO'} |")
    first, last = common[0], common[-1]
    print(f"\nstep {first}: {na} {a[first]:.4f}, {nb} {b[first]:.4f}; step {last}: {na} {a[last]:.4f}, "
          f"{nb} {b[last]:.4f}; largest |difference| / s.e. = {worst:.2f}; "
          f"{'the curves agree within noise' if ok else 'the curves DIFFER beyond noise'}")
    if args.svg:
        svg(args.svg, [a, b], args.names, args.window)
        print(f"wrote {args.svg}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
