"""Attention forward + backward from PyTorch: plsh.torch against dense PyTorch ALiBi.

Times one forward and one backward (autograd, gradient of sum(out * g) for a fixed random g)
of causal ALiBi attention, batch 4, 8 heads, head dimension 64, n = 1024 and 4096 tokens,
float32, through
  plsh fused   plsh.torch.plsh_attention, s = 20 partitions (the fused kernel)
  plsh exact   plsh.torch.exact_alibi_attention
  dense torch  the reference as PyTorch users write it: scores = q k^T * scale, minus the ALiBi
               bias m_h * (i - j), causal mask, softmax, product with v; autograd backward
and prints the median time of each, the speed-ups over dense, and the time per training step
of the miniature model of examples/python/lm.py with each kernel (from the result files in
docs/training/runs/, if present).

Threads: 2 (torch.set_num_threads and OMP_NUM_THREADS, which plsh's OpenMP kernels read).
From the repository root, after `bash scripts/python.sh build`:
  PYTHONPATH=build/python /usr/bin/python3 bench/torch_bench.py
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import plsh  # noqa: E402
import plsh.torch as pt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dense_alibi(q, k, v, slopes):
    """Dense causal ALiBi attention, q, k, v [B, T, H, D] -> [B, T, H, D]."""
    n, d = q.shape[1], q.shape[-1]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    scores = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(d))
    pos = torch.arange(n)
    distance = (pos[:, None] - pos[None, :]).to(q.dtype)
    scores = scores - slopes[:, None, None] * distance
    scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def time_forward_backward(fn, q, k, v, g, reps):
    """Median over reps of (forward seconds, backward seconds)."""
    fwd, bwd = [], []
    for _ in range(reps):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        t0 = time.perf_counter()
        out = fn(qq, kk, vv)
        t1 = time.perf_counter()
        out.backward(g)
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
        del out, qq, kk, vv
    return statistics.median(fwd), statistics.median(bwd)


def training_steps():
    rows = []
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "training", "runs", "*.json"))):
        with open(path) as f:
            r = json.load(f)
        rows.append((r["variant"], r["seed"], r["seconds_per_step"], r.get("cpu_seconds_per_step"),
                     r.get("fixed_block_impl")))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=5, help="repetitions of the plsh kernels")
    p.add_argument("--dense-reps", type=int, default=0,
                   help="repetitions of dense (default: 3 at n <= 1024, 1 above)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    slopes_list = plsh.alibi_slopes(args.heads)
    slopes = torch.tensor(slopes_list, dtype=torch.float32)
    methods = [
        ("plsh fused s=20", lambda q, k, v: pt.plsh_attention(q, k, v, slopes_list, causal=True, samples=20)),
        ("plsh exact", lambda q, k, v: pt.exact_alibi_attention(q, k, v, slopes_list, causal=True)),
        ("dense torch", lambda q, k, v: dense_alibi(q, k, v, slopes)),
    ]
    print(f"attention forward + backward, float32, batch {args.batch}, {args.heads} heads, d = {args.dim}, "
          f"causal ALiBi, {torch.get_num_threads()} threads (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}), "
          f"torch {torch.__version__}, median of repetitions")
    print(f"{'n':>6} {'kernel':<16} {'reps':>4} {'forward s':>10} {'backward s':>11} {'total s':>9} {'speed-up':>9}")
    for n in args.sizes:
        gen = torch.Generator().manual_seed(n)
        q, k, v, g = (torch.randn(args.batch, n, args.heads, args.dim, generator=gen) for _ in range(4))
        # sanity: plsh exact equals the dense reference
        with torch.no_grad():
            check = (pt.exact_alibi_attention(q[:1, :256], k[:1, :256], v[:1, :256], slopes_list)
                     - dense_alibi(q[:1, :256], k[:1, :256], v[:1, :256], slopes)).abs().max().item()
        assert check < 1e-4, f"plsh exact differs from dense by {check}"
        times = {}
        for name, fn in methods:
            reps = args.reps
            if name.startswith("dense"):
                reps = args.dense_reps or (3 if n <= 1024 else 1)
            time_forward_backward(fn, q[:, :64], k[:, :64], v[:, :64], g[:, :64], 1)  # warm-up
            fwd, bwd = time_forward_backward(fn, q, k, v, g, reps)
            times[name] = (fwd, bwd, reps)
        dense = sum(times["dense torch"][:2])
        for name, (fwd, bwd, reps) in times.items():
            print(f"{n:>6} {name:<16} {reps:>4} {fwd:>10.3f} {bwd:>11.3f} {fwd + bwd:>9.3f} "
                  f"{dense / (fwd + bwd):>8.1f}x", flush=True)
    rows = training_steps()
    if rows:
        print("\ntime per training step of the miniature model (examples/python/lm.py, 1 thread, "
              "from docs/training/runs/; wall-clock depends on what else ran):")
        for variant, seed, seconds, cpu, impl in rows:
            note = f" (fixed blocks in {impl})" if impl else ""
            cpu = f", {cpu * 1000:.0f} ms CPU" if cpu is not None else ""
            print(f"  {variant:<6} seed {seed}: {seconds * 1000:.0f} ms wall{cpu}{note}")


if __name__ == "__main__":
    main()
