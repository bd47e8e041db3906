#!/usr/bin/env python3
"""Plots of the plsh benchmarks.

Reads the Google Benchmark JSON of plsh_bench
(--benchmark_format=json --benchmark_out=FILE, or --benchmark_out_format=json) and the JSON of
plsh_accuracy (--json=FILE), and writes:

  time_vs_n.png     time per call against n (log-log), one line per method, PLSH methods at
                    one number of samples (--samples, default 20); GFLOP/s against n beside it.
                    The long-sequence families (long_fused/n/20/type, long_windowed/n/float)
                    extend the fused and windowed lines (float) and add a bfloat16 fused line;
                    exact ALiBi is measured up to its largest n and extrapolated beyond it as
                    n^2 (dashed, labelled so).
  error_vs_time.png relative error against exact ALiBi versus time per call (log-log): the
                    accuracy trade-off of each method.
  frontier.png      from plsh_frontier's JSON (--frontier): relative error against time per call
                    (log-log), one panel per input set, one curve per method family, points
                    labelled by their parameter (tolerance, s or block size).
  train_vs_n.png    from the training families' JSON (--train): time against n (log-log) of the
                    forward and of the forward then backward, one line per kernel, and the
                    forward and backward's time over n log2 n relative to the smallest n (a line
                    that rises grows faster than n log n). Top row 1 thread, processor time;
                    bottom row 2 threads, wall time (the processor time of 2 threads is the sum
                    of both).

With repetitions (--benchmark_repetitions=R) the median aggregate is used, or the median of the
repetitions when only those were written. --bench may be given several times: a benchmark found
in a later file replaces the same one of an earlier file. Needs python3 and matplotlib.
"""

import argparse
import json
import math
import os
import statistics
import sys

# Benchmark families and the accuracy methods, in plotting order.
FAMILIES = ["gemm", "gemm_tile", "regular", "exact", "windowed", "passes", "fused",
            "fused_bfloat16", "fixed_blocks"]
SAMPLED = {"passes", "fused", "fused_bfloat16"}
# Storage types of the long-sequence families: the float runs extend the float lines.
LONG_TYPES = {"float": "", "bfloat16": "_bfloat16"}
STYLE = {
    "gemm": dict(color="0.55", linestyle=":", marker="x"),
    "gemm_tile": dict(color="0.35", linestyle=":", marker="+"),
    "regular": dict(color="tab:gray", linestyle="--", marker="s"),
    "exact": dict(color="tab:red", marker="o"),
    "windowed": dict(color="tab:orange", marker="v"),
    "passes": dict(color="tab:blue", marker="^"),
    "fused": dict(color="tab:green", marker="D"),
    "fused_bfloat16": dict(color="tab:olive", marker="d", linestyle="-."),
    "fixed_blocks": dict(color="tab:purple", marker="P"),
    "fused_lhs": dict(color="tab:cyan", marker="D", linestyle="--"),
    "fused_near": dict(color="tab:olive", marker="P", linestyle="-."),
}
TIME_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def load_matplotlib():
    try:
        import matplotlib
    except ImportError:
        sys.exit(f"plot.py: matplotlib is not available to {sys.executable} (Debian: apt-get install"
                 " python3-matplotlib, then run with /usr/bin/python3; otherwise: python3 -m pip"
                 " install matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot
    return pyplot


def parse_name(run_name):
    """'fused/16384/20/real_time' -> ('fused', [16384, 20]); options such as 'min_time:0.5' and
    'real_time' are dropped."""
    parts = run_name.split("/")
    numbers = [int(part) for part in parts[1:] if part.isdigit()]
    family = parts[0]
    if family.startswith("long_"):
        # long_fused/1048576/20/bfloat16 -> fused_bfloat16; half (error only) is not plotted.
        types = [part for part in parts[1:] if part in LONG_TYPES]
        family = family[len("long_"):] + LONG_TYPES[types[0]] if types else None
    return family, numbers


def read_runs(path):
    """{run name: [entries]} from a Google Benchmark JSON file: the median aggregate alone when it
    was written, else every repetition; entries with an error are left out."""
    with open(path) as file:
        report = json.load(file)
    medians, runs = {}, {}
    for entry in report.get("benchmarks", []):
        if entry.get("error_occurred"):
            continue
        name = entry.get("run_name", entry["name"])
        if entry.get("run_type") == "aggregate":
            if entry.get("aggregate_name") == "median":
                medians[name] = [entry]
        else:
            runs.setdefault(name, []).append(entry)
    runs.update(medians)
    return runs


def read_benchmarks(paths, clock):
    """{(family, n, s or None): {"seconds": ..., "gflops": ...}} from Google Benchmark JSON files,
    later files first."""
    results = {}
    for path in paths:
        results.update(read_benchmark_file(path, clock))
    return results


def read_benchmark_file(path, clock):
    results = {}
    for run_name, runs in read_runs(path).items():
        samples = []
        for entry in runs:
            seconds = entry[clock + "_time"] * TIME_UNIT_SECONDS[entry.get("time_unit", "ns")]
            gflops = entry.get("gflops")
            if gflops is not None and clock == "cpu" and entry.get("cpu_time"):
                gflops *= entry["real_time"] / entry["cpu_time"]  # the counter is per wall second
            samples.append({"seconds": seconds, "gflops": gflops})
        sample = {
            "seconds": statistics.median(run["seconds"] for run in samples),
            "gflops": (statistics.median(run["gflops"] for run in samples)
                       if all(run["gflops"] is not None for run in samples) else None),
        }
        family, numbers = parse_name(run_name)
        if family not in STYLE or not numbers:
            continue  # other families (threads, decoding) are not part of these plots
        n = numbers[0]
        samples = numbers[1] if family in SAMPLED and len(numbers) > 1 else None
        results[(family, n, samples)] = sample
    return results


def plot_time_vs_n(pyplot, results, samples, clock, path):
    figure, (time_axes, rate_axes) = pyplot.subplots(1, 2, figsize=(12, 5))
    plotted = False
    all_lengths = set()
    exact_points = []
    for family in FAMILIES:
        wanted = samples if family in SAMPLED else None
        points = sorted((n, sample) for (name, n, s), sample in results.items()
                        if name == family and s == wanted)
        if not points:
            continue
        plotted = True
        if family in SAMPLED:
            label = f"{family} (s = {samples})"
        elif family.startswith("gemm"):
            label = f"{family} (yardstick: n x 1024 scores)"
        else:
            label = family
        lengths = [n for n, _ in points]
        all_lengths.update(lengths)
        time_axes.loglog(lengths, [1e3 * sample["seconds"] for _, sample in points],
                         label=label, **STYLE[family])
        if family == "exact":
            exact_points = points
        rates = [(n, sample["gflops"]) for n, sample in points if sample["gflops"] is not None]
        if rates:
            rate_axes.semilogx([n for n, _ in rates], [rate for _, rate in rates], label=label,
                               **STYLE[family])
    if not plotted:
        print(f"plot.py: no benchmark of the known families in the input; {path} not written",
              file=sys.stderr)
        pyplot.close(figure)
        return
    if exact_points and exact_points[-1][0] < max(all_lengths):
        # Exact ALiBi is quadratic: extrapolated from its largest measured n.
        measured_n, measured = exact_points[-1]
        lengths = [n for n in sorted(all_lengths) if n >= measured_n]
        time_axes.loglog(lengths,
                         [1e3 * measured["seconds"] * (n / measured_n) ** 2 for n in lengths],
                         color=STYLE["exact"]["color"], linestyle="--",
                         label=f"exact, extrapolated as n^2 beyond n = {measured_n}")
    for axes in (time_axes, rate_axes):
        axes.set_xticks(sorted(all_lengths))
        axes.set_xticklabels([str(n) for n in sorted(all_lengths)], rotation=30)
        axes.minorticks_off()
    time_axes.set_xlabel("sequence length n")
    time_axes.set_ylabel(f"time per call, ms ({clock} time)")
    time_axes.set_title("8 heads, d = 64, causal, float (and bfloat16 storage)")
    time_axes.grid(True, which="both", alpha=0.3)
    time_axes.legend(fontsize="small")
    rate_axes.set_xlabel("sequence length n")
    rate_axes.set_ylabel("GFLOP/s (2 (d + d_v) per computed score)")
    rate_axes.set_title("arithmetic rate")
    rate_axes.set_ylim(bottom=0)
    rate_axes.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    print(f"wrote {path}")


def plot_error_vs_time(pyplot, accuracy, clock, path):
    figure, axes = pyplot.subplots(figsize=(7, 5))
    methods = accuracy["methods"]
    # plsh_accuracy's median processor time is "median_cpu_seconds"; older files lack it.
    key = "median_cpu_seconds" if clock == "cpu" else "median_seconds"
    for family in FAMILIES + ["fused_lhs"]:
        rows = [row for row in methods if row["method"] == family]
        if not rows:
            continue
        times = [1e3 * row.get(key, row["median_seconds"]) for row in rows]
        errors = [row["relative_error"] for row in rows]
        axes.loglog(times, errors, label=family, **STYLE[family])
        for time, error, row in zip(times, errors, rows):
            if row["parameter"]:
                axes.annotate(row["parameter"], (time, error), textcoords="offset points",
                              xytext=(4, 4), fontsize="x-small")
    axes.set_xlabel(f"time per call, ms (median {'processor' if clock == 'cpu' else 'wall'} time)")
    axes.set_ylabel("relative Frobenius error vs exact ALiBi (double)")
    axes.set_title(f"n = {accuracy['n']}, {accuracy['heads']} heads, d = {accuracy['dim']}, "
                   f"{accuracy['threads']} thread(s)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    print(f"wrote {path}")


TRAIN_KERNELS = [("exact", "exact", dict(color="tab:red", marker="o")),
                 ("windowed_1e3", "windowed, certified 1e-3", dict(color="tab:orange", marker="v")),
                 ("truncated_1e3", "truncated, factor 1e-3",
                  dict(color="tab:brown", marker="<", linestyle="--")),
                 ("truncated_5e2", "truncated, factor 0.05",
                  dict(color="tab:pink", marker=">", linestyle="--")),
                 ("fused_defaults", "fused, defaults (s = 100, LHS, near field 0.05)",
                  dict(color="tab:olive", marker="P")),
                 ("fused_paper", "fused, paper (s = 20, independent)",
                  dict(color="tab:green", marker="D")),
                 ("fixed_blocks", "fixed blocks, b = 64", dict(color="tab:purple", marker="s"))]


def read_train(path):
    """{(family, kernel, n, threads): {"real": seconds, "cpu": seconds}} from the training
    families' JSON (train_forward/<kernel>/<n>/<threads>, train/...): the median aggregate when
    written, else the median of the runs."""
    results = {}
    for name, chosen in read_runs(path).items():
        parts = name.split("/")
        if len(parts) < 4 or parts[0] not in ("train", "train_forward"):
            continue
        scale = TIME_UNIT_SECONDS[chosen[0].get("time_unit", "ns")]
        results[(parts[0], parts[1], int(parts[2]), int(parts[3]))] = {
            clock: statistics.median(entry[clock + "_time"] for entry in chosen) * scale
            for clock in ("real", "cpu")}
    return results


def plot_train(pyplot, results, path):
    if not results:
        print(f"plot.py: no training benchmark in the input; {path} not written", file=sys.stderr)
        return
    figure, panels = pyplot.subplots(2, 3, figsize=(17, 10), squeeze=False)
    lengths = sorted({key[2] for key in results})
    rows = [(1, "cpu", "1 thread, processor time"), (2, "real", "2 threads, wall time")]
    for (threads, clock, row_label), axes_row in zip(rows, panels):
        for column, (family, title) in enumerate([("train_forward", "forward"),
                                                  ("train", "forward + backward")]):
            axes = axes_row[column]
            for kernel, label, style in TRAIN_KERNELS:
                points = sorted((n, sample[clock]) for (f, k, n, t), sample in results.items()
                                if f == family and k == kernel and t == threads)
                if points:
                    axes.loglog([n for n, _ in points], [1e3 * s for _, s in points],
                                label=label, **style)
            axes.set_title(f"{title}: {row_label}")
            axes.set_ylabel("time per call, ms")
        axes = axes_row[2]
        for kernel, label, style in TRAIN_KERNELS:
            points = sorted((n, sample[clock]) for (f, k, n, t), sample in results.items()
                            if f == "train" and k == kernel and t == threads)
            if points:
                base = points[0][1] / (points[0][0] * math.log2(points[0][0]))
                axes.semilogx([n for n, _ in points],
                              [s / (n * math.log2(n)) / base for n, s in points], label=label,
                              **style)
        axes.axhline(1, color="0.5", linewidth=0.8)
        axes.set_yscale("log", base=2)
        axes.set_title(f"forward + backward / (n log2 n), relative to n = {lengths[0]}")
        axes.set_ylabel(f"time / (n log2 n), relative ({row_label})")
        for axes in axes_row:
            axes.set_xticks(lengths)
            axes.set_xticklabels([str(n) for n in lengths], rotation=30)
            axes.minorticks_off()
            axes.set_xlabel("sequence length n")
            axes.grid(True, which="both", alpha=0.3)
    handles, labels = panels[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=4, fontsize="small")
    figure.suptitle("Training step's attention: 8 heads, d = 64, causal, float")
    figure.tight_layout(rect=(0, 0.05, 1, 0.97))
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    print(f"wrote {path}")


FRONTIER_SETS = ["normal", "peaked", "trained"]
FRONTIER_FAMILIES = [("exact", "exact (float)"), ("windowed", "windowed, certified tolerance"),
                     ("fused", "Positional LSH fused, independent, s"),
                     ("fused_lhs", "Positional LSH fused, Latin hypercube, s"),
                     ("fused_near", "Positional LSH fused, Latin hypercube, near field 0.05, s"),
                     ("fixed_blocks", "fixed blocks, b")]


def read_frontier(path, clock):
    """{set: {family: [(parameter, seconds, relative_error, n, dim)]}} from plsh_frontier's JSON
    (frontier/<set>/<family>/<parameter>): the median aggregate when written, else the median of
    the runs."""
    frontier = {}
    for name, chosen in read_runs(path).items():
        parts = name.split("/")
        if len(parts) < 4 or parts[0] != "frontier":
            continue
        seconds = statistics.median(
            entry[clock + "_time"] * TIME_UNIT_SECONDS[entry.get("time_unit", "ns")]
            for entry in chosen)
        first = chosen[0]
        frontier.setdefault(parts[1], {}).setdefault(parts[2], []).append(
            (parts[3], seconds, first["relative_error"], int(first["n"]), int(first["dim"])))
    return frontier


def parameter_order(parameter):
    try:
        return float(parameter)
    except ValueError:
        return 0.0


def plot_frontier(pyplot, frontier, clock, path):
    from matplotlib import ticker
    sets = [name for name in FRONTIER_SETS if name in frontier]
    if not sets:
        print(f"plot.py: no frontier benchmark in the input; {path} not written", file=sys.stderr)
        return
    figure, panels = pyplot.subplots(1, len(sets), figsize=(6 * len(sets), 5.5), squeeze=False)
    for axes, name in zip(panels[0], sets):
        families = frontier[name]
        shape = None
        for family, label in FRONTIER_FAMILIES:
            points = sorted(families.get(family, []), key=lambda p: parameter_order(p[0]))
            if not points:
                continue
            shape = points[0][3:]
            times = [1e3 * point[1] for point in points]
            errors = [point[2] for point in points]
            style = dict(STYLE[family])
            if family == "exact":
                style["linestyle"] = "none"
            axes.loglog(times, errors, label=label, **style)
            if family != "exact":
                # Alternate above and below: neighbouring points of a curve may nearly coincide.
                for index, (time, error, point) in enumerate(zip(times, errors, points)):
                    axes.annotate(point[0], (time, error), textcoords="offset points",
                                  xytext=(3, 4 if index % 2 == 0 else -10), fontsize="x-small")
        axes.set_xlabel(f"time per call, ms (median {'processor' if clock == 'cpu' else 'wall'}"
                        " time, 1 thread)")
        axes.set_ylabel("relative Frobenius error vs exact ALiBi (double)")
        n, dim = shape
        axes.set_title(f"{name}: n = {n}, 8 heads, d = {dim}")
        axes.grid(True, which="both", alpha=0.3)
        for axis in (axes.xaxis, axes.yaxis):
            axis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
        axes.xaxis.set_minor_formatter(ticker.NullFormatter())
    handles, labels = panels[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize="small")
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", action="append",
                        help="plsh_bench JSON output (may be repeated; later files win)")
    parser.add_argument("--accuracy", help="plsh_accuracy --json output")
    parser.add_argument("--frontier", help="plsh_frontier JSON output")
    parser.add_argument("--train", help="plsh_bench JSON output of the training families")
    parser.add_argument("--out-dir", default=".", help="where the PNG files go (default: .)")
    parser.add_argument("--samples", type=int, default=20,
                        help="number of samples s of the PLSH curves in time_vs_n.png")
    parser.add_argument("--clock", choices=["real", "cpu"], default="real",
                        help="benchmark time to plot (default: real, the wall time)")
    arguments = parser.parse_args()
    if not (arguments.bench or arguments.accuracy or arguments.frontier or arguments.train):
        parser.error("give --bench FILE, --accuracy FILE, --frontier FILE, --train FILE, or "
                     "several")

    pyplot = load_matplotlib()
    os.makedirs(arguments.out_dir, exist_ok=True)
    if arguments.bench:
        results = read_benchmarks(arguments.bench, arguments.clock)
        plot_time_vs_n(pyplot, results, arguments.samples, arguments.clock,
                       os.path.join(arguments.out_dir, "time_vs_n.png"))
    if arguments.accuracy:
        with open(arguments.accuracy) as file:
            accuracy = json.load(file)
        plot_error_vs_time(pyplot, accuracy, arguments.clock,
                           os.path.join(arguments.out_dir, "error_vs_time.png"))
    if arguments.frontier:
        plot_frontier(pyplot, read_frontier(arguments.frontier, arguments.clock), arguments.clock,
                      os.path.join(arguments.out_dir, "frontier.png"))
    if arguments.train:
        plot_train(pyplot, read_train(arguments.train), os.path.join(arguments.out_dir,
                                                                      "train_vs_n.png"))


if __name__ == "__main__":
    main()
