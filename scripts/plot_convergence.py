"""Convergence comparison of nopad and its PyTorch twin from their metrics.jsonl files (same format on both sides).

    python3 scripts/plot_convergence.py nopad1=A.jsonl nopad2=B.jsonl torch1=C.jsonl torch2=D.jsonl \
        [--resume E.jsonl --resume-of nopad1] [--svg curves.svg] [--json results.json]

A run is NAME=PATH; its system is NAME without trailing digits (nopad, torch). Prints (markdown):
  * masked-LM accuracy on the held-out set at every evaluation (samples seen) for every run;
  * agreement: at each evaluation the gap between the systems' mean accuracies and the seed-to-seed differences
    within each system; sigma, the run-to-run standard deviation pooled from those differences (a difference of two
    runs has variance 2 sigma^2), is also the standard deviation of the gap of two means of two runs. Verdict over
    the second half of the evaluations: the systems agree when the mean gap there is within 2 sigma;
  * speed: wall-clock (elapsed_s of the last training line), median seq/s of the training lines, the throughput
    ratio of the systems (nopad / torch, means of the runs' medians);
  * wall-clock to a common accuracy (the lowest final accuracy of all runs): the first time each run's curve
    reaches it (linear between evaluations; time at a step interpolated from the training lines), and the ratio
    torch / nopad beside the throughput ratio, also counted from each run's first training line (without start-up
    and torch.compile's first steps);
  * resume: the resumed run's accuracies after its checkpoint against the full run's at the same samples; it
    continues the curve when the largest difference is within the seed-to-seed difference of its system (or 0.002).
--svg draws accuracy against samples and against wall-clock time (two panels, one SVG); --json writes the numbers.
Pure Python (no plotting library).
"""
import argparse
import json
import math
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import nopad_twin  # noqa: E402

COLORS = {"nopad": ["#1f5fbf", "#6f9fdf", "#0b3b80"], "torch": ["#d9650b", "#f0a35e", "#8a3c00"]}
RESUME_COLOR = "#2a9d3a"


class Run:
    def __init__(self, name, path):
        self.name, self.path = name, path
        self.system = re.sub(r"\d+$", "", name)
        self.steps, self.evals = nopad_twin.read_metrics(path)
        self.acc = {e["samples"]: e["mlm_accuracy"] for e in self.evals}

    def elapsed_at(self, samples):
        """Wall-clock at a sample count, linear between training lines (0 at 0 samples)."""
        pts = [(0, 0.0)] + [(s["samples"], s["elapsed_s"]) for s in self.steps]
        for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
            if s0 <= samples <= s1:
                return t0 + (t1 - t0) * (samples - s0) / (s1 - s0) if s1 > s0 else t1
        return pts[-1][1]

    def wall_s(self):
        return self.steps[-1]["elapsed_s"] if self.steps else float("nan")

    def median_seq_per_s(self):
        v = [s["seq_per_s"] for s in self.steps if s.get("seq_per_s")]
        return statistics.median(v) if v else float("nan")

    def median_tokens_per_s(self):
        v = [s["tokens_per_s"] for s in self.steps if s.get("tokens_per_s")]
        return statistics.median(v) if v else float("nan")

    def samples_to(self, target):
        """Samples at which the eval curve first reaches target (linear between evaluations), or None."""
        pts = sorted(self.acc.items())
        prev = (0, 0.0)
        for s, a in pts:
            if a >= target:
                s0, a0 = prev
                return s0 + (s - s0) * (target - a0) / (a - a0) if a > a0 else s
            prev = (s, a)
        return None


def fmt(x, spec=".4f"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def analyse(runs, resume=None, resume_of=None, resume_after=None):
    out = {"points": [], "runs": {}}
    systems = sorted({r.system for r in runs})
    by_sys = {s: [r for r in runs if r.system == s] for s in systems}
    samples = sorted({s for r in runs for s in r.acc})
    for s in samples:
        p = {"samples": s, "acc": {r.name: r.acc.get(s) for r in runs}}
        for sysname, rs in by_sys.items():
            vals = [r.acc[s] for r in rs if s in r.acc]
            p[sysname + "_mean"] = statistics.fmean(vals) if vals else None
            p[sysname + "_spread"] = (max(vals) - min(vals)) if len(vals) >= 2 else None
        out["points"].append(p)
    # Agreement of nopad and torch.
    if "nopad" in by_sys and "torch" in by_sys:
        full = [p for p in out["points"] if p["nopad_mean"] is not None and p["torch_mean"] is not None]
        for p in full:
            p["gap"] = p["nopad_mean"] - p["torch_mean"]
        late = full[len(full) // 2:]
        spreads = [p[k] for p in late for k in ("nopad_spread", "torch_spread") if p[k] is not None]
        if late and spreads:
            sigma = math.sqrt(statistics.fmean([d * d for d in spreads]) / 2)
            mean_gap = statistics.fmean([p["gap"] for p in late])
            out["agreement"] = {"points": len(late), "from_samples": late[0]["samples"], "mean_gap": mean_gap,
                                "max_abs_gap": max(abs(p["gap"]) for p in late), "sigma": sigma,
                                "agree": abs(mean_gap) <= 2 * sigma}
    # Speed and time to a common accuracy.
    finals = [r.evals[-1]["mlm_accuracy"] for r in runs if r.evals]
    target = min(finals) if finals else None
    out["target_accuracy"] = target
    for r in runs:
        s = r.samples_to(target) if target is not None else None
        out["runs"][r.name] = {"system": r.system, "steps": r.steps[-1]["step"] if r.steps else 0,
                               "samples": r.steps[-1]["samples"] if r.steps else 0, "wall_s": r.wall_s(),
                               "median_seq_per_s": r.median_seq_per_s(), "median_tokens_per_s": r.median_tokens_per_s(),
                               "final_accuracy": r.evals[-1]["mlm_accuracy"] if r.evals else None,
                               "samples_to_target": s, "seconds_to_target": r.elapsed_at(s) if s is not None else None,
                               # from the first training line on: without start-up (and torch.compile's first steps)
                               "steady_seconds_to_target": (r.elapsed_at(s) - r.steps[0]["elapsed_s"]
                                                            if s is not None and r.steps else None)}
    per_sys = {}
    for sysname, rs in by_sys.items():
        info = [out["runs"][r.name] for r in rs]
        per_sys[sysname] = {"median_seq_per_s": statistics.fmean([i["median_seq_per_s"] for i in info]),
                            "wall_s": statistics.fmean([i["wall_s"] for i in info])}
        for key in ("seconds_to_target", "steady_seconds_to_target"):
            t = [i[key] for i in info if i[key] is not None]
            per_sys[sysname][key] = statistics.fmean(t) if len(t) == len(info) else None
    out["systems"] = per_sys
    if "nopad" in per_sys and "torch" in per_sys:
        n, t = per_sys["nopad"], per_sys["torch"]
        out["throughput_ratio"] = n["median_seq_per_s"] / t["median_seq_per_s"]
        for key in ("seconds_to_target", "steady_seconds_to_target"):
            out[key.replace("seconds_to_target", "time_to_target_ratio")] = (
                t[key] / n[key] if n[key] and t[key] else None)
    # Resume.
    if resume is not None and resume_of is not None:
        base = next(r for r in runs if r.name == resume_of)
        start = max((s["step"] for s in resume.steps), default=0)
        ckpt_samples = resume_after if resume_after is not None else resume_checkpoint_samples(resume, base)
        common = [s for s in sorted(resume.acc) if s in base.acc and s > ckpt_samples]
        diffs = [resume.acc[s] - base.acc[s] for s in common]
        same_sys = [p[base.system + "_spread"] for p in out["points"]
                    if p["samples"] in common and p.get(base.system + "_spread") is not None]
        noise = max(same_sys) if same_sys else None
        bound = max(0.002, noise or 0.0)
        out["resume"] = {"of": resume_of, "after_samples": ckpt_samples, "points": len(common),
                         "max_abs_diff": max((abs(d) for d in diffs), default=None), "seed_spread": noise,
                         "bound": bound, "last_step": start,
                         "continues": bool(diffs) and max(abs(d) for d in diffs) <= bound}
    return out


def resume_checkpoint_samples(resume, base):
    """Samples of the checkpoint a resumed run started from: where its training lines stop matching the full run's
    (the lines before it are the full run's own, kept by nopad's --resume)."""
    base_lines = {s["step"]: s for s in base.steps}
    last_same = 0
    for s in resume.steps:
        b = base_lines.get(s["step"])
        if b is not None and b.get("elapsed_s") == s.get("elapsed_s") and b.get("loss") == s.get("loss"):
            last_same = s["samples"]
        else:
            break
    return last_same


def report(runs, res, resume=None):
    L = []
    names = [r.name for r in runs] + ([f"resume({res['resume']['of']})"] if resume is not None and "resume" in res
                                      else [])
    L.append("## Held-out masked-LM accuracy")
    L.append("")
    L.append("| samples | " + " | ".join(names) + " | nopad mean - torch mean | nopad seeds | torch seeds |")
    L.append("|---" * (len(names) + 4) + "|")
    for p in res["points"]:
        cells = [fmt(p["acc"][r.name]) for r in runs]
        if resume is not None and "resume" in res:
            cells.append(fmt(resume.acc.get(p["samples"]) if p["samples"] > res["resume"]["after_samples"] else None))
        L.append(f"| {p['samples']} | " + " | ".join(cells) + f" | {fmt(p.get('gap'), '+.4f')} | "
                 f"{fmt(p.get('nopad_spread'))} | {fmt(p.get('torch_spread'))} |")
    L.append("")
    if "agreement" in res:
        a = res["agreement"]
        L.append(f"Agreement over the last {a['points']} evaluations (from {a['from_samples']} samples): mean gap "
                 f"nopad - torch {a['mean_gap']:+.4f}, largest {a['max_abs_gap']:.4f}; run-to-run sigma {a['sigma']:.4f} "
                 f"(from the seed-to-seed differences): " +
                 ("AGREE within run-to-run noise (|mean gap| <= 2 sigma)" if a["agree"] else
                  "DIFFER (|mean gap| > 2 sigma)"))
        L.append("")
    L.append("## Speed and wall-clock to a common accuracy")
    L.append("")
    tgt = res["target_accuracy"]
    L.append(f"Common accuracy: {fmt(tgt)} (the lowest final accuracy of the runs).")
    L.append("")
    L.append("| run | steps | samples | wall s | median seq/s | median tokens/s | final accuracy | samples to common | "
             "s to common | s to common after the first line |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in res["runs"].items():
        L.append(f"| {name} | {r['steps']} | {r['samples']} | {fmt(r['wall_s'], '.1f')} | "
                 f"{fmt(r['median_seq_per_s'], '.0f')} | {fmt(r['median_tokens_per_s'], '.0f')} | "
                 f"{fmt(r['final_accuracy'])} | {fmt(r['samples_to_target'], '.0f')} | "
                 f"{fmt(r['seconds_to_target'], '.1f')} | {fmt(r['steady_seconds_to_target'], '.1f')} |")
    L.append("")
    if "throughput_ratio" in res:
        L.append(f"Throughput nopad / torch: {res['throughput_ratio']:.3f}x; wall-clock to {fmt(tgt)} torch / nopad: "
                 f"{fmt(res['time_to_target_ratio'], '.3f')}x ({fmt(res['steady_time_to_target_ratio'], '.3f')}x "
                 "from the first training line on, i.e. without start-up and compilation)")
        L.append("")
    if "resume" in res:
        r = res["resume"]
        L.append(f"## Resume\n\nRun resumed after {r['after_samples']} samples vs {r['of']} at the {r['points']} later "
                 f"evaluations: largest accuracy difference {fmt(r['max_abs_diff'])}, seed-to-seed difference "
                 f"{fmt(r['seed_spread'])}: " + ("CONTINUES the same curve" if r["continues"] else
                                                 f"DOES NOT continue the curve (bound {r['bound']:.4f})"))
        L.append("")
    return "\n".join(L)


def nice_step(vmax, n=5):
    """A round tick step (1, 2, 2.5 or 5 x 10^k) giving about n ticks up to vmax."""
    raw = max(vmax, 1e-12) / n
    k = 10 ** math.floor(math.log10(raw))
    return next(m * k for m in (1, 2, 2.5, 5, 10) if m * k >= raw)


def svg(path, runs, resume=None, resume_of=None):
    W, H, pad_l, pad_r, pad_t, pad_b, gap = 980, 420, 60, 20, 40, 50, 60
    pw = (W - pad_l - pad_r - gap) / 2
    ph = H - pad_t - pad_b
    series = []
    for r in runs:
        same = [x.name for x in runs if x.system == r.system]
        series.append((r, COLORS.get(r.system, ["#555555"] * 3)[same.index(r.name) % 3], ""))
    if resume is not None:
        series.append((resume, RESUME_COLOR, ' stroke-dasharray="6,4"'))
    accs = [a for r, _, _ in series for a in r.acc.values()] or [0, 1]
    y0, y1 = 0.0, max(accs) * 1.08 or 1.0
    xmax_s = max([max(r.acc) for r, _, _ in series if r.acc] or [1])
    xmax_t = max([r.wall_s() for r, _, _ in series if r.steps] or [1])
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>']
    for panel, (xlabel, xmax) in enumerate((("training samples", xmax_s), ("wall-clock seconds", xmax_t))):
        x0 = pad_l + panel * (pw + gap)
        out.append(f'<rect x="{x0:.1f}" y="{pad_t}" width="{pw:.1f}" height="{ph}" fill="none" stroke="#999"/>')
        out.append(f'<text x="{x0 + pw / 2:.1f}" y="{H - 12}" text-anchor="middle">{xlabel}</text>')
        xs, ys = nice_step(xmax), nice_step(y1 - y0)
        for k in range(int(xmax / xs) + 1):
            xv = k * xs
            label = f"{xv / 1000:g}k" if panel == 0 else f"{xv:g}"
            out.append(f'<text x="{x0 + pw * xv / xmax:.1f}" y="{pad_t + ph + 16}" text-anchor="middle">{label}</text>')
        for k in range(int((y1 - y0) / ys) + 1):
            yp = pad_t + ph - ph * k * ys / (y1 - y0)
            out.append(f'<text x="{x0 - 6:.1f}" y="{yp + 4:.1f}" text-anchor="end">{y0 + k * ys:g}</text>')
            out.append(f'<line x1="{x0:.1f}" x2="{x0 + pw:.1f}" y1="{yp:.1f}" y2="{yp:.1f}" stroke="#eee"/>')
        for r, color, dash in series:
            pts = []
            for s, a in sorted(r.acc.items()):
                xv = s if panel == 0 else r.elapsed_at(s)
                pts.append(f"{x0 + pw * xv / xmax:.1f},{pad_t + ph - ph * (a - y0) / (y1 - y0):.1f}")
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.8"{dash} points="{" ".join(pts)}"/>')
    out.append(f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="14">held-out masked-LM accuracy: nopad vs '
               f'PyTorch twin</text>')
    for k, (r, color, dash) in enumerate(series):
        label = r.name if r is not resume else f"{resume_of} resumed"
        y = pad_t + ph - 10 - 16 * (len(series) - 1 - k)  # bottom-right of the first panel, under the curves
        lx = pad_l + pw - 140
        out.append(f'<line x1="{lx}" x2="{lx + 24}" y1="{y - 4}" y2="{y - 4}" stroke="{color}" '
                   f'stroke-width="2"{dash}/>')
        out.append(f'<text x="{lx + 30}" y="{y}">{label}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="NAME=metrics.jsonl (NAME: system + seed, e.g. nopad1)")
    p.add_argument("--resume", help="metrics.jsonl of a run resumed from a checkpoint")
    p.add_argument("--resume-of", help="the run it was resumed from (NAME)")
    p.add_argument("--resume-after", type=int, help="samples of the checkpoint it resumed from (default: where its "
                   "training lines stop being the full run's)")
    p.add_argument("--svg")
    p.add_argument("--json")
    a = p.parse_args(argv)
    runs = []
    for spec in a.runs:
        name, _, path = spec.partition("=")
        if not path:
            sys.exit(f"error: expected NAME=PATH, got {spec}")
        if not os.path.exists(path):
            print(f"(no metrics for {name}: {path} is missing)")
            continue
        runs.append(Run(name, path))
    if not runs:
        sys.exit("error: no metrics to compare")
    resume = None
    if a.resume and os.path.exists(a.resume):
        if not any(r.name == a.resume_of for r in runs):
            sys.exit(f"error: --resume-of {a.resume_of} is not among the runs")
        resume = Run(a.resume_of + "-resume", a.resume)
    res = analyse(runs, resume, a.resume_of if resume is not None else None, a.resume_after)
    print(report(runs, res, resume))
    if a.svg:
        svg(a.svg, runs, resume, a.resume_of)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
