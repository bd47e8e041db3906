"""The training comparison in miniature: every attention variant and the Positional LSH study.

Runs examples/python/lm.py for each (configuration, seed) whose result file is missing from
docs/training/runs/ (two runs at a time by default, one thread each), then writes
docs/training/results.md (every run: losses at L, 2L and 4L, times), docs/training/curves.png
(validation loss against step), docs/training/study.md (the gap of each Positional LSH
configuration to exact ALiBi, mean over seeds, against its time per training step) and
docs/training/gap.png (that gap against the time per step, one point per configuration).
Finished runs are reused; delete a run's JSON file to redo it.

A configuration is a name and the lm.py arguments it adds; its runs are
docs/training/runs/<name>-s<seed>.json. Names: the variant (none, alibi, fixed), or for Positional
LSH "plsh-n<s>-<sampling>" (s draws per head, independent or latin_hypercube), with "-L<length>"
for a training length other than 128 and "to<s'>" for s growing from s to s' during training.

From the repository root:
  bash scripts/python.sh build
  PYTHONPATH=build/python /usr/bin/python3 examples/python/compare.py            # runs what is missing
  PYTHONPATH=build/python /usr/bin/python3 examples/python/compare.py --report-only
  PYTHONPATH=build/python /usr/bin/python3 examples/python/compare.py --quick    # CI: tiny model, < 1 min

--quick trains a tiny model for 50 steps with every variant into a temporary directory and
exits with status 1 unless each run's training loss fell by at least 0.5 nats/byte.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LM = os.path.join(HERE, "lm.py")


def plsh_config(samples, sampling="independent", length=128, samples_final=0, near=0.0):
    """(name, lm.py arguments, label) of a Positional LSH configuration."""
    grow = f"to{samples_final}" if samples_final else ""
    name = f"plsh-n{samples}{grow}-{sampling}" + (f"-near{near:g}" if near else "") + suffix(length)
    args = ["--variant", "plsh", "--samples", str(samples), "--sampling", sampling]
    if samples_final:
        args += ["--samples-final", str(samples_final)]
    if near:
        args += ["--near-field", f"{near:g}"]
    label = (f"Positional LSH s={samples}" + (f"→{samples_final}" if samples_final else "")
             + (", Latin hypercube" if sampling == "latin_hypercube" else "")
             + (f", exact where the factor ≥ {near:g}" if near else ""))
    return name, args + length_args(length), label


def suffix(length):
    """The name suffix of a training length other than 128."""
    return f"-L{length}" if length != 128 else ""


def length_args(length):
    return ["--length", str(length)] if length != 128 else []


def baseline(variant, label, length=128):
    return variant + suffix(length), ["--variant", variant] + length_args(length), label


# Every configuration, and the seeds it runs with. In start order: the slow runs early.
CONFIGS = [
    (baseline("alibi", "exact ALiBi"), (1, 2, 3)),
    (plsh_config(20), (1, 2, 3)),
    (baseline("none", "no bias"), (1, 2, 3)),
    (baseline("fixed", "fixed blocks 64"), (1, 2, 3)),
    (plsh_config(5), (1, 2)),
    (plsh_config(100), (1, 2)),
    (plsh_config(5, "latin_hypercube"), (1, 2)),
    (plsh_config(20, "latin_hypercube"), (1, 2)),
    (plsh_config(100, "latin_hypercube"), (1, 2, 3)),
    (plsh_config(5, samples_final=100), (1, 2)),
    (plsh_config(100, "latin_hypercube", near=0.05), (1, 2)),
    (plsh_config(100, "latin_hypercube", length=512, near=0.05), (1, 2)),
    (plsh_config(20, "latin_hypercube", near=0.05), (1, 2)),
    (plsh_config(20, near=0.05), (1, 2)),
    (plsh_config(20, near=0.5), (1, 2)),
    (baseline("alibi", "exact ALiBi", length=512), (1, 2)),
    (plsh_config(100, length=512), (1, 2)),
    (plsh_config(100, "latin_hypercube", length=512), (1, 2)),
    (plsh_config(20, length=512), (1, 2)),
]
LABELS = {name: label for (name, _, label), _ in CONFIGS}
LABELS["plsh"] = "Positional LSH"  # evaluation method names in the result files
QUICK = ["--layers", "2", "--d-model", "64", "--heads", "4", "--length", "64", "--batch", "8",
         "--steps", "50", "--warmup", "5", "--eval-every", "25", "--log-every", "25",
         "--curve-bytes", "4096", "--eval-bytes", "8192"]
# The paper's figures (Qwen3-0.6B from scratch, 8k context, Wikitext-103 perplexity).
PAPER = [("ALiBi", 18.92), ("Positional LSH, s = 20", 19.05), ("fixed blocks", 19.79),
         ("no positional bias", 20.21)]
# The paper's gap, +0.7% perplexity: ln(19.05 / 18.92) nats.
PAPER_GAP = math.log(19.05 / 18.92)


def running_pid(path):
    """The id of a live lm.py process writing `path` (from its .pid file), or None."""
    try:
        with open(path[: -len(".json")] + ".pid") as f:
            pid = int(f.read())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            alive = path.encode() in f.read()
    except (OSError, ValueError):
        return None
    return pid if alive else None


def run_all(runs, out_dir, extra, jobs, env):
    """Starts the missing runs, at most `jobs` at once; `runs` holds (name, seed, lm.py arguments).

    A run whose result file exists is reused. A run still going in a process started by an
    earlier invocation (its .pid file names a live lm.py writing that result) is waited for,
    counted among the `jobs`, not started again.
    """
    pending = []
    running = []  # (poll function, log file or None, label, path)
    for name, seed, arguments in runs:
        path = os.path.join(out_dir, f"{name}-s{seed}.json")
        label = f"{name} seed {seed}"
        pid = running_pid(path)
        if os.path.exists(path):
            print(f"compare: reusing {os.path.relpath(path)}", flush=True)
        elif pid is not None:
            print(f"compare: waiting for {label} (process {pid})", flush=True)
            running.append((lambda path=path: None if running_pid(path) else 0, None, label, path))
        else:
            pending.append((arguments + ["--seed", str(seed)], label, path))
    failed = []
    while pending or running:
        while pending and len(running) < jobs:
            arguments, label, path = pending.pop(0)
            log = open(path[: -len(".json")] + ".log", "w")
            cmd = [sys.executable, LM, *arguments, "--out", path,
                   "--data-cache", os.path.join(ROOT, "build", "kjv.txt")] + extra
            print(f"compare: starting {label} (log {os.path.relpath(log.name)})", flush=True)
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            with open(path[: -len(".json")] + ".pid", "w") as f:
                f.write(str(proc.pid))
            running.append((proc.poll, log, label, path))
        time.sleep(1)
        for entry in list(running):
            poll, log, label, path = entry
            status = poll()
            if status is None:
                continue
            running.remove(entry)
            if log:
                log.close()
            if status != 0 or not os.path.exists(path):
                failed.append(f"{label} (see {path[: -len('.json')]}.log)")
            print(f"compare: {label} finished"
                  + ("" if os.path.exists(path) else " without a result file"), flush=True)
    if failed:
        sys.exit("compare: runs failed: " + ", ".join(failed))


def load_runs(runs_dir):
    """{(configuration name, seed): record} of every result file in `runs_dir`."""
    records = {}
    for file in sorted(os.listdir(runs_dir)):
        if file.endswith(".json"):
            with open(os.path.join(runs_dir, file)) as f:
                record = json.load(f)
            name, _, seed = file[: -len(".json")].rpartition("-s")
            records[(name, int(seed))] = record
    return records


def fmt_time(seconds):
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def mean_spread(values):
    """Mean and half the spread of `values`."""
    return sum(values) / len(values), (max(values) - min(values)) / 2


def describe_setup(record):
    cfg = record["config"]
    return [
        f"Byte-level decoder-only transformer without positional embedding: {cfg['layers']} layers, "
        f"d_model {cfg['d_model']}, {cfg['heads']} heads of dimension {cfg['d_model'] // cfg['heads']}, "
        f"MLP 4x, tied embeddings, {record['parameters']:,} parameters. "
        f"Trained on the King James Bible (Debian's bible-kjv, verse references stripped, first 90% of "
        f"the bytes) for {cfg['steps']} steps of {cfg['batch']} windows of L bytes (L = 128 unless "
        f"the configuration says otherwise), AdamW (lr {cfg['lr']:g}, {cfg['warmup']} warmup steps, "
        f"cosine to 10%), one thread per run. Same initialisation and data order for every "
        f"configuration of a seed.",
        "",
        f"Validation: the first {cfg['eval_bytes']:,} bytes of the last 10% of the text, cut into "
        f"non-overlapping windows of L, 2L and 4L (the same bytes at every length); loss averaged "
        f"over all positions of every window, in nats per byte; perplexity = exp(loss) per byte. "
        f"Positional LSH in evaluation uses fixed partitions (the module's seed) with the s of the "
        f"end of training.",
        "",
    ]


def page_start(title, records):
    """The title, the generator's line and the set-up of a generated page."""
    return ([f"# {title}", "", "Generated by `examples/python/compare.py` (do not edit by hand).", ""]
            + describe_setup(next(iter(records.values()))))


def write_results(records, path):
    lines = page_start("Training comparison in miniature: every run", records)
    lines += [
        "Times are wall-clock on a 2-core machine shared with other jobs (time per run includes the "
        "evaluations); CPU per step is the process's CPU time for one training step (forward, "
        "backward, optimiser), which sharing disturbs less. Runs marked -march=native used plsh's "
        "Python module compiled for the machine, as `scripts/python.sh` builds it by default.",
        "",
        "Attention: `none` = plsh.torch.exact_alibi_attention with slopes 0; `alibi` = "
        "plsh.torch.exact_alibi_attention, standard slopes; `plsh-…` = plsh.torch.AlibiAttention"
        "(method=\"plsh\"), fresh partitions every training step; `fixed` = causal attention within "
        "blocks of 64 tokens (positions 0-63, 64-127, … of a window: the same blocks of text at "
        "every evaluation length, so the same loss).",
        "",
        "| configuration | seed | evaluated with | loss @L | ppl @L | loss @2L | loss @4L "
        "| time per run | time per step | CPU per step | module build |",
        "|" + "---|" * 11,
    ]
    for (name, seed), r in sorted(records.items()):
        length = r["config"]["length"]
        for method, losses in r["eval"].items():
            l1, l2, l4 = (losses[str(length * m)] for m in (1, 2, 4))
            lines.append(
                f"| {name} | {seed} | {LABELS.get(method, method)} | {l1:.4f} | {math.exp(l1):.3f} | "
                f"{l2:.4f} | {l4:.4f} | {fmt_time(r['seconds_total'])} | "
                f"{r['seconds_per_step'] * 1000:.0f} ms | {r['cpu_seconds_per_step'] * 1000:.0f} ms | "
                f"{r.get('note') or 'scripts/python.sh'} |")
    lines += ["", "The paper's figures for comparison (Qwen3-0.6B from scratch at 8k context, "
              "Wikitext-103 perplexity per token): "
              + ", ".join(f"{label} {ppl}" for label, ppl in PAPER) + ".", "",
              "![validation loss](curves.png)", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def gap_rows(records):
    """One row per Positional LSH configuration with an ALiBi baseline at its length: the gap to
    ALiBi per seed (same initialisation and data) at the training length, evaluated as trained
    and with exact ALiBi, and the CPU time per step."""
    rows = []
    names = sorted({name for name, _ in records if name.startswith("plsh")})
    for name in names:
        seeds = sorted(s for n, s in records if n == name)
        length = records[(name, seeds[0])]["config"]["length"]
        alibi = "alibi" + suffix(length)
        paired = [s for s in seeds if (alibi, s) in records]
        if not paired:
            continue
        key = str(length)
        as_trained = [records[(name, s)]["eval"]["plsh"][key] - records[(alibi, s)]["eval"]["alibi"][key]
                      for s in paired]
        exact = [records[(name, s)]["eval"]["alibi"][key] - records[(alibi, s)]["eval"]["alibi"][key]
                 for s in paired]
        cpu = [records[(name, s)]["cpu_seconds_per_step"] for s in paired]
        alibi_cpu = [records[(alibi, s)]["cpu_seconds_per_step"] for s in paired]
        rows.append({"name": name, "label": LABELS.get(name, name), "length": length,
                     "seeds": paired, "as_trained": mean_spread(as_trained),
                     "exact": mean_spread(exact), "cpu": sum(cpu) / len(cpu),
                     "alibi_cpu": sum(alibi_cpu) / len(alibi_cpu),
                     "samples": records[(name, seeds[0])]["config"]["samples"],
                     "final": records[(name, seeds[0])]["config"].get("samples_final") or 0,
                     "sampling": records[(name, seeds[0])]["config"].get("sampling", "independent")})
    return rows


def fit_power_law(points):
    """Least squares of log gap = log a - p log s over (s, gap > 0); returns (a, p) or None."""
    points = [(s, g) for s, g in points if g > 0]
    if len(points) < 2:
        return None
    xs = [math.log(s) for s, _ in points]
    ys = [math.log(g) for _, g in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return math.exp(my - slope * mx), -slope


def write_study(records, path):
    rows = gap_rows(records)
    lines = page_start("Training with Positional LSH: the gap to ALiBi", records)
    lines += [
        "Gap: the validation loss of the Positional LSH model minus that of the ALiBi model of the "
        "same seed (same initialisation and data order), at the training length L, in nats per "
        "byte; mean over the seeds ± half their spread. *As trained*: evaluated with Positional "
        "LSH (fixed partitions); *exact ALiBi*: the same weights evaluated with exact ALiBi. The "
        f"paper's gap is +0.7% perplexity, {PAPER_GAP:.4f} nats. CPU per step: the process's CPU "
        "time for one training step (one thread), mean over the seeds; the ratio is to Positional "
        "LSH s = 20 with independent draws at the same L.",
        "",
        "| configuration | L | seeds | gap, as trained | gap, exact ALiBi | CPU per step | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["length"], r["as_trained"][0])):
        # The reference of the ratio: independent s = 20 at the same length (not a near-field
        # variant, whose name starts alike).
        base_name = plsh_config(20, length=r["length"])[0]
        base = next((x for x in rows if x["name"] == base_name), None)
        ratio = f"{r['cpu'] / base['cpu']:.2f}" if base else "–"
        lines.append(
            f"| {r['label']} | {r['length']} | {', '.join(map(str, r['seeds']))} | "
            f"{r['as_trained'][0]:+.4f} ± {r['as_trained'][1]:.4f} | "
            f"{r['exact'][0]:+.4f} ± {r['exact'][1]:.4f} | {r['cpu'] * 1000:.0f} ms | {ratio} |")
    alibi_cpu = {r["length"]: r["alibi_cpu"] for r in rows}
    lines += ["", "Exact ALiBi's CPU per step: "
              + ", ".join(f"{cpu * 1000:.0f} ms at L = {length}"
                          for length, cpu in sorted(alibi_cpu.items())) + ".", ""]
    independent = [(r["samples"], r["as_trained"][0]) for r in rows
                   if r["length"] == 128 and not r["final"] and r["sampling"] == "independent"]
    fit = fit_power_law(independent)
    if fit:
        a, p = fit
        needed = (a / PAPER_GAP) ** (1 / p) if p > 0 else math.inf
        lines += [f"A power law through the independent draws at L = 128 (as trained): gap ≈ "
                  f"{a:.3f} · s^-{p:.2f}; the paper's {PAPER_GAP:.4f} nats would take s ≈ "
                  f"{needed:.0f} on this trend.", ""]
    lines += ["![gap against time per step](gap.png)", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return rows


def pyplot():
    try:
        import matplotlib
    except ImportError:
        sys.exit("compare.py: the plots need matplotlib; install it with: "
                 "apt-get install python3-matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_gap_plot(rows, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in rows:
        marker = "o" if r["length"] == 128 else "s"
        for key, color, label in (("as_trained", "tab:red", "as trained"),
                                  ("exact", "tab:blue", "evaluated with exact ALiBi")):
            mean, spread = r[key]
            ax.errorbar(r["cpu"] * 1000, mean, yerr=spread, fmt=marker, color=color, capsize=3,
                        label=f"{label}, L = {r['length']}")
        ax.annotate(r["label"].replace("Positional LSH ", "") + f" (L={r['length']})",
                    (r["cpu"] * 1000, r["as_trained"][0]), textcoords="offset points",
                    xytext=(5, 3), fontsize=7)
    ax.axhline(PAPER_GAP, color="gray", linestyle="--", label="the paper's gap (+0.7% perplexity)")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xlabel("CPU time per training step (ms, one thread)")
    ax.set_ylabel("validation loss minus ALiBi's (nats/byte)")
    ax.set_title("Positional LSH training: gap to exact ALiBi against time per step")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_curves(records, path):
    plt = pyplot()
    colors = {"none": "tab:gray", "alibi": "tab:blue", "fixed": "tab:green"}
    styles = {1: "-", 2: "--", 3: ":"}
    fig, ax = plt.subplots(figsize=(10, 5))
    shown = [k for k in records if records[k]["config"]["length"] == 128
             and (k[0] in colors or k[0] == "plsh-n20-independent")]
    for name, seed in sorted(shown):
        steps, losses = zip(*records[(name, seed)]["curve"])
        ax.plot(steps, losses, styles.get(seed, "-."), color=colors.get(name, "tab:red"),
                label=f"{LABELS.get(name, name)}, seed {seed}")
    ax.set_xlabel("training step")
    ax.set_ylabel("validation loss at L = 128 (nats/byte)")
    ax.set_title("Byte-level LM on the King James Bible, attention variants")
    low = min(min(x for _, x in records[k]["curve"]) for k in shown)
    ax.set_ylim(low - 0.05, low + 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def quick(extra, jobs, env):
    start = time.time()
    configs = [baseline(v, v) for v in ("none", "alibi", "fixed")]
    configs += [plsh_config(20), plsh_config(5, "latin_hypercube", samples_final=20),
                plsh_config(20, "latin_hypercube", near=0.05)]
    with tempfile.TemporaryDirectory() as tmp:
        run_all([(name, 1, arguments) for name, arguments, _ in configs], tmp, QUICK + extra,
                jobs, env)
        records = load_runs(tmp)
    bad = []
    for (name, _), r in sorted(records.items()):
        drop = r["train_loss_first"] - r["train_loss_last"]
        print(f"compare --quick: {name}: training loss {r['train_loss_first']:.3f} -> "
              f"{r['train_loss_last']:.3f}, {r['seconds_per_step'] * 1000:.0f} ms/step")
        if not drop >= 0.5:
            bad.append(name)
    if len(records) != len(configs):
        bad.append("missing results")
    if bad:
        print(f"compare --quick: FAILED, the loss did not fall by 0.5 for {', '.join(bad)}")
        sys.exit(1)
    print(f"compare --quick: OK, the loss fell for every configuration ({time.time() - start:.0f} s)")


def main():
    p = argparse.ArgumentParser(description="Train every configuration and tabulate the results.")
    p.add_argument("--quick", action="store_true", help="tiny model, 50 steps, checks the loss falls")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (each uses one thread)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "training"))
    p.add_argument("--report-only", action="store_true", help="only rewrite the tables and plots")
    args, extra = p.parse_known_args()

    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.quick:
        quick(extra, args.jobs, env)
        return
    runs_dir = os.path.join(args.out, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    if not args.report_only:
        run_all([(name, seed, arguments) for (name, arguments, _), seeds in CONFIGS
                 for seed in seeds], runs_dir, extra, args.jobs, env)
    records = load_runs(runs_dir)
    if not records:
        sys.exit(f"compare: no results in {runs_dir}")
    write_results(records, os.path.join(args.out, "results.md"))
    write_curves(records, os.path.join(args.out, "curves.png"))
    rows = write_study(records, os.path.join(args.out, "study.md"))
    write_gap_plot(rows, os.path.join(args.out, "gap.png"))
    print(f"compare: wrote results.md, curves.png, study.md and gap.png in "
          f"{os.path.relpath(args.out)} from {len(records)} runs")


if __name__ == "__main__":
    main()
