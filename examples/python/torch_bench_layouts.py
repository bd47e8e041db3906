"""Attention forward + backward from PyTorch in both layouts: plsh.torch against dense PyTorch.

bench/torch_bench.py times plsh.torch in FlashAttention's layout [B, T, H, D]; this script times
the same kernels in both layouts, layout="bthd" and PyTorch SDPA's layout="bhtd" ([B, H, T, D],
read through strides, gradients returned in that layout), each against the dense reference of
that layout: scores = q k^T / sqrt(d) minus the ALiBi bias m_h (i - j), causal mask, softmax,
product with v, autograd backward. Causal ALiBi, float32, batch 4, 8 heads, d = 64, n = 4096 by
default; one run of each (--reps for more, the median is printed), after a warm-up at 64 tokens.

Threads: 2 (torch.set_num_threads and OMP_NUM_THREADS, which plsh's OpenMP kernels read).
From the repository root, after `bash scripts/python.sh build`:
  build/python-venv/bin/python examples/python/torch_bench_layouts.py
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import plsh  # noqa: E402
import plsh.torch as pt  # noqa: E402


def dense_alibi(q, k, v, slopes, layout):
    """Dense causal ALiBi attention in PyTorch, q, k, v in `layout`, output in `layout`."""
    if layout == "bthd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D] views
    n, d = q.shape[2], q.shape[3]
    scores = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(d))
    position = torch.arange(n)
    distance = (position[:, None] - position[None, :]).to(q.dtype)
    scores = scores - slopes[:, None, None] * distance
    scores = scores.masked_fill(position[None, :] > position[:, None], float("-inf"))
    out = scores.softmax(-1) @ v
    return out.transpose(1, 2) if layout == "bthd" else out


def seconds(fn, q, k, v, g, reps):
    """Median over reps of the forward + backward seconds."""
    times = []
    for _ in range(reps):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        start = time.perf_counter()
        fn(*leaves).backward(g)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    slopes_list = plsh.alibi_slopes(args.heads)
    slopes = torch.tensor(slopes_list)
    print(f"attention forward + backward, float32, batch {args.batch}, n = {args.n}, "
          f"{args.heads} heads, d = {args.dim}, causal ALiBi, {torch.get_num_threads()} threads "
          f"(OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}), torch {torch.__version__}, plsh "
          f"{plsh.__version__}, median of {args.reps}")
    print(f"{'layout':<7} {'kernel':<16} {'seconds':>8} {'speed-up':>9}")
    generator = torch.Generator().manual_seed(args.n)
    shape = (args.batch, args.n, args.heads, args.dim)
    tensors = [torch.randn(*shape, generator=generator) for _ in range(4)]
    for layout in ("bthd", "bhtd"):
        q, k, v, g = tensors if layout == "bthd" else [t.transpose(1, 2).contiguous()
                                                       for t in tensors]
        methods = [
            ("plsh fused s=20", lambda q, k, v: pt.plsh_attention(q, k, v, samples=20,
                                                                 layout=layout)),
            ("plsh exact", lambda q, k, v: pt.exact_alibi_attention(q, k, v, layout=layout)),
            ("dense torch", lambda q, k, v: dense_alibi(q, k, v, slopes, layout)),
        ]
        small = [t[:, :, :64] if layout == "bhtd" else t[:, :64] for t in (q, k, v, g)]
        with torch.no_grad():
            error = (methods[1][1](*small[:3]) - methods[2][1](*small[:3])).abs().max().item()
        assert error < 1e-4, f"plsh exact differs from dense by {error}"
        times = {}
        for name, fn in methods:
            seconds(fn, *small, 1)  # warm-up
            times[name] = seconds(fn, q, k, v, g, args.reps)
        for name, value in times.items():
            print(f"{layout:<7} {name:<16} {value:>8.3f} {times['dense torch'] / value:>8.1f}x",
                  flush=True)


if __name__ == "__main__":
    main()
