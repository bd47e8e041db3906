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

The long-context study (--long; docs/training/long.md and long.png): a larger model (2 layers,
d_model 256, 8 heads of dimension 32) at L = 2048 and 8192, each configuration of LONG_CONFIGS with
two seeds, one run at a time by default. It is meant to run in the background across many
interruptions:
  PYTHONPATH=build/python /usr/bin/python3 examples/python/compare.py --long   # starts or resumes
  PYTHONPATH=build/python /usr/bin/python3 examples/python/compare.py --status # what is complete
Its runs use a copy of the built module in the state folder (--state, default
~/.cache/plsh/training-study: module/, checkpoints/), so rebuilding the module does not touch them;
each run writes a checkpoint every few minutes there and resumes from it when started again
(lm.py --checkpoint). A run is complete when its JSON result exists in docs/training/long-runs/.
"""

import argparse
import json
import math
import os
import shutil
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
# The long-context study: the model, and per training length the batch and the steps.
LONG_MODEL = ["--d-model", "256", "--heads", "8", "--layers", "2", "--warmup", "40",
              "--eval-every", "50", "--log-every", "10", "--curve-bytes", "16384",
              "--eval-bytes", "131072", "--eval-multiples", "1,2"]
LONG_LENGTHS = {2048: ["--batch", "2", "--steps", "400"], 8192: ["--batch", "1", "--steps", "300"]}


def long_configs(length):
    """(name, lm.py arguments, label) of each configuration of the long study at `length`."""
    extra = ["--length", str(length)] + LONG_LENGTHS[length] + LONG_MODEL
    named = [
        ("alibi", ["--variant", "alibi"], "exact ALiBi"),
        ("plsh-defaults", ["--variant", "plsh", "--samples", "100", "--sampling",
                           "latin_hypercube", "--near-field", "0.05"],
         "Positional LSH, the defaults (s=100, Latin hypercube, exact where the factor ≥ 0.05)"),
        ("plsh-paper", ["--variant", "plsh", "--samples", "20", "--sampling", "independent"],
         "Positional LSH, the paper's estimator (s=20, independent)"),
        ("none", ["--variant", "none"], "no positional bias"),
        ("truncated", ["--variant", "truncated", "--truncate-factor", "0.05"],
         "truncated ALiBi (keys whose factor ≥ 0.05)"),
    ]
    return [(f"{name}-L{length}", arguments + extra, label) for name, arguments, label in named]


# In start order: every configuration at 2048, then at 8192.
LONG_CONFIGS = [(config, (1, 2)) for length in LONG_LENGTHS for config in long_configs(length)]
LONG_LABELS = {name: label for (name, _, label), _ in LONG_CONFIGS}
DEFAULT_STATE = os.path.join(os.path.expanduser("~"), ".cache", "plsh", "training-study")

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


def run_all(runs, out_dir, extra, jobs, env, checkpoints=None):
    """Starts the missing runs, at most `jobs` at once; `runs` holds (name, seed, lm.py arguments).

    A run whose result file exists is reused. A run still going in a process started by an
    earlier invocation (its .pid file names a live lm.py writing that result) is waited for,
    counted among the `jobs`, not started again. With `checkpoints` (a folder), each run writes
    its training state there and resumes from it (lm.py --checkpoint); its log is appended to.
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
            log = open(path[: -len(".json")] + ".log", "a" if checkpoints else "w")
            cmd = [sys.executable, LM, *arguments, "--out", path,
                   "--data-cache", os.path.join(ROOT, "build", "kjv.txt")] + extra
            if checkpoints:
                cmd += ["--checkpoint", checkpoint_file(checkpoints, path)]
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


def checkpoint_file(checkpoints, result_path):
    """The training-state file of the run whose result file is `result_path`."""
    return os.path.join(checkpoints, os.path.basename(result_path)[: -len(".json")] + ".pt")


def run_status(runs, out_dir, checkpoints):
    """One line per run: complete, running, resumable (steps done) or not started."""
    import torch

    lines, complete = [], 0
    for name, seed, arguments in runs:
        path = os.path.join(out_dir, f"{name}-s{seed}.json")
        steps = int(arguments[arguments.index("--steps") + 1])
        state = checkpoint_file(checkpoints, path)
        if os.path.exists(path):
            with open(path) as f:
                record = json.load(f)
            complete += 1
            status = (f"complete ({fmt_time(record['seconds_total'])}, "
                      f"{record.get('processes', 1)} process(es))")
        else:
            done = 0
            if os.path.exists(state):
                done = torch.load(state)["progress"]["step"]
            pid = running_pid(path)
            status = (f"running (process {pid}), " if pid else "") + (
                f"{done} of {steps} steps done" if done else "not started")
        lines.append(f"  {name} seed {seed}: {status}")
    print(f"compare: {complete} of {len(runs)} runs complete")
    print("\n".join(lines))
    return complete == len(runs)


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


def long_rows(records):
    """One row per (configuration, L) of the long study: losses at L and 2L as trained, the gaps
    to exact ALiBi of the same seed (as trained, and the weights evaluated with exact ALiBi), CPU
    time per step and the whole run's time, as means over the seeds with half their spread."""
    rows = []
    for (name, _, label), _ in LONG_CONFIGS:
        seeds = sorted(s for n, s in records if n == name)
        if not seeds:
            continue
        first = records[(name, seeds[0])]
        length = first["config"]["length"]
        variant = first["variant"]
        alibi = f"alibi-L{length}"
        paired = [s for s in seeds if (alibi, s) in records]

        def loss(n, s, method, multiple=1):
            return records[(n, s)]["eval"][method][str(length * multiple)]

        row = {"name": name, "label": label, "length": length, "seeds": seeds, "paired": paired,
               "loss": mean_spread([loss(name, s, variant) for s in seeds]),
               "loss2": mean_spread([loss(name, s, variant, 2) for s in seeds]),
               "cpu": mean_spread([records[(name, s)]["cpu_seconds_per_step"] for s in seeds]),
               "run": mean_spread([records[(name, s)]["seconds_total"] for s in seeds])}
        if paired:
            row["gap"] = mean_spread([loss(name, s, variant) - loss(alibi, s, "alibi")
                                      for s in paired])
            row["gap2"] = mean_spread([loss(name, s, variant, 2) - loss(alibi, s, "alibi", 2)
                                       for s in paired])
            if "alibi" in first["eval"] and variant != "alibi":
                row["gap_exact"] = mean_spread([loss(name, s, "alibi") - loss(alibi, s, "alibi")
                                                for s in paired])
        rows.append(row)
    for row in rows:
        exact = next((r for r in rows if r["name"] == f"alibi-L{row['length']}"), None)
        row["speed"] = exact["cpu"][0] / row["cpu"][0] if exact else None
    return rows


def write_long(records, out_dir, runs):
    """docs/training/long.md (the table) and long.png (validation loss against training time)."""
    rows = long_rows(records)
    cfg = next(iter(records.values()))["config"]
    missing = [f"{name} seed {seed}" for name, seed, _ in runs if (name, seed) not in records]
    lines = [
        "# Long context: training at L = 2048 and 8192", "",
        "Generated by `examples/python/compare.py --long` (do not edit by hand).", "",
        f"Byte-level decoder-only transformer without positional embedding, "
        f"{cfg['layers']} layers, d_model {cfg['d_model']}, {cfg['heads']} heads of dimension "
        f"{cfg['d_model'] // cfg['heads']} (standard ALiBi slopes), MLP 4x, tied embeddings, "
        f"{next(iter(records.values()))['parameters']:,} parameters; the King James Bible "
        f"(Debian's bible-kjv); AdamW (lr {cfg['lr']:g}, {cfg['warmup']} warmup steps, cosine to "
        "10%). " + "; ".join(f"L = {length}: {LONG_LENGTHS[length][3]} steps of "
                            + ("1 window" if LONG_LENGTHS[length][1] == "1"
                               else f"{LONG_LENGTHS[length][1]} windows")
                            for length in LONG_LENGTHS)
        + ". One thread per run; same initialisation and data order for every configuration of a "
        "seed. Validation: the first "
        f"{cfg['eval_bytes']:,} bytes of the last 10% of the text in windows of L and 2L, nats per "
        "byte.", "",
        "Gap: the loss minus that of exact ALiBi of the same seed, mean over the seeds ± half "
        f"their spread (the paper's gap is +0.7% perplexity, {PAPER_GAP:.4f} nats); *as trained*: "
        "evaluated with the attention the model was trained with (Positional LSH with fixed "
        "partitions); *exact*: the same weights evaluated with exact ALiBi. CPU per step: the "
        "process's CPU time for one training step (forward, backward, optimiser; one thread); "
        "speed: exact ALiBi's CPU per step over the configuration's. Run: the whole run's wall "
        "time, evaluations included, on a 2-core machine shared with other work.", "",
        "| configuration | L | seeds | loss @L | gap, as trained | gap, exact | loss @2L "
        "| gap @2L | CPU per step | speed | run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def gap(row, key):
        return f"{row[key][0]:+.4f} ± {row[key][1]:.4f}" if key in row else "–"

    for r in sorted(rows, key=lambda r: r["length"]):
        lines.append(
            f"| {r['label']} | {r['length']} | {', '.join(map(str, r['seeds']))} | "
            f"{r['loss'][0]:.4f} | {gap(r, 'gap')} | {gap(r, 'gap_exact')} | {r['loss2'][0]:.4f} | "
            f"{gap(r, 'gap2')} | {r['cpu'][0]:.2f} s | "
            + (f"{r['speed']:.2f}×" if r["speed"] else "–") + f" | {fmt_time(r['run'][0])} |")
    if missing:
        lines += ["", "Runs not yet complete (`compare.py --status`): " + ", ".join(missing) + "."]
    lines += ["", "![validation loss against training time, one panel per L](long.png)", ""]
    with open(os.path.join(out_dir, "long.md"), "w") as f:
        f.write("\n".join(lines))

    plt = pyplot()
    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(7 * len(lengths), 5), squeeze=False)
    colors = ["tab:blue", "tab:red", "tab:orange", "tab:green", "tab:gray"]
    for ax, length in zip(axes[0], lengths):
        for color, ((name, _, label), _) in zip(colors * 2, LONG_CONFIGS):
            if not name.endswith(f"-L{length}"):
                continue
            for seed in (1, 2):
                if (name, seed) not in records:
                    continue
                curve = records[(name, seed)]["curve"]
                ax.plot([c[2] / 60 for c in curve], [c[1] for c in curve],
                        "-" if seed == 1 else "--", color=color,
                        label=f"{label}, seed {seed}")
        ax.set_xlabel("training CPU time (minutes, one thread)")
        ax.set_ylabel(f"validation loss at L = {length} (nats/byte)")
        ax.set_title(f"Time to quality, L = {length}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        low = min(c[1] for (n, s), r in records.items() if n.endswith(f"-L{length}")
                  for c in r["curve"])
        ax.set_ylim(low - 0.05, low + 1.2)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "long.png"), dpi=120)
    return rows


def prepare_module(state, refresh):
    """The folder of the module copy the long runs import (state/module), made from the built
    package that this interpreter imports when it is missing or `refresh` is set."""
    import plsh

    target = os.path.join(state, "module")
    source = os.path.dirname(os.path.abspath(plsh.__file__))
    if refresh or not os.path.isdir(os.path.join(target, "plsh")):
        if os.path.abspath(os.path.join(target, "plsh")) == source:
            return target
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, os.path.join(target, "plsh"))
        print(f"compare: the long runs import a copy of {source} in {target}", flush=True)
    return target


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
    p.add_argument("--jobs", type=int, default=None,
                   help="runs at once, each on one thread (default 2; 1 with --long)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "training"))
    p.add_argument("--report-only", action="store_true", help="only rewrite the tables and plots")
    p.add_argument("--long", action="store_true",
                   help="the long-context study (L = 2048 and 8192) instead of the miniature one")
    p.add_argument("--status", action="store_true",
                   help="list the long study's runs: complete, resumable or not started")
    p.add_argument("--state", default=DEFAULT_STATE,
                   help="the long study's module copy and checkpoints (default %(default)s)")
    p.add_argument("--refresh-module", action="store_true",
                   help="copy the built module into the state folder again")
    args, extra = p.parse_known_args()

    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.jobs is None:
        args.jobs = 1 if args.long else 2
    if args.quick:
        quick(extra, args.jobs, env)
        return
    if args.long or args.status:
        runs_dir = os.path.join(args.out, "long-runs")
        os.makedirs(runs_dir, exist_ok=True)
        checkpoints = os.path.join(args.state, "checkpoints")
        os.makedirs(checkpoints, exist_ok=True)
        runs = [(name, seed, arguments) for (name, arguments, _), seeds in LONG_CONFIGS
                for seed in seeds]
        if args.status:
            run_status(runs, runs_dir, checkpoints)
            return
        if not args.report_only:
            module = prepare_module(args.state, args.refresh_module)
            env["PYTHONPATH"] = module
            run_all(runs, runs_dir, extra, args.jobs, env, checkpoints)
        records = load_runs(runs_dir)
        if not records:
            sys.exit(f"compare: no results in {runs_dir}")
        LABELS.update(LONG_LABELS)
        write_long(records, args.out, runs)
        print(f"compare: wrote long.md and long.png in {os.path.relpath(args.out)} from "
              f"{len(records)} runs")
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
