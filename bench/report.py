#!/usr/bin/env python3
"""Markdown tables of the documentation, rendered from the benchmarks' output.

Every table of README.md and docs/ that holds measured figures sits between two markers,

    <!-- report: NAME -->
    ... (generated: do not edit by hand)
    <!-- /report -->

and this script rewrites what lies between them from the files in docs/ (below). Run it from
anywhere after new data is written (bench/regenerate.sh runs it at the end of every part):

    /usr/bin/python3 bench/report.py           rewrite the tables in place
    /usr/bin/python3 bench/report.py --check   exit 1 if a table differs from its data

Sources (a missing source leaves a line saying which command writes it):
    docs/bench/bench.json          plsh_bench, every family (bench/regenerate.sh kernels)
    docs/bench/scaling.json        plsh_bench, the long families up to 2^20 (bench/regenerate.sh long)
    docs/bench/accuracy.json       plsh_accuracy --n=4096 (bench/regenerate.sh kernels)
    docs/bench/frontier.json       plsh_frontier, time and error on three input sets
                                   (bench/regenerate.sh frontier)
    docs/bench/train.json          plsh_bench, the training families (bench/regenerate.sh train)
    docs/bench/decode.json         plsh_bench, the decoding families (bench/regenerate.sh decode);
                                   docs/bench/bench.json's decode_* entries when it is missing
    docs/bench/alibi_decode.json   plsh_bench, decode_alibi and decode_exact
                                   (bench/regenerate.sh alibi)
    docs/bench/alibi_model.json    examples/python/alibi_cache_study.py, AlibiKvCache on the
                                   miniature model trained with exact ALiBi
                                   (bench/regenerate.sh alibi_model)
    docs/bench/mpi-bytes-<P>.txt   mpirun -np P mpi_bench bytes 16 20 (bench/regenerate.sh mpi)
    docs/accuracy/exponents.md     docs/accuracy/plot.py (docs/accuracy/regenerate.sh)
    docs/training/results.md       examples/python/compare.py
    docs/training/torch_bench-*.txt  bench/torch_bench.py, one file per run

Standard library only.
"""

import argparse
import glob
import json
import math
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "docs/performance.md", "docs/decoding.md", "docs/half-precision.md",
         "docs/accuracy.md", "docs/training/README.md", "docs/mpi.md"]
MARKER = re.compile(r"(<!-- report: ([\w-]+) -->\n)(.*?)(<!-- /report -->)", re.DOTALL)
UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


class Missing(Exception):
    """A source file that is not there: the table says which command writes it."""


def path(relative):
    return os.path.join(ROOT, relative)


def read_json(relative, command):
    if not os.path.exists(path(relative)):
        raise Missing(f"`{relative}` is missing: `{command}` writes it.")
    with open(path(relative)) as f:
        return json.load(f)


def short_name(run_name):
    """gemm/1024/real_time -> gemm/1024; long_fused/65536/20/float/iterations:1/real_time ->
    long_fused/65536/20/float."""
    parts = [p for p in run_name.split("/")
             if p not in ("real_time", "process_time") and not p.startswith("iterations:")
             and not p.startswith("repeats:")]
    return "/".join(parts)


class Runs:
    """Google Benchmark JSON: one entry per benchmark, the median over repetitions (the median
    aggregate when written). With several files, a later file's benchmark replaces an earlier
    one's; within a file a later run of the same name replaces an earlier one."""

    def __init__(self, files, command):
        self.entries = {}
        self.context = {}
        for relative in files:
            data = read_json(relative, command)
            self.context = data.get("context", {})
            iterations, medians = {}, {}
            for b in data.get("benchmarks", []):
                name = short_name(b.get("run_name", b["name"]))
                if b.get("run_type") == "aggregate":
                    if b.get("aggregate_name") == "median":
                        medians[name] = b
                else:
                    iterations.setdefault(name, []).append(b)
            for name in list(iterations) + [n for n in medians if n not in iterations]:
                self.entries[name] = medians.get(name) or self.median(iterations[name])

    @staticmethod
    def median(runs):
        if len(runs) == 1:
            return runs[0]
        entry = dict(runs[-1])
        for key in ("real_time", "cpu_time"):
            entry[key] = statistics.median(r[key] for r in runs)
        return entry

    def get(self, name):
        return self.entries.get(name)

    def seconds(self, name, clock="real_time"):
        entry = self.entries.get(name)
        if entry is None:
            return None
        return entry[clock] * UNIT_SECONDS[entry.get("time_unit", "ns")]

    def names(self, prefix):
        return sorted((n for n in self.entries if n.startswith(prefix)),
                      key=lambda n: [(0, int(p), "") if p.isdigit() else (1, 0, p)
                                     for p in n.split("/")])


def describe_context(context, relative):
    date = context.get("date", "?")[:10]
    load = context.get("load_avg") or []
    load_text = f", load average {load[0]:.1f}" if load else ""
    return f"`{relative}` ({date}, {context.get('num_cpus', '?')} cores{load_text})"


def fmt(value, digits=3):
    """Three significant digits, no exponent for ordinary magnitudes."""
    if value is None:
        return "—"
    if value == 0:
        return "0"
    if abs(value) >= 10 ** digits:
        return f"{value:,.0f}"
    if abs(value) < 1e-3:
        return f"{value:.2e}"
    return f"{value:#.{digits}g}".rstrip(".")


def ms(seconds):
    return fmt(None if seconds is None else seconds * 1e3)


def table(header, rows, align=None):
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Kernels: plsh_bench and plsh_accuracy

KERNEL_COMMAND = "bash bench/regenerate.sh kernels"


def accuracy_methods():
    data = read_json("docs/bench/accuracy.json", KERNEL_COMMAND)
    return data, {(m["method"], m["parameter"]): m for m in data["methods"]}


FRONTIER_COMMAND = "bash bench/regenerate.sh frontier"
FRONTIER_SOURCE = "docs/bench/frontier.json"
FRONTIER_SETS = ["normal", "peaked", "trained"]
FRONTIER_FAMILIES = [("exact", "exact, float"), ("windowed", "windowed, tolerance"),
                     ("fused", "fused, s"), ("fused_lhs", "fused, Latin hypercube, s"),
                     ("fused_near", "fused, Latin hypercube, near field 0.05, s"),
                     ("fixed_blocks", "fixed blocks, b")]


class Frontier:
    """plsh_frontier's runs: processor time (the median over repetitions) and the errors of
    frontier/<set>/<family>/<parameter>."""

    def __init__(self):
        self.runs = Runs([FRONTIER_SOURCE], FRONTIER_COMMAND)
        if not self.runs.names("frontier/"):
            raise Missing(f"no frontier/ entries in `{FRONTIER_SOURCE}`: `{FRONTIER_COMMAND}` "
                          "writes them.")

    def seconds(self, input_set, method):
        return self.runs.seconds(f"frontier/{input_set}/{method}", "cpu_time")

    def speedup(self, input_set, method):
        """Processor time of exact (float) over this method's, on the same set in the same run."""
        exact = self.seconds(input_set, "exact/float")
        seconds = self.seconds(input_set, method)
        return exact / seconds if exact and seconds else None

    def error(self, input_set, method, counter="relative_error"):
        return (self.runs.get(f"frontier/{input_set}/{method}") or {}).get(counter)

    def methods(self):
        """family/parameter of every method, in FRONTIER_FAMILIES order, parameters as listed
        by Runs.names (tolerances falling, s and b rising)."""
        found = {name.split("/", 2)[2] for name in self.runs.names("frontier/")}
        ordered = []
        for family, _ in FRONTIER_FAMILIES:
            names = self.runs.names(f"frontier/normal/{family}/")
            ordered += [n.split("/", 2)[2] for n in names if n.split("/", 2)[2] in found]
        return ordered

    def shape(self, input_set):
        entry = self.runs.get(f"frontier/{input_set}/exact/float") or {}
        return int(entry.get("n", 0)), int(entry.get("dim", 0))

    def repetitions(self):
        entry = self.runs.get("frontier/normal/exact/float") or {}
        return entry.get("repetitions", 1)

    def source(self):
        return describe_context(self.runs.context, FRONTIER_SOURCE)


def times_faster(value):
    if value is None:
        return "—"
    return f"{value:.2g}×" if value < 10 else f"{value:.0f}×"


def which_kernel():
    """README: which kernel for what, from the frontier (normal and trained sets)."""
    frontier = Frontier()
    rows = [
        ("exact results", "`exact_alibi_attention`", "exact/float"),
        ("a guaranteed tolerance (each row drops keys of exact-ALiBi weight ≤ 1e-3)",
         "`windowed_alibi_attention`, tolerance 1e-3", "windowed/1e-3"),
        ("the fastest guaranteed pass", "`windowed_alibi_attention`, tolerance 1e-1",
         "windowed/1e-1"),
        ("long contexts, fast: near-linear time, a bounded decoding cache, an MPI halo independent of n",
         "`plsh_attention`, s = 20", "fused/20"),
        ("training with bias-free blocks, as in the paper",
         "`plsh_attention`, Latin hypercube, s = 100", "fused_lhs/100"),
        ("training closest to ALiBi ([docs/training](docs/training/README.md)): the defaults",
         "`plsh_attention`, Latin hypercube, near field 0.05, s = 100", "fused_near/100"),
        ("a baseline (not ALiBi)", "`fixed_block_attention`, b = 64", "fixed_blocks/64"),
    ]
    body = []
    for use, call, method in rows:
        cells = [use, call]
        for input_set in ("normal", "trained"):
            cells += [times_faster(frontier.speedup(input_set, method)),
                      fmt(frontier.error(input_set, method), 2)]
        body.append(cells)
    (n, dim), (trained_n, trained_dim) = frontier.shape("normal"), frontier.shape("trained")
    body.append(alibi_cache_row())
    header = ["for", "kernel", "speed-up, N(0, 1)", "error, N(0, 1)", "speed-up, trained",
              "error, trained"]
    caption = (f"Speed-up: processor time of exact ALiBi (float) over the kernel's, 1 thread; "
               f"error: relative Frobenius error against exact ALiBi in double. 8 heads, causal, "
               f"float; N(0, 1): q, k, v normal, n = {n}, d = {dim}; trained: the q, k, v of the "
               f"miniature model of [docs/accuracy](docs/accuracy/README.md), n = {trained_n}, "
               f"d = {trained_dim}. From {frontier.source()}. `AlibiKvCache` (decoding, "
               f"[docs/decoding.md](docs/decoding.md)): time per token of exact decoding over the "
               f"whole prefix over the cache's (processor time) at context 65536, tolerance 1e-4, on "
               f"q, k, v "
               f"uniform in [−1, 1] (`{ALIBI_DECODE_SOURCE}`) and on the miniature model trained "
               f"with exact ALiBi (`{ALIBI_MODEL_SOURCE}`); error: the largest bound any step "
               f"reported on the exact-ALiBi weight it dropped.")
    return table(header, body, ["---", "---", "---:", "---:", "---:", "---:"]) + "\n\n" + caption


def frontier_table():
    """docs/performance.md: every method of plsh_frontier on the three input sets."""
    frontier = Frontier()
    labels = dict(FRONTIER_FAMILIES)
    body = []
    for method in frontier.methods():
        family, parameter = method.split("/")
        cells = [labels[family].rsplit(", ", 1)[0] if family.startswith("fused_")
                 else labels[family].split(",")[0],
                 "" if family == "exact" else parameter]
        for input_set in FRONTIER_SETS:
            seconds = frontier.seconds(input_set, method)
            speedup = frontier.speedup(input_set, method)
            cells += [f"{ms(seconds)} ({times_faster(speedup)})" if seconds else "—",
                      fmt(frontier.error(input_set, method), 2),
                      fmt(frontier.error(input_set, method, "largest_row_error"), 2)]
        body.append(cells)
    header = ["method", "parameter"]
    for input_set in FRONTIER_SETS:
        n, dim = frontier.shape(input_set)
        header += [f"{input_set} (n = {n}, d = {dim}): ms (faster than exact)", "error",
                   "largest row error"]
    exact_entry = frontier.runs.get("frontier/normal/exact/float") or {}
    loaded = (exact_entry.get("real_time", 0) > 1.3 * exact_entry.get("cpu_time", 1))
    note = (" The machine was shared during the run (wall time well above processor time)."
            if loaded else "")
    return (table(header, body, ["---", "---"] + ["---:"] * (3 * len(FRONTIER_SETS)))
            + f"\n\nProcessor time per call, 1 thread, median of {frontier.repetitions()} "
            f"repetitions, and the speed-up against exact ALiBi in float on the same set; error: "
            f"relative Frobenius error against exact ALiBi in double; largest row error: the "
            f"largest ‖o_i − o*_i‖ / ‖o*_i‖ over rows and heads. From {frontier.source()}."
            + note)


def time_per_call():
    runs = Runs(["docs/bench/bench.json"], KERNEL_COMMAND)
    sizes = [1024, 4096, 16384, 65536]
    rows = [("gemm (Eigen yardstick)", "gemm/{n}"), ("exact", "exact/{n}"),
            ("windowed, tolerance 1e-6", "windowed/{n}"), ("passes, s = 20", "passes/{n}/20"),
            ("fused, s = 5", "fused/{n}/5"), ("fused, s = 20", "fused/{n}/20"),
            ("fused, s = 100", "fused/{n}/100"), ("fixed blocks, b = 64", "fixed_blocks/{n}")]
    body = []
    for label, pattern in rows:
        times = [ms(runs.seconds(pattern.format(n=n))) for n in sizes]
        entry = runs.get(pattern.format(n=16384)) or {}
        body.append([label] + times + [fmt(entry.get("scores_per_query")),
                                       fmt(entry.get("gflops"))])
    header = ["method"] + [f"n = {n}" for n in sizes] + ["scores per query (16384)",
                                                        "GFLOP/s (16384)"]
    fused = runs.seconds("fused/16384/20")
    windowed = runs.seconds("windowed/16384")
    exact = runs.seconds("exact/16384")
    ratios = ""
    if fused and windowed and exact:
        ratios = (f" At n = 16384 the fused kernel (s = 20) is {windowed / fused:.1f}× faster "
                  f"than windowed and {exact / fused:.1f}× faster than exact.")
    return (table(header, body) + "\n\nWall time per call, ms, 1 thread, from "
            + describe_context(runs.context, "docs/bench/bench.json") + "." + ratios)


def threads():
    runs = Runs(["docs/bench/bench.json"], KERNEL_COMMAND)
    one = runs.seconds("fused_threads/16384/20/1")
    two = runs.seconds("fused_threads/16384/20/2")
    if one is None or two is None:
        return "No `fused_threads` entries (an OpenMP build writes them)."
    return table(["fused, n = 16384, s = 20", "1 thread", "2 threads", "speed-up"],
                 [("wall time, ms", ms(one), ms(two), f"{one / two:.2f}×")]) + (
        "\n\nFrom " + describe_context(runs.context, "docs/bench/bench.json") + ".")


def accuracy_time():
    data, _ = accuracy_methods()
    exact = next(m for m in data["methods"] if m["method"] == "exact")
    names = {"fused_lhs": "fused, Latin hypercube", "fixed_blocks": "fixed blocks"}
    body = []
    for m in data["methods"]:
        body.append((names.get(m["method"], m["method"]), m["parameter"].replace("=", " = "),
                     fmt(m["relative_error"], 2), ms(m["median_cpu_seconds"]),
                     ms(m["median_seconds"]),
                     f"{exact['median_cpu_seconds'] / m['median_cpu_seconds']:.2f}"))
    header = ["method", "parameter", "relative error", "processor time (ms)", "wall time (ms)",
              "faster than exact (processor time)"]
    loaded = exact["median_seconds"] > 1.5 * exact["median_cpu_seconds"]
    note = (" The machine was shared during this run (wall time well above processor time), so "
            "the speed-ups use processor time." if loaded else "")
    return (table(header, body, ["---", "---", "---:", "---:", "---:", "---:"])
            + f"\n\n`docs/bench/accuracy.json`: n = {data['n']}, {data['heads']} heads, d = "
            f"{data['dim']}, {'causal' if data['causal'] else 'bidirectional'}, {data['scalar']}, "
            f"{data['threads']} thread(s), q and k uniform in [−{data['query_key_range']:g}, "
            f"{data['query_key_range']:g}]; error: relative Frobenius norm against exact ALiBi in "
            f"double; times: median of {data['timed_runs']} runs." + note)


def sampler_study():
    data, _ = accuracy_methods()
    study = data.get("sampler_study")
    if not study:
        return "No sampler study in `docs/bench/accuracy.json`."
    body = []
    samplers = ["independent", "latin_hypercube", "shifted_kronecker"]
    for row in study["rows"]:
        slope = "all" if row["slope"] == 0 else f"1/{round(1 / row['slope'])}"
        base = row["independent"]["mean"]
        cells = [row["error"].replace("_", " "), slope, row["samples"]]
        for sampler in samplers:
            stats = row[sampler]
            cells.append(f"{fmt(stats['mean'])} ± {fmt(stats['sd'], 2)}")
        for sampler in samplers[1:]:
            cells.append(f"{100 * (row[sampler]['mean'] / base - 1):+.1f}%")
        body.append(cells)
    header = ["error", "slope", "s", "independent", "Latin hypercube", "shifted Kronecker",
              "Latin hypercube vs independent", "Kronecker vs independent"]
    return (table(header, body, ["---", "---", "---:"] + ["---:"] * 5)
            + f"\n\nMean ± standard deviation over seeds 0..{study['seeds'] - 1}: the mask errors "
            f"of one head (`mask_error`, dense, n = {study['mask_n']}), and the attention output's "
            f"relative Frobenius error (fused, float, n = {data['n']}, all {data['heads']} heads). "
            "From `docs/bench/accuracy.json`.")


# ---------------------------------------------------------------------------------------------
# Long sequences and half precision: the long_* families

LONG_COMMAND = "bash bench/regenerate.sh long"


def long_sequences():
    runs = Runs(["docs/bench/scaling.json"], LONG_COMMAND)
    sizes = sorted({int(n.split("/")[1]) for n in runs.names("long_")})
    body = []
    base = runs.seconds(f"long_fused/{sizes[0]}/20/float", "cpu_time") if sizes else None
    for n in sizes:
        fused = runs.get(f"long_fused/{n}/20/float") or {}
        bf16 = runs.get(f"long_fused/{n}/20/bfloat16") or {}
        fused_cpu = runs.seconds(f"long_fused/{n}/20/float", "cpu_time")

        def ratio(a, b):
            return f"{a / b:.3f}" if a and b else "—"

        body.append((f"2^{n.bit_length() - 1} = {n}",
                     fmt(fused_cpu),
                     fmt(runs.seconds(f"long_fused/{n}/20/bfloat16", "cpu_time")),
                     fmt(runs.seconds(f"long_windowed/{n}/float", "cpu_time")),
                     f"{fused_cpu / base:.1f}×" if fused_cpu and base else "—",
                     ratio(fused.get("peak_rss_bytes"), fused.get("tensor_bytes")),
                     # A run that measures the error holds the float reference as well.
                     "—" if "relative_error" in bf16
                     else ratio(bf16.get("peak_rss_bytes"), fused.get("peak_rss_bytes"))))
    header = ["n", "fused float (s)", "fused bfloat16 (s)", "windowed float (s)",
              f"fused float / n = {sizes[0] if sizes else '?'}", "fused float: peak / tensors",
              "bfloat16 peak / float peak"]
    return (table(header, body) + "\n\nProcessor time of one call (s = 20, 1 thread), peak "
            "resident memory of the process during the call against the bytes of q, k, v and out; "
            "from " + describe_context(runs.context, "docs/bench/scaling.json") + ".")


def half_precision():
    runs = Runs(["docs/bench/scaling.json"], LONG_COMMAND)
    body = []
    for name in runs.names("long_fused/"):
        entry = runs.get(name)
        _, n, _, storage = name.split("/")
        if "relative_error" not in entry:
            continue
        float_cpu = runs.seconds(f"long_fused/{n}/20/float", "cpu_time")
        cpu = runs.seconds(name, "cpu_time")
        body.append((storage, n, fmt(entry["relative_error"], 2), fmt(cpu),
                     f"{float_cpu / cpu:.2f}×" if float_cpu else "—"))
    header = ["storage", "n", "relative error", "processor time (s)", "float time / this time"]
    return (table(header, body, ["---", "---:", "---:", "---:", "---:"])
            + "\n\nThe fused kernel (s = 20, 1 thread) on q, k, v uniform in [−1, 1] rounded to the "
            "storage type; error: ‖out − out_float‖_F / ‖out_float‖_F, out_float the fused kernel "
            "on the float inputs. From " + describe_context(runs.context, "docs/bench/scaling.json")
            + ".")


# ---------------------------------------------------------------------------------------------
# Training: the forward, and the forward then the backward (train_forward/ and train/)

TRAIN_COMMAND = "bash bench/regenerate.sh train"
TRAIN_SOURCE = "docs/bench/train.json"
TRAIN_KERNELS = [("exact", "exact"), ("windowed_1e3", "windowed, certified 1e-3"),
                 ("truncated_1e3", "truncated, factor 1e-3"),
                 ("truncated_5e2", "truncated, factor ≥ 0.05"),
                 ("fused_defaults", "fused, defaults"), ("fused_paper", "fused, paper's estimator"),
                 ("fixed_blocks", "fixed blocks, b = 64")]
TRAIN_PASSES = [("train_forward", "forward"), ("train", "forward + backward")]
# Each thread count's clock: one thread's processor time is its work whatever else runs on the
# machine; the processor time of two threads is their sum, so their figure is the wall time.
TRAIN_CLOCKS = {1: ("cpu_time", "processor time"), 2: ("real_time", "wall time")}


class Train:
    """The training families: time of family/kernel/n/threads (median over repetitions)."""

    def __init__(self):
        self.runs = Runs([TRAIN_SOURCE], TRAIN_COMMAND)
        if not self.runs.names("train"):
            raise Missing(f"no train/ entries in `{TRAIN_SOURCE}`: `{TRAIN_COMMAND}` writes them.")
        self.lengths = sorted({int(n.split("/")[2]) for n in self.runs.names("train")})

    def seconds(self, family, kernel, n, threads, clock=None):
        clock = clock or TRAIN_CLOCKS[threads][0]
        return self.runs.seconds(f"{family}/{kernel}/{n}/{threads}", clock)

    def cores(self, family, kernel, n, threads):
        """Processor time over wall time: the cores the run had on average."""
        wall = self.seconds(family, kernel, n, threads, "real_time")
        cpu = self.seconds(family, kernel, n, threads, "cpu_time")
        return cpu / wall if cpu and wall else None

    def source(self):
        entry = self.runs.get(self.runs.names("train")[0]) or {}
        repetitions = entry.get("repetitions", 1)
        return (f"median of {repetitions} repetitions, from "
                + describe_context(self.runs.context, TRAIN_SOURCE))


def train_time():
    """docs/performance.md: time per call of every training family on 1 thread, n by n."""
    train = Train()
    body = []
    for kernel, label in TRAIN_KERNELS:
        for family, step in TRAIN_PASSES:
            times = [train.seconds(family, kernel, n, 1) for n in train.lengths]
            if any(times):
                body.append([label, step] + [ms(t) for t in times])
    header = ["kernel", "pass"] + [f"n = {n}" for n in train.lengths]
    return (table(header, body, ["---", "---"] + ["---:"] * len(train.lengths))
            + "\n\nProcessor time per call, ms, 1 thread (wall time stretches with the machine's "
            "load, processor time much less), " + train.source() + ".")


def train_ratios():
    """docs/performance.md: how much faster than exact ALiBi each kernel is at n = 8192 and
    16384, forward and forward + backward, 1 and 2 threads."""
    train = Train()
    sizes = [n for n in (8192, 16384) if n in train.lengths]
    body = []
    for kernel, label in TRAIN_KERNELS[1:]:
        cells = [label]
        for n in sizes:
            for threads in (1, 2):
                for family, _ in TRAIN_PASSES:
                    exact = train.seconds(family, "exact", n, threads)
                    time = train.seconds(family, kernel, n, threads)
                    cells.append(f"{exact / time:.1f}×" if exact and time else "—")
        body.append(cells)
    header = ["kernel"] + [f"n = {n}, {threads} thread{'s' if threads > 1 else ''}, {step}"
                           for n in sizes for threads in (1, 2) for _, step in TRAIN_PASSES]
    return (table(header, body) + "\n\nTime of exact ALiBi over the kernel's in the same run: "
            "1 thread by processor time, 2 threads by wall time; " + train.source() + ".")


def train_threads():
    """docs/performance.md: what the second thread gives at the largest n of each kernel."""
    train = Train()
    body = []
    for kernel, label in TRAIN_KERNELS:
        measured = [n for n in train.lengths if train.seconds("train", kernel, n, 2)]
        family = "train"
        if not measured:
            family = "train_forward"
            measured = [n for n in train.lengths if train.seconds(family, kernel, n, 2)]
        if not measured:
            continue
        n = measured[-1]
        one = train.seconds(family, kernel, n, 1, "real_time")
        two = train.seconds(family, kernel, n, 2, "real_time")
        body.append((label, dict(TRAIN_PASSES)[family], n, ms(one), ms(two),
                     f"{one / two:.2f}×", fmt(train.cores(family, kernel, n, 1), 2),
                     fmt(train.cores(family, kernel, n, 2), 2)))
    header = ["kernel", "pass", "n", "1 thread, wall ms", "2 threads, wall ms", "speed-up",
              "cores used, 1 thread", "cores used, 2 threads"]
    return (table(header, body, ["---", "---"] + ["---:"] * 6)
            + "\n\nCores used: processor time of the process over wall time (2 on an idle "
            "machine for 2 threads that never wait); " + train.source() + ".")


def train_growth():
    """docs/performance.md: time over n log2 n relative to the smallest n, 1 thread: a row that
    rises grows faster than n log n."""
    train = Train()
    body = []
    for kernel, label in TRAIN_KERNELS:
        for family, step in TRAIN_PASSES:
            points = [(n, train.seconds(family, kernel, n, 1)) for n in train.lengths]
            points = [(n, t) for n, t in points if t]
            if not points:
                continue
            base = points[0][1] / (points[0][0] * math.log2(points[0][0]))
            by_n = {n: t / (n * math.log2(n)) / base for n, t in points}
            body.append([label, step] + [fmt(by_n.get(n), 2) for n in train.lengths])
    header = ["kernel", "pass"] + [f"n = {n}" for n in train.lengths]
    return (table(header, body, ["---", "---"] + ["---:"] * len(train.lengths))
            + f"\n\nProcessor time per call over n log2 n, relative to n = {train.lengths[0]}, "
            "1 thread; " + train.source() + ".")


# ---------------------------------------------------------------------------------------------
# Decoding

DECODE_COMMAND = "bash bench/regenerate.sh decode"


def decoding():
    if os.path.exists(path("docs/bench/decode.json")):
        source = "docs/bench/decode.json"
    else:
        source = "docs/bench/bench.json"
    runs = Runs([source], DECODE_COMMAND)
    body = []
    for name in runs.names("decode_plsh/") + runs.names("decode_exact/"):
        entry = runs.get(name)
        parts = name.split("/")
        kernel = "Positional LSH (`KvCache`)" if parts[0] == "decode_plsh" else "exact, full cache"
        storage = parts[2] if len(parts) > 2 else "float"
        thread_count = parts[3] if len(parts) > 3 else "—"
        resident = entry.get("resident")
        cache = entry.get("cache_bytes")
        body.append((kernel, parts[1], storage, thread_count,
                     fmt(runs.seconds(name) * 1e6),
                     f"{resident:,.0f}" if resident is not None else "—",
                     f"{cache / 2**20:.1f} MiB" if cache is not None else "—"))
    if not body:
        raise Missing(f"no decode_* entries in `{source}`: `{DECODE_COMMAND}` writes them.")
    header = ["kernel", "context", "storage", "threads", "µs per token", "resident tokens",
              "cache bytes"]
    text = table(header, body, ["---", "---:", "---", "---:", "---:", "---:", "---:"])
    team = [(name, fmt(runs.seconds(name) * 1e6)) for name in runs.names("team_step/")]
    if team:
        text += "\n\n" + table(["`team_step` (arithmetic only, no data between cores)", "µs"],
                               team)
    return text + "\n\nOne `decode` of one token per iteration (8 heads, d = 64, s = 20 independent " \
        "draws, no near field); from " \
        + describe_context(runs.context, source) + "."


# decoding-estimators: the defaults beside the paper's estimator (decode_estimator).
ESTIMATORS = {"defaults": "the defaults (s = 100, Latin hypercube, near field 0.05)",
              "paper": "the paper's (s = 20, independent, no near field)"}


def decoding_estimators():
    source = "docs/bench/decode.json"
    runs = Runs([source], DECODE_COMMAND)
    rows = []
    for name in runs.names("decode_estimator/"):
        _, context, estimator, storage, thread_count = name.split("/")
        paper = f"decode_estimator/{context}/paper/{storage}/{thread_count}"
        cpu, paper_cpu = runs.seconds(name, "cpu_time"), runs.seconds(paper, "cpu_time")
        order = list(ESTIMATORS).index(estimator) if estimator in ESTIMATORS else len(ESTIMATORS)
        rows.append(((int(context), storage, int(thread_count), order),
                     (ESTIMATORS.get(estimator, estimator), context, storage, thread_count,
                      fmt(runs.seconds(name) * 1e6), fmt(cpu * 1e6),
                      f"{cpu / paper_cpu:.2f}×" if paper_cpu else "—",
                      f"{runs.get(name).get('resident', 0):,.0f}")))
    if not rows:
        raise Missing(f"no decode_estimator entries in `{source}`: `{DECODE_COMMAND}` writes them.")
    header = ["estimator", "context", "storage", "threads", "µs per token",
              "processor µs per token", "processor time / the paper's", "resident tokens"]
    return (table(header, [row for _, row in sorted(rows)],
                  ["---", "---:", "---", "---:", "---:", "---:", "---:", "---:"])
            + "\n\nOne `decode` of one token per iteration (8 heads, d = 64) after a prefill of "
            "the context; processor time beside wall time, which a loaded machine inflates; from "
            + describe_context(runs.context, source) + ".")


# ---------------------------------------------------------------------------------------------
# MPI

MPI_COMMAND = "bash bench/regenerate.sh mpi"


def mpi_bytes():
    files = sorted(glob.glob(path("docs/bench/mpi-bytes-*.txt")),
                   key=lambda f: int(re.search(r"(\d+)\.txt$", f).group(1)))
    if not files:
        raise Missing(f"`docs/bench/mpi-bytes-<ranks>.txt` is missing: `{MPI_COMMAND}` writes it.")
    by_n = {}
    ranks_list = []
    for f in files:
        ranks = int(re.search(r"(\d+)\.txt$", f).group(1))
        ranks_list.append(ranks)
        with open(f) as handle:
            for line in handle:
                fields = line.split()
                if not fields or not fields[0].isdigit():
                    continue
                n = int(fields[0])
                by_n.setdefault(n, {})[ranks] = [float(x) for x in fields[1:8]]

    def size(b):
        for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if b >= scale:
                return f"{b / scale:.2f} {unit}"
        return f"{b:.0f} B"

    header = ["n"]
    for ranks in ranks_list:
        header += [f"Positional LSH, {ranks} ranks", f"windowed, {ranks} ranks",
                   f"ring exact, {ranks} ranks"]
    header.append(f"ring / Positional LSH, {ranks_list[-1]} ranks")
    body = []
    for n in sorted(by_n):
        row = [f"2^{n.bit_length() - 1}"]
        for ranks in ranks_list:
            values = by_n[n].get(ranks)
            row += ([size(values[0]), size(values[2]), size(values[4])] if values
                    else ["—"] * 3)
        last = by_n[n].get(ranks_list[-1])
        row.append(f"{last[6]:.0f}×" if last else "—")
        body.append(row)
    return (table(header, body) + "\n\nKey and value bytes received per rank, the largest over "
            "the ranks (8 standard heads, d = 64, float, causal, s = 20, windowed tolerance 1e-6); "
            "from " + ", ".join(f"`docs/bench/{os.path.basename(f)}`" for f in files) + ".")


# ---------------------------------------------------------------------------------------------
# Accuracy at scale and training: tables that other scripts write as markdown

def exponents():
    relative = "docs/accuracy/exponents.md"
    if not os.path.exists(path(relative)):
        raise Missing(f"`{relative}` is missing: `bash docs/accuracy/regenerate.sh plot` writes it.")
    with open(path(relative)) as f:
        return f.read().strip()


def training_means():
    """The summary table that examples/python/compare.py writes: the first table of study.md when
    that file exists, else the means over seeds of results.md."""
    sources = [("docs/training/study.md", r"^((?:\|.*\n)+)"),
               ("docs/training/results.md", r"^## Mean over seeds.*?\n\n((?:\|.*\n)+)")]
    for relative, pattern in sources:
        if not os.path.exists(path(relative)):
            continue
        with open(path(relative)) as f:
            text = f.read()
        match = re.search(pattern, text, re.MULTILINE)
        if match:
            return match.group(1).strip() + (f"\n\nFrom `{relative}`, which `examples/python/compare.py` "
                                   "writes (it says what each column holds).")
    raise Missing("`docs/training/results.md` has no summary table: `examples/python/compare.py` "
                  "writes it.")


def torch_speed():
    files = sorted(glob.glob(path("docs/training/torch_bench-*.txt")))
    if not files:
        raise Missing("`docs/training/torch_bench-*.txt` is missing: `bench/torch_bench.py` "
                      "prints it.")
    line = re.compile(r"^\s*(\d+)\s+(.+?)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s*$")
    results = {}
    for f in files:
        with open(f) as handle:
            for text in handle:
                match = line.match(text)
                if match:
                    n, kernel = int(match.group(1)), match.group(2)
                    results.setdefault((n, kernel), []).append(
                        (float(match.group(6)), float(match.group(7))))
    order = {"dense torch": 0, "plsh exact": 1, "plsh fused s=20": 2}
    body = []
    for (n, kernel), values in sorted(results.items(), key=lambda kv: (kv[0][0],
                                                                      order.get(kv[0][1], 9))):
        totals = sorted(v[0] for v in values)
        speedups = sorted(v[1] for v in values)
        spread = (lambda v: fmt(v[0]) if v[0] == v[-1] else f"{fmt(v[0])}–{fmt(v[-1])}")
        body.append((n, kernel, len(values), spread(totals),
                     spread(speedups) + "×"))
    return (table(["n", "kernel", "runs", "forward + backward (s)", "faster than dense torch"],
                  body, ["---:", "---", "---:", "---:", "---:"])
            + "\n\nFloat32, batch 4, 8 heads, d = 64, causal, 2 threads; range over the runs in "
            + ", ".join(f"`docs/training/{os.path.basename(f)}`" for f in files)
            + " (the first lines of each file say how it was run).")


# ---------------------------------------------------------------------------------------------
# Decoding exact ALiBi: AlibiKvCache

ALIBI_DECODE_COMMAND = "bash bench/regenerate.sh alibi"
ALIBI_DECODE_SOURCE = "docs/bench/alibi_decode.json"
ALIBI_MODEL_COMMAND = "bash bench/regenerate.sh alibi_model"
ALIBI_MODEL_SOURCE = "docs/bench/alibi_model.json"


def alibi_decode_runs():
    runs = Runs([ALIBI_DECODE_SOURCE], ALIBI_DECODE_COMMAND)
    if not runs.names("decode_alibi/"):
        raise Missing(f"no decode_alibi/ entries in `{ALIBI_DECODE_SOURCE}`: "
                      f"`{ALIBI_DECODE_COMMAND}` writes them.")
    return runs


def alibi_speedup(runs, context, tolerance):
    """Processor time per token of decode_exact/context over decode_alibi/context/tolerance."""
    exact = runs.seconds(f"decode_exact/{context}", "cpu_time")
    cache = runs.seconds(f"decode_alibi/{context}/{tolerance}", "cpu_time")
    return exact / cache if exact and cache else None


def model_speedup(run, exact, context):
    cache = run["seconds_per_token"].get(str(context))
    full = exact.get(str(context))
    return full / cache if full and cache else None


def alibi_cache_row():
    """which_kernel's row of AlibiKvCache, from the two sources below ("—" where one is missing)."""
    cells = ["decoding a model trained with exact ALiBi: bounded memory, every step certified",
             "`AlibiKvCache`, tolerance 1e-4"]
    try:
        runs = alibi_decode_runs()
        entry = runs.get("decode_alibi/65536/1e-4") or {}
        cells += [times_faster(alibi_speedup(runs, 65536, "1e-4")),
                  "≤ " + fmt(entry.get("largest_bound"), 2)]
    except Missing:
        cells += ["—", "—"]
    try:
        model = read_json(ALIBI_MODEL_SOURCE, ALIBI_MODEL_COMMAND)
        run = next(r for r in model["runs"] if r["tolerance"] == 1e-4)
        cells += [times_faster(model_speedup(run, model["exact_seconds_per_token"], 65536)),
                  "≤ " + fmt(run["largest_bound"], 2)]
    except (Missing, StopIteration):
        cells += ["—", "—"]
    return cells


def alibi_decoding():
    """docs/decoding.md: decode_alibi against decode_exact, per context and tolerance."""
    runs = alibi_decode_runs()
    body = []
    for name in runs.names("decode_alibi/"):
        entry = runs.get(name)
        _, context, tolerance = name.split("/")
        exact = runs.seconds(f"decode_exact/{context}", "cpu_time")
        steps = entry.get("steps", 0)
        body.append((context, tolerance, fmt(runs.seconds(name, "cpu_time") * 1e6),
                     fmt(None if exact is None else exact * 1e6),
                     times_faster(alibi_speedup(runs, context, tolerance)),
                     f"{entry['window']:,.0f}", f"{entry['resident']:,.0f}",
                     f"1/{float(context) / entry['resident']:.1f}",
                     f"{entry['resident_rows']:,.0f}", f"{entry['cache_bytes'] / 2**20:.1f} MiB",
                     fmt(entry.get("largest_bound"), 2),
                     f"{entry.get('uncertified', 0):,.0f} of {steps:,.0f}"))
    header = ["context", "tolerance", "µs per token", "exact, µs per token", "speed-up",
              "W (flattest)", "resident (most per head)", "of the context", "rows, all heads",
              "cache bytes", "largest bound", "uncertified steps"]
    return table(header, body, ["---:"] * len(header)) + (
        "\n\nProcessor time, 1 thread. 8 heads (standard slopes), d = 64, float, q, k, v uniform "
        "in [−1, 1], max_score 8, min_logit −8 (true of these inputs), 4 sinks; every token "
        "decoded through the cache from the first, then one `decode` per iteration; exact: "
        "`decode_exact`, one query against the full cache. Memory at the context; bounds over "
        "every step. From " + describe_context(runs.context, ALIBI_DECODE_SOURCE) + ".")


def alibi_model():
    """docs/decoding.md: AlibiKvCache on the miniature model trained with exact ALiBi."""
    data = read_json(ALIBI_MODEL_SOURCE, ALIBI_MODEL_COMMAND)
    runs = data["runs"]
    contexts = sorted({int(c) for run in runs for c in run["resident"]})
    header = ["context"] + [f"tolerance {run['tolerance']:g}" for run in runs]
    body = []
    for context in contexts:
        cells = [f"{context:,}"]
        for run in runs:
            rows = run["resident"].get(str(context))
            most = max(max(layer) for layer in rows) if rows else None
            cells.append("—" if most is None else f"{most:,} (1/{context / most:.1f})")
        body.append(cells)
    text = "Rows held by the most-filled key/value head (over layers and heads), and that as a " \
        "share of the context:\n\n" + table(header, body, ["---:"] * len(header))
    exact = data["exact_seconds_per_token"]
    timing_contexts = sorted({int(c) for c in exact})
    header = ["tolerance", "W of the flattest head, per layer", "largest bound",
              "uncertified layer steps",
              f"greedy text = exact (first {runs[0]['compared_tokens']:,} tokens)"] + [
        f"µs per token at {c:,} (exact {fmt(exact[str(c)] * 1e6)})" for c in timing_contexts]
    body = []
    for run in runs:
        same = "yes" if run["identical_tokens"] else f"no, from token {run['first_difference']:,}"
        cells = [f"{run['tolerance']:g}", ", ".join(f"{max(w):,}" for w in run["windows"]),
                 fmt(run["largest_bound"], 2),
                 f"{run['uncertified_layer_steps']:,} of {run['layer_steps']:,}", same]
        for c in timing_contexts:
            seconds = run["seconds_per_token"].get(str(c))
            speedup = model_speedup(run, exact, c)
            cells.append("—" if seconds is None else
                         f"{fmt(seconds * 1e6)} ({times_faster(speedup)})")
        body.append(cells)
    model = data["model"]
    declaration = data["declaration"]
    observed = ", ".join(f"layer {i}: {s:.3g} and {f:.3g}" for i, (s, f) in enumerate(
        zip(declaration["max_score"], declaration["min_logit"])))
    return text + "\n\n" + table(header, body, ["---:"] * len(header)) + (
        f"\n\nThe model: {model['layers']} layers, d_model {model['d_model']}, {model['heads']} "
        f"heads (standard slopes), trained {model['steps']} steps at length "
        f"{model['train_length']} with exact ALiBi; greedy decoding of {runs[0]['tokens']:,} "
        f"tokens from \"{data['prompt']}\", one cache per layer. Largest |scale| ‖q‖ ‖k‖ and "
        f"smallest logit of the exact run over its first {runs[0]['compared_tokens']:,} tokens "
        f"({observed}), times {declaration['margin']:g}, are each layer's max_score and "
        f"min_logit. Time: processor time of the whole token step (both layers, projections, "
        f"logits), median over the steps from that context, {data['threads']} thread; exact: "
        f"attention over the whole prefix. From `{ALIBI_MODEL_SOURCE}` ({data['date'][:10]}, load average "
        f"{data['load_average']:.1f}), written by `{data['command']}`.")


TABLES = {
    "which-kernel": which_kernel,
    "frontier": frontier_table,
    "time-per-call": time_per_call,
    "threads": threads,
    "accuracy-time": accuracy_time,
    "sampler-study": sampler_study,
    "long-sequences": long_sequences,
    "half-precision": half_precision,
    "train-time": train_time,
    "train-ratios": train_ratios,
    "train-threads": train_threads,
    "train-growth": train_growth,
    "decoding": decoding,
    "decoding-estimators": decoding_estimators,
    "alibi-decoding": alibi_decoding,
    "alibi-model": alibi_model,
    "mpi-bytes": mpi_bytes,
    "exponents": exponents,
    "training-means": training_means,
    "torch-speed": torch_speed,
}


def render(name):
    if name not in TABLES:
        sys.exit(f"report.py: unknown table '{name}' (known: {', '.join(sorted(TABLES))})")
    try:
        return TABLES[name]()
    except Missing as missing:
        return f"No data: {missing}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a table differs from its data, change nothing")
    args = parser.parse_args()
    stale = []
    for page in PAGES:
        if not os.path.exists(path(page)):
            continue
        with open(path(page)) as f:
            text = f.read()
        new = MARKER.sub(lambda m: m.group(1) + render(m.group(2)) + "\n" + m.group(4), text)
        if new != text:
            stale.append(page)
            if not args.check:
                with open(path(page), "w") as f:
                    f.write(new)
    verb = "differ from their data" if args.check else "rewritten"
    print(f"report.py: {len(stale)} page(s) {verb}" + (": " + ", ".join(stale) if stale else ""))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
