"""Measures plsh.torch.AlibiKvCache on the miniature model trained with exact ALiBi, for
docs/decoding.md (bench/report.py renders the tables from the JSON this writes).

1. The model of generate.py --variant alibi (examples/python/lm.py, exact ALiBi): loaded from
   --checkpoint, or trained for --steps steps and saved there first.
2. The reference: greedy decoding of --compare-tokens tokens from --prompt with exact ALiBi over
   the whole prefix (generate.ExactBuffers). It also records, per layer, the largest
   |scale| |q| |k| and the smallest logit (generate.Declaration); the caches declare these,
   widened by --margin, as max_score and min_logit.
3. For each of --tolerances: greedy decoding of --context tokens from the same prompt through one
   AlibiKvCache per layer. Recorded: whether the first --compare-tokens tokens equal the
   reference's (else the first that differs), the rows each key/value head holds at contexts
   1024, 2048, ... and --context, the largest bound any step reported and the layer steps whose
   bound exceeded the tolerance, and the median processor time of a token step (the whole
   model) over --timing-steps steps from each of --timing-contexts.
4. Exact decoding over the whole prefix at each of --timing-contexts: the median processor time
   of a token step over --timing-steps steps, from a prefix of random keys and values of that
   length (the time does not depend on their values).

Usage (from the repository root, after `bash scripts/python.sh build`):
  build/python-venv/bin/python examples/python/alibi_cache_study.py \\
      --checkpoint build/lm-alibi.pt --out docs/bench/alibi_model.json
--quick runs small sizes (a check of the script, not figures to publish).
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate  # noqa: E402  (the model, the exact decoder and the caches' steps)


def contexts_up_to(context):
    """1024, 2048, ... below `context`, then `context`."""
    points, point = [], 1024
    while point < context:
        points.append(point)
        point *= 2
    return points + [context]


@torch.no_grad()
def time_exact(model, prompt, context, steps):
    """Median seconds of a token step of exact ALiBi over a prefix of `context` positions."""
    buffers = generate.ExactBuffers(model, context + steps)
    for keys, values in zip(buffers.keys, buffers.values):
        keys[:, :context] = torch.randn_like(keys[:, :context])
        values[:, :context] = torch.randn_like(values[:, :context])
    buffers.position = context
    seconds = []
    for i in range(steps):
        start = time.process_time()
        buffers.step(model, prompt[i % len(prompt)])
        seconds.append(time.process_time() - start)
    return statistics.median(seconds)


@torch.no_grad()
def run_cache(model, prompt, tolerance, declaration, args):
    """Greedy decoding through AlibiKvCache to --context tokens; the figures of step 3."""
    steps = generate.CacheSteps(generate.alibi_caches(model, tolerance, declaration, args.margin))
    checkpoints = contexts_up_to(args.context)
    resident, cache_bytes, timing, timed = {}, {}, {}, {}

    def step(token):
        position = steps.caches[0].position
        start = time.process_time()
        logits = steps.step(model, token)
        elapsed = time.process_time() - start
        for context in args.timing_contexts:
            if context <= position < context + args.timing_steps:
                timed.setdefault(context, []).append(elapsed)
        if position + 1 in checkpoints:
            resident[position + 1] = [cache.resident_per_head for cache in steps.caches]
            cache_bytes[position + 1] = sum(cache.bytes for cache in steps.caches)
        return logits

    start = time.perf_counter()
    text = generate.generate_greedy(model, prompt, args.context - len(prompt) + 1, step)
    seconds = time.perf_counter() - start
    for context, values in timed.items():
        timing[context] = statistics.median(values)
    return text, steps, resident, cache_bytes, timing, seconds


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="build/lm-alibi.pt")
    p.add_argument("--steps", type=int, default=1500, help="training steps when training")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data-cache", default=None, help="cache file of the stripped text (lm.py)")
    p.add_argument("--prompt", default="And God said, ")
    p.add_argument("--compare-tokens", type=int, default=8192)
    p.add_argument("--context", type=int, default=100000)
    p.add_argument("--tolerances", type=float, nargs="+", default=[1e-2, 1e-4, 1e-6])
    p.add_argument("--margin", type=float, default=1.1,
                   help="factor on the reference run's largest score and smallest logit")
    p.add_argument("--timing-contexts", type=int, nargs="+", default=[1024, 8192, 65536])
    p.add_argument("--timing-steps", type=int, default=256)
    p.add_argument("--out", default="docs/bench/alibi_model.json")
    p.add_argument("--quick", action="store_true",
                   help="compare 512 tokens, decode 4096, time at 1024 and 4096")
    args = p.parse_args()
    if args.quick:
        args.compare_tokens, args.context = 512, 4096
        args.timing_contexts, args.timing_steps = [1024, 4000], 16
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    generate_args = argparse.Namespace(checkpoint=args.checkpoint, variant="alibi",
                                       steps=args.steps, threads=args.threads,
                                       data_cache=args.data_cache)
    model, config = generate.train_or_load(generate_args)
    model.set_method("alibi")
    prompt = args.prompt.encode()

    declaration = generate.Declaration(len(model.blocks))
    exact = generate.ExactBuffers(model, len(prompt) + args.compare_tokens, declaration)
    start = time.perf_counter()
    reference = generate.generate_greedy(model, prompt, args.compare_tokens,
                                         lambda token: exact.step(model, token))
    print(f"exact: {args.compare_tokens} tokens in {time.perf_counter() - start:.1f} s; observed "
          f"max_score {declaration.max_score}, min_logit {declaration.min_logit}", flush=True)
    exact_timing = {}
    for context in args.timing_contexts:
        exact_timing[context] = time_exact(model, prompt, context, args.timing_steps)
        print(f"exact at {context}: {exact_timing[context] * 1e6:.0f} us per token", flush=True)

    runs = []
    for tolerance in args.tolerances:
        text, steps, resident, cache_bytes, timing, seconds = run_cache(
            model, prompt, tolerance, declaration, args)
        compared = len(prompt) + args.compare_tokens
        first_difference = next((i - len(prompt) for i in range(len(prompt), compared)
                                 if text[i] != reference[i]), None)
        runs.append({
            "tolerance": tolerance,
            "windows": [cache.windows for cache in steps.caches],
            "resident": {str(c): rows for c, rows in resident.items()},
            "cache_bytes": {str(c): b for c, b in cache_bytes.items()},
            "largest_bound": steps.largest_bound,
            "uncertified_layer_steps": steps.uncertified,
            "layer_steps": steps.steps * len(steps.caches),
            "identical_tokens": first_difference is None,
            "first_difference": first_difference,
            "compared_tokens": args.compare_tokens,
            "seconds_per_token": {str(c): s for c, s in timing.items()},
            "tokens": args.context,
            "total_seconds": seconds,
        })
        print(f"tolerance {tolerance:g}: {args.context} tokens in {seconds:.0f} s, windows "
              f"{runs[-1]['windows']}, largest bound {steps.largest_bound:.3g}, "
              f"{steps.uncertified} uncertified, first difference {first_difference}, "
              f"resident at {args.context}: {resident.get(args.context)}", flush=True)

    result = {
        "command": " ".join(["examples/python/alibi_cache_study.py"] + sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "threads": args.threads,
        "load_average": os.getloadavg()[0],
        "model": {"checkpoint": os.path.basename(args.checkpoint), "steps": config.steps,
                  "layers": config.layers, "d_model": config.d_model, "heads": config.heads,
                  "train_length": config.length,
                  "slopes": model.blocks[0].attention.slopes},
        "prompt": args.prompt,
        "declaration": {"max_score": declaration.max_score,
                        "min_logit": declaration.min_logit, "margin": args.margin},
        "reference_text": reference[len(prompt):len(prompt) + 300].decode("utf-8", "replace"),
        "exact_seconds_per_token": {str(c): s for c, s in exact_timing.items()},
        "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
