"""Plots of docs/accuracy/: mask and attention-matrix errors against s, with fitted exponents.

Reads masks.json and attention.json (written by `error_decay --masks` and `error_decay
--attention`, see regenerate.sh) from this directory and writes masks.png, attention.png and
exponents.md (the least-squares slope of log(error) against log(s) over s >= 3, per slope, and the
timings of timing.json, `error_decay --time`).

Usage: /usr/bin/python3 docs/accuracy/plot.py [directory]
"""

import glob
import json
import math
import os
import sys

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit("plot.py: matplotlib is missing; install it with: apt-get install python3-matplotlib")

FIT_FROM = 3


def fit(points, key):
    """Least-squares slope of log(error) against log(s) for s >= FIT_FROM (None below 2 points);
    spectral norms where Lanczos stopped before its tolerance (lower bounds) are left out."""
    used = [p for p in points if p["s"] >= FIT_FROM and p[key] > 0
            and (key != "spectral" or p.get("converged", True))]
    xs = [math.log(p["s"]) for p in used]
    ys = [math.log(p[key]) for p in used]
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def slope_label(m):
    return f"1/{round(1 / m)}"


def masks(directory, lines):
    # masks.json, then the longer rows of masks-*.json (the points both hold are the same draws and
    # the same values: the first one is kept).
    points, seen = [], set()
    extra = glob.glob(os.path.join(directory, "masks-*.json"))
    for name in ["masks.json"] + sorted(os.path.basename(path) for path in extra):
        with open(os.path.join(directory, name)) as f:
            for p in json.load(f)["points"]:
                if (p["n"], p["slope"], p["s"]) not in seen:
                    seen.add((p["n"], p["slope"], p["s"]))
                    points.append(p)
    ns = sorted({p["n"] for p in points})
    slopes = sorted({p["slope"] for p in points}, reverse=True)
    colors = plt.cm.viridis([i / max(1, len(slopes) - 1) for i in range(len(slopes))])
    fig, axes = plt.subplots(2, len(ns), figsize=(4 * len(ns), 7), sharex=True, squeeze=False)
    exponents = {}
    for col, n in enumerate(ns):
        for row, key in enumerate(("spectral", "max")):
            ax = axes[row][col]
            for color, m in zip(colors, slopes):
                curve = sorted((p for p in points if p["n"] == n and p["slope"] == m),
                               key=lambda p: p["s"])
                if not curve:
                    continue
                exponent = fit(curve, key)
                exponents[(key, n, m)] = exponent
                label = slope_label(m) + ("" if exponent is None else f" ({exponent:+.2f})")
                ax.loglog([p["s"] for p in curve], [p[key] for p in curve], "o-", color=color,
                          ms=3, label=label)
            ax.set_title(f"{key} norm, n = {n:.0e}".replace("e+0", "e"))
            ax.grid(True, which="major", alpha=0.3)
            if row == 1:
                ax.set_xlabel("samples s")
            if col == 0:
                ax.set_ylabel("||K_hat - K||" + ("_2" if key == "spectral" else "_max"))
            ax.legend(fontsize=6, title="slope (exponent)", title_fontsize=6)
    fig.suptitle("Mask error of s random block partitions against the ALiBi factor matrix "
                 f"(matrix-free; exponent fitted over s >= {FIT_FROM})")
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "masks.png"), dpi=110)

    lines.append(f"Mask errors: exponent of s (least squares over s >= {FIT_FROM}, converged "
                 "spectral norms only), per slope and n; spectral / max; — where fewer than two "
                 "points remain.\n")
    lines.append("| slope | " + " | ".join(f"n = {n:.0e}".replace("e+0", "e") for n in ns) + " |")
    lines.append("|---" * (len(ns) + 1) + "|")
    for m in slopes:
        cells = []
        for n in ns:
            a, b = exponents.get(("spectral", n, m)), exponents.get(("max", n, m))
            cells.append(" / ".join("—" if v is None else f"{v:+.2f}" for v in (a, b)))
        lines.append(f"| {slope_label(m)} | " + " | ".join(cells) + " |")
    timing_path = os.path.join(directory, "timing.json")
    if os.path.exists(timing_path):
        with open(timing_path) as f:
            timing = json.load(f)["points"]
        lines.append("\nMatrix-free timings (`error_decay --time`, the figure's Lanczos settings: "
                     "tolerance 1e-6, basis 30; one run each, one thread, wall clock on a shared "
                     "machine):\n")
        lines.append("| n | s | slope | spectral norm | time | products | converged | max norm | time |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for p in sorted(timing, key=lambda p: -p["slope"]):
            lines.append(f"| {p['n']:.0e} | {p['s']} | {slope_label(p['slope'])} | "
                         f"{p['spectral']:.4g} | {p['spectral_seconds']:.1f} s | {p['products']} | "
                         f"{'yes' if p['converged'] else 'no'} | {p['max']:.4g} | "
                         f"{p['max_seconds']:.1f} s |")
    slowest = max(points, key=lambda p: p["spectral_seconds"])
    lines.append(f"\nSlowest figure point: n = {slowest['n']}, s = {slowest['s']}, "
                 f"{slowest['spectral_seconds']:.1f} s (spectral).")
    unconverged = [p for p in points if not p["converged"]]
    where = (f" ({', '.join(sorted({'s = %d' % p['s'] for p in unconverged}))})"
             if unconverged else "")
    lines.append(f"Figure points where Lanczos stopped before its tolerance (value: largest Ritz "
                 f"value, a lower bound): {len(unconverged)} of {len(points)}{where}.\n")


def attention(directory, lines):
    path = os.path.join(directory, "attention.json")
    if not os.path.exists(path):
        lines.append("(attention.json missing: no attention figure)\n")
        return
    with open(path) as f:
        data = json.load(f)
    points = data["points"]
    layers = sorted({p["layer"] for p in points})
    heads = sorted({p["head"] for p in points})
    colors = plt.cm.viridis([i / max(1, len(heads) - 1) for i in range(len(heads))])
    keys = ("spectral", "max", "frobenius")
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4.5), squeeze=False)
    exponents = {}
    for col, key in enumerate(keys):
        ax = axes[0][col]
        for layer, style in zip(layers, ("o-", "s--", "^:", "v-.")):
            for color, h in zip(colors, heads):
                curve = sorted((p for p in points if p["layer"] == layer and p["head"] == h),
                               key=lambda p: p["s"])
                exponent = fit(curve, key)
                exponents[(key, layer, h)] = exponent
                label = (f"layer {layer}, head {h} (m = {slope_label(curve[0]['slope'])})"
                         if key == "spectral" else None)
                ax.loglog([p["s"] for p in curve], [p[key] for p in curve], style, color=color,
                          ms=3, label=label)
        ax.set_title(f"{key} norm of A_plsh - A_alibi")
        ax.set_xlabel("samples s")
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].legend(fontsize=5, ncol=2)
    fig.suptitle(f"Attention matrices of the trained miniature model, n = {data['tokens']} "
                 "(solid: layer 0, dashed: layer 1)")
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "attention.png"), dpi=110)

    lines.append(f"Attention errors (n = {data['tokens']}, causal): exponent of s over s >= "
                 f"{FIT_FROM}, per head; spectral / max / Frobenius.\n")
    lines.append("| head | slope | " + " | ".join(f"layer {l}" for l in layers) + " |")
    lines.append("|---|---" + "|---" * len(layers) + "|")
    for h in heads:
        m = next(p["slope"] for p in points if p["head"] == h)
        cells = []
        for layer in layers:
            values = [exponents[(key, layer, h)] for key in keys]
            cells.append(" / ".join("—" if v is None else f"{v:+.2f}" for v in values))
        lines.append(f"| {h} | {slope_label(m)} | " + " | ".join(cells) + " |")
    checks = [p for p in points if "matrix_free" in p]
    for p in checks:
        mf = p["matrix_free"]
        lines.append(f"\nLayer {p['layer']} head {p['head']} s = {p['s']}: matrix-free spectral "
                     f"{mf['spectral']:.10g} vs dense-product Lanczos {p['spectral']:.10g}, "
                     f"max {mf['max']:.6g} vs {p['max']:.6g} ({mf['seconds']:.1f} s)")
    lines.append("")


def main():
    directory = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    lines = []
    masks(directory, lines)
    attention(directory, lines)
    with open(os.path.join(directory, "exponents.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
