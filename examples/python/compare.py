"""The training comparison in miniature: every attention variant, one command.

Runs examples/python/lm.py for each (variant, seed) whose result file is missing from
docs/training/runs/ (two runs at a time by default, one thread each), then writes
docs/training/results.md (the table) and docs/training/curves.png (validation loss against
step, one line per run). Finished runs are reused; delete a run's JSON file to redo it.

From the repository root:
  bash scripts/python.sh build
  PYTHONPATH=build/python /usr/bin/python3 examples/python/compare.py            # full (about 70 min on 2 cores)
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

# In start order: the slow exact-kernel runs early, the cheap fixed-block runs last.
RUNS = [("alibi", 1), ("plsh", 1), ("alibi", 2), ("none", 1), ("plsh", 2), ("fixed", 1)]
QUICK = ["--layers", "2", "--d-model", "64", "--heads", "4", "--length", "64", "--batch", "8",
         "--steps", "50", "--warmup", "5", "--eval-every", "25", "--log-every", "25",
         "--curve-bytes", "4096", "--eval-bytes", "8192"]
# The paper's figures (Qwen3-0.6B from scratch, 8k context, Wikitext-103 perplexity).
PAPER = [("ALiBi", 18.92), ("Positional LSH, s = 20", 19.05), ("fixed blocks", 19.79),
         ("no positional bias", 20.21)]
NAMES = {"none": "no bias", "alibi": "exact ALiBi", "plsh": "Positional LSH s=20",
         "fixed": "fixed blocks 64"}


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
    """Starts the missing runs, at most `jobs` at once; returns the result file of each run.

    A run whose result file exists is reused. A run still going in a process started by an
    earlier invocation (its .pid file names a live lm.py writing that result) is waited for,
    counted among the `jobs`, not started again.
    """
    files = {}
    pending = []
    running = []  # (poll function, log file or None, variant, seed, path)
    for variant, seed in runs:
        path = os.path.join(out_dir, f"{variant}-s{seed}.json")
        files[(variant, seed)] = path
        pid = running_pid(path)
        if os.path.exists(path):
            print(f"compare: reusing {os.path.relpath(path)}", flush=True)
        elif pid is not None:
            print(f"compare: waiting for {variant} seed {seed} (process {pid})", flush=True)
            running.append((lambda path=path: None if running_pid(path) else 0, None, variant, seed, path))
        else:
            pending.append((variant, seed, path))
    failed = []
    while pending or running:
        while pending and len(running) < jobs:
            variant, seed, path = pending.pop(0)
            log = open(path[: -len(".json")] + ".log", "w")
            cmd = [sys.executable, LM, "--variant", variant, "--seed", str(seed), "--out", path,
                   "--data-cache", os.path.join(ROOT, "build", "kjv.txt")] + extra
            print(f"compare: starting {variant} seed {seed} (log {os.path.relpath(log.name)})", flush=True)
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            with open(path[: -len(".json")] + ".pid", "w") as f:
                f.write(str(proc.pid))
            running.append((proc.poll, log, variant, seed, path))
        time.sleep(1)
        for entry in list(running):
            poll, log, variant, seed, path = entry
            status = poll()
            if status is None:
                continue
            running.remove(entry)
            if log:
                log.close()
            if status != 0 or not os.path.exists(path):
                failed.append(f"{variant} seed {seed} (see {path[: -len('.json')]}.log)")
            print(f"compare: {variant} seed {seed} finished"
                  + ("" if os.path.exists(path) else " without a result file"), flush=True)
    if failed:
        sys.exit("compare: runs failed: " + ", ".join(failed))
    return files


def load(files):
    records = []
    for path in files.values():
        with open(path) as f:
            records.append(json.load(f))
    return records


def fmt_time(seconds):
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def write_table(records, path):
    cfg = records[0]["config"]
    length = cfg["length"]
    lengths = [str(length * m) for m in (1, 2, 4)]
    fixed_impl = {r["fixed_block_impl"] for r in records if r["variant"] == "fixed"}
    lines = [
        "# Training comparison in miniature",
        "",
        "Generated by `examples/python/compare.py` (do not edit by hand).",
        "",
        f"Byte-level decoder-only transformer without positional embedding: {cfg['layers']} layers, "
        f"d_model {cfg['d_model']}, {cfg['heads']} heads of dimension {cfg['d_model'] // cfg['heads']}, "
        f"MLP 4x, tied embeddings, {records[0]['parameters']:,} parameters. "
        f"Trained on the King James Bible (Debian's bible-kjv, verse references stripped, first 90% of "
        f"the bytes) for {cfg['steps']} steps of {cfg['batch']} windows of L = {length} bytes, AdamW "
        f"(lr {cfg['lr']:g}, {cfg['warmup']} warmup steps, cosine to 10%), one thread per run. "
        f"Same initialisation and data order for every variant of a seed.",
        "",
        f"Validation: the first {cfg['eval_bytes']:,} bytes of the last 10% of the text, cut into "
        f"non-overlapping windows of L, 2L and 4L (the same bytes at every length); loss averaged "
        f"over all positions of every window, in nats per byte; perplexity = exp(loss) per byte. "
        f"Positional LSH in evaluation uses fixed partitions (s = {cfg['samples']}).",
        "",
        "Times are wall-clock on a 2-core machine shared with other jobs (builds of other work), "
        "several runs side by side with one thread each (`--jobs`; time per run includes the "
        "evaluations); CPU per step is the process's CPU time for one training step (forward, "
        "backward, optimiser), which the sharing disturbs less. Module build: runs marked -march=native used "
        "plsh's Python module compiled for this machine, as `scripts/python.sh` builds it by "
        "default (a portable build, `PLSH_NATIVE=0`, changes rounding and speed, not the model, "
        "data or kernels).",
        "",
        "Attention: `none` = plsh.torch.exact_alibi_attention with slopes 0; `alibi` = "
        "plsh.torch.exact_alibi_attention, standard slopes; `plsh` = plsh.torch.AlibiAttention"
        "(method=\"plsh\"), fresh partitions every training step; `fixed` = causal attention within "
        "blocks of " + str(cfg["block_size"]) + " tokens, "
        + ("plsh.torch.fixed_block_attention." if fixed_impl == {"plsh"}
           else "pure PyTorch (dense within each block; plsh.torch had no fixed_block_attention "
                "with a backward when these runs were made).")
        + " Blocks are positions 0-63, 64-127, ... of a window, and the windows of every length "
          "tile the same validation bytes from its start, so the fixed-block model sees the same "
          "blocks of text at L, 2L and 4L and its loss is the same at every length.",
        "",
        "| variant | seed | trained with | evaluated with | "
        + " | ".join(f"loss @{n} | ppl @{n}" for n in lengths)
        + " | time per run | time per step | CPU per step | module build |",
        "|" + "---|" * (4 + 2 * len(lengths) + 4),
    ]
    order = {v: i for i, v in enumerate(("none", "alibi", "plsh", "fixed"))}
    records = sorted(records, key=lambda r: (order[r["variant"]], r["seed"]))
    for r in records:
        for method, losses in r["eval"].items():
            cells = " | ".join(f"{losses[n]:.4f} | {math.exp(losses[n]):.3f}" for n in lengths)
            lines.append(
                f"| {r['variant']} | {r['seed']} | {NAMES[r['variant']]} | {NAMES[method]} | {cells} | "
                f"{fmt_time(r['seconds_total'])} | {r['seconds_per_step'] * 1000:.0f} ms | "
                f"{r['cpu_seconds_per_step'] * 1000:.0f} ms | {r.get('note') or 'scripts/python.sh'} |")
    lines += ["", "## Mean over seeds (± half the spread between seeds; perplexity of the mean)", "",
              "| trained with | evaluated with | seeds | " + " | ".join(f"loss @{n}" for n in lengths) + " |",
              "|" + "---|" * (3 + len(lengths))]
    groups = {}
    for r in records:
        for method, losses in r["eval"].items():
            groups.setdefault((r["variant"], method), []).append(losses)
    for (variant, method), items in groups.items():
        cells = []
        for n in lengths:
            values = [x[n] for x in items]
            mean = sum(values) / len(values)
            spread = (max(values) - min(values)) / 2
            cells.append(f"{mean:.4f}" + (f" ± {spread:.4f}" if len(values) > 1 else "")
                         + f" ({math.exp(mean):.3f})")
        lines.append(f"| {NAMES[variant]} | {NAMES[method]} | {len(items)} | " + " | ".join(cells) + " |")
    lines += ["", "The paper's figures for comparison (Qwen3-0.6B from scratch at 8k context, "
              "Wikitext-103 perplexity per token): "
              + ", ".join(f"{name} {ppl}" for name, ppl in PAPER) + ".", "",
              "![validation loss](curves.png)", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def write_curves(records, path):
    try:
        import matplotlib
    except ImportError:
        sys.exit("compare.py: the plot needs matplotlib; install it with: "
                 "apt-get install python3-matplotlib")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"none": "tab:gray", "alibi": "tab:blue", "plsh": "tab:red", "fixed": "tab:green"}
    styles = {1: "-", 2: "--", 3: ":"}
    fig, ax = plt.subplots(figsize=(10, 5))
    for r in sorted(records, key=lambda r: (r["variant"], r["seed"])):
        steps, losses = zip(*r["curve"])
        ax.plot(steps, losses, styles.get(r["seed"], "-."), color=colors[r["variant"]],
                label=f"{NAMES[r['variant']]}, seed {r['seed']}")
    cfg = records[0]["config"]
    ax.set_xlabel("training step")
    ax.set_ylabel(f"validation loss at L = {cfg['length']} (nats/byte)")
    ax.set_title("Byte-level LM on the King James Bible, attention variants")
    low = min(min(x for _, x in r["curve"]) for r in records)
    ax.set_ylim(low - 0.05, low + 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description="Train every attention variant and tabulate the results.")
    p.add_argument("--quick", action="store_true", help="tiny model, 50 steps, checks the loss falls")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (each uses one thread)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "training"))
    p.add_argument("--fixed-seeds", type=int, default=2, help="seeds of the fixed-block variant")
    p.add_argument("--seeds", type=int, default=0,
                   help="seeds 1..N of every variant (default: the runs listed in RUNS)")
    p.add_argument("--report-only", action="store_true", help="only rewrite the table and plot")
    args, extra = p.parse_known_args()

    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.quick:
        start = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            files = run_all([(v, 1) for v in ("none", "alibi", "plsh", "fixed")], tmp,
                            QUICK + extra, args.jobs, env)
            records = load(files)
        bad = []
        for r in records:
            drop = r["train_loss_first"] - r["train_loss_last"]
            print(f"compare --quick: {r['variant']}: training loss {r['train_loss_first']:.3f} -> "
                  f"{r['train_loss_last']:.3f}, {r['seconds_per_step'] * 1000:.0f} ms/step")
            if not drop >= 0.5:
                bad.append(r["variant"])
        if bad:
            print(f"compare --quick: FAILED, the loss did not fall by 0.5 for {', '.join(bad)}")
            sys.exit(1)
        print(f"compare --quick: OK, the loss fell for every variant ({time.time() - start:.0f} s)")
        return

    runs = RUNS + [("fixed", s) for s in range(2, args.fixed_seeds + 1)]
    if args.seeds:
        runs += [(v, s) for s in range(1, args.seeds + 1) for v in ("alibi", "plsh", "none", "fixed")
                 if (v, s) not in runs]
    runs_dir = os.path.join(args.out, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    if not args.report_only:
        run_all(runs, runs_dir, extra, args.jobs, env)
    # The table holds every finished run in the folder (also seeds added with --seeds).
    records = load({name: os.path.join(runs_dir, name) for name in sorted(os.listdir(runs_dir))
                    if name.endswith(".json")})
    if not records:
        sys.exit(f"compare: no results in {runs_dir}")
    write_table(records, os.path.join(args.out, "results.md"))
    write_curves(records, os.path.join(args.out, "curves.png"))
    print(f"compare: wrote {os.path.relpath(os.path.join(args.out, 'results.md'))} and curves.png "
          f"from {len(records)} runs")


if __name__ == "__main__":
    main()
