"""A byte-level decoder-only transformer trained with plsh's attention kernels.

The model has no positional embedding: position enters only through the attention, so the
attention variant is the only difference between the runs of one seed (same initialisation,
same data order, same optimiser). Each block's attention layer is
plsh.torch.MultiheadAlibiAttention (q/k/v and output projections) around the dispatcher
Attention below, which runs the variant's kernel. Variants:

  none   plsh.torch.exact_alibi_attention with slopes 0 (plain causal attention, no bias)
  alibi  plsh.torch.exact_alibi_attention with the standard ALiBi slopes (Press et al.)
  plsh   plsh.torch.plsh_attention, s = --samples partitions (default 20) drawn as --sampling says,
         through plsh.torch.AlibiAttention: fresh partitions at every training step, fixed ones
         (the module's seed) in eval mode; with --samples-final, s grows geometrically from
         --samples at the first step to --samples-final at the last (evaluation uses the final s)
  fixed  causal attention within fixed blocks of 64 tokens (plsh.torch.fixed_block_attention
         when the module provides it, otherwise the pure PyTorch block attention below; the
         result file records which one ran)
  truncated  plsh.torch.truncated_alibi_attention: exact ALiBi over the keys whose factor
         exp(-m|i-j|) is at least --truncate-factor (default 0.05), none beyond

Data: the King James Bible as shipped by Debian's bible-kjv package, dumped with
`bible -f gen1:1-rev22:21`, verse references ("Ge1:1 ") stripped, one verse per line;
the first 90% of the bytes train, the last 10% validate.

Training windows are drawn at random offsets from a generator seeded by the run's seed, so
every variant of one seed sees the same windows in the same order. Validation uses a fixed
prefix of the validation text cut into non-overlapping windows of length L, 2L and 4L (the
same bytes at every length); the loss is averaged over all positions of every window, in
nats per byte.

Resuming (--checkpoint FILE): every --checkpoint-minutes of training the run writes the model,
the optimiser, the data-order generator, torch's generator (Positional LSH's partitions are counted
by the modules' buffers, part of the model) and its curves so far to FILE, atomically. Started again
with the same arguments, it goes on from there, and its losses equal those of a run that was never
interrupted, bit for bit (python/tests/test_training_resume.py); the result records how many
processes it took. The checkpoint is removed once the result file is written.

Usage (from the repository root, after `bash scripts/python.sh build`, which installs plsh into
build/python-venv and copies it to build/python):
  PYTHONPATH=build/python /usr/bin/python3 examples/python/lm.py --variant plsh --seed 1 \
      --out docs/training/runs/plsh-s1.json
examples/python/compare.py runs all variants and writes docs/training/.
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

VARIANTS = ("none", "alibi", "plsh", "fixed", "truncated")
VERSE_REFERENCE = re.compile(rb"^[0-9]?[A-Za-z]+[0-9]+:[0-9]+ ", re.MULTILINE)


# ----------------------------------------------------------------------------------- data


def load_bible(cache=None):
    """Returns the King James Bible as bytes, one verse per line, references stripped."""
    if cache and os.path.exists(cache):
        with open(cache, "rb") as f:
            return f.read()
    try:
        raw = subprocess.run(
            ["bible", "-f", "gen1:1-rev22:21"], check=True, capture_output=True
        ).stdout
    except FileNotFoundError:
        sys.exit("lm.py: the `bible` program is missing; install it with: apt-get install bible-kjv")
    text = VERSE_REFERENCE.sub(b"", raw)
    if VERSE_REFERENCE.search(text) or len(text) < 4_000_000:
        sys.exit("lm.py: unexpected output of `bible -f gen1:1-rev22:21`")
    if cache:
        os.makedirs(os.path.dirname(cache) or ".", exist_ok=True)
        with open(cache, "wb") as f:
            f.write(text)
    return text


def split(text):
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = int(len(data) * 0.9)
    return data[:cut], data[cut:]


def validation_windows(valid, length, total):
    """The first `total` validation bytes as non-overlapping windows of `length` (+1 target)."""
    count = total // length
    assert count * length + 1 <= len(valid), "validation text too short"
    x = valid[: count * length].view(count, length)
    y = valid[1 : count * length + 1].view(count, length)
    return x, y


# ---------------------------------------------------------------------------------- model


def fixed_block_attention_torch(q, k, v, block_size):
    """Causal softmax attention within fixed blocks [b*block_size, (b+1)*block_size).

    q, k, v: [B, T, H, D]; pure PyTorch (autograd), cost O(T * block_size * D) per head.
    """
    batch, tokens, heads, dim = q.shape
    pad = (-tokens) % block_size
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    blocks = (tokens + pad) // block_size

    def to_blocks(t):  # [B, T, H, D] -> [B, H, blocks, block, D]
        return t.view(batch, blocks, block_size, heads, dim).permute(0, 3, 1, 2, 4)

    out = _dense_causal(to_blocks(q), to_blocks(k), to_blocks(v))
    out = out.permute(0, 2, 3, 1, 4).reshape(batch, tokens + pad, heads, dim)
    return out[:, :tokens]


def _dense_causal(q, k, v, bias=None):
    """softmax(q k^T / sqrt(d) + bias, causal) v over the last two axes [..., T, D]."""
    tokens = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias
    mask = torch.ones(tokens, tokens, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return scores.softmax(-1) @ v


def dense_alibi_attention_torch(q, k, v, slopes):
    """Dense ALiBi attention in PyTorch, q, k, v [B, T, H, D] (development stand-in only)."""
    tokens = q.shape[1]
    pos = torch.arange(tokens, dtype=q.dtype)
    distance = (pos[:, None] - pos[None, :]).abs()
    bias = -torch.tensor(slopes, dtype=q.dtype)[:, None, None] * distance
    out = _dense_causal(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias)
    return out.transpose(1, 2)


def fixed_block_has_backward(pt):
    """Whether plsh.torch.fixed_block_attention exists and is differentiable."""
    if not hasattr(pt, "fixed_block_attention"):
        return False
    q = torch.zeros(1, 4, 1, 2, requires_grad=True)
    try:
        pt.fixed_block_attention(q, q, q, 2, causal=True).sum().backward()
    except NotImplementedError:
        return False
    return True


class Attention(nn.Module):
    """Dispatches to the attention kernel of `method`; the method can be changed for evaluation.

    backend "plsh" uses plsh.torch (the real kernels); backend "torch" is a dense PyTorch
    stand-in used only to develop and test this script without the module ("plsh" then falls
    back to exact ALiBi).
    """

    def __init__(self, heads, method, layer, run_seed, backend, samples, block_size, sampling,
                 near_factor=0.0, truncate_factor=0.05):
        super().__init__()
        self.heads, self.method, self.backend = heads, method, backend
        self.samples, self.block_size = samples, block_size
        self.truncate_factor = truncate_factor
        self.fixed_impl = "torch"
        if backend == "plsh":
            import plsh
            import plsh.torch as pt

            self.pt = pt
            self.slopes = list(plsh.alibi_slopes(heads))
            # Seeds of different layers are far apart: training forward t of layer l uses
            # seed base + t, and these ranges never overlap.
            base = (run_seed * 64 + layer) * 10_000_000
            self.plsh_module = pt.AlibiAttention(heads, method="plsh", samples=samples,
                                                 seed=base, sampling=sampling,
                                                 near_field=near_factor)
            if fixed_block_has_backward(pt):
                self.fixed_impl = "plsh"
        else:
            self.slopes = [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]

    def forward(self, q, k, v):
        method = self.method
        if method == "fixed":
            if self.fixed_impl == "plsh":
                return self.pt.fixed_block_attention(q, k, v, self.block_size, causal=True)
            return fixed_block_attention_torch(q, k, v, self.block_size)
        if self.backend == "torch":
            slopes = [0.0] * self.heads if method == "none" else self.slopes
            return dense_alibi_attention_torch(q, k, v, slopes)
        if method == "none":
            return self.pt.exact_alibi_attention(q, k, v, [0.0] * self.heads, causal=True)
        if method == "alibi":
            return self.pt.exact_alibi_attention(q, k, v, self.slopes, causal=True)
        if method == "truncated":
            return self.pt.truncated_alibi_attention(q, k, v, self.slopes, self.truncate_factor,
                                                     causal=True)
        if method == "plsh":
            self.plsh_module.train(self.training)
            return self.plsh_module(q, k, v)
        raise ValueError(f"unknown attention method {method!r}")


class Block(nn.Module):
    """Pre-LayerNorm block: x + attn(norm1(x)), then x + mlp(norm2(x)).

    attn is plsh.torch.MultiheadAlibiAttention with the dispatcher `attention` as its attention:
    in_proj_weight [3 d_model, d_model] (q, k, v rows) and out_proj, initialised as nn.Linear
    (the parameters, their order and their initial values of the fused nn.Linear qkv and proj
    that the blocks had before; load_state_dict reads checkpoints with those names too).
    """

    def __init__(self, d_model, heads, attention):
        super().__init__()
        from plsh.torch import MultiheadAlibiAttention

        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = MultiheadAlibiAttention(d_model, heads, attention=attention)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    @property
    def attention(self):
        return self.attn.attention

    def qkv(self, x):
        """The q, k, v projections of x, [..., 3 d_model] (q, then k, then v; qk_dump.py)."""
        return F.linear(x, self.attn.in_proj_weight, self.attn.in_proj_bias)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def checkpointed(block, x):
    """block(x) under activation checkpointing: its activations are recomputed in the backward."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(block, x, use_reentrant=False)


# Checkpoints written before the blocks used MultiheadAlibiAttention.
OLD_KEYS = [(re.compile(r"^(blocks\.[0-9]+\.)qkv\.(weight|bias)$"), r"\1attn.in_proj_\2"),
            (re.compile(r"^(blocks\.[0-9]+\.)proj\."), r"\1attn.out_proj."),
            (re.compile(r"^(blocks\.[0-9]+\.)attention\."), r"\1attn.attention.")]


def rename_old_keys(state_dict, prefix, *unused):
    for key in list(state_dict):
        name = key[len(prefix):]
        for pattern, replacement in OLD_KEYS:
            name = pattern.sub(replacement, name)
        if prefix + name != key:
            state_dict[prefix + name] = state_dict.pop(key)


class ByteLM(nn.Module):
    """Pre-LayerNorm decoder-only transformer over bytes, tied input/output embedding."""

    def __init__(self, args, seed):
        super().__init__()
        torch.manual_seed(seed)  # identical initialisation for every variant of a seed
        self.embed = nn.Embedding(256, args.d_model)
        attentions = [
            Attention(args.heads, args.variant, layer, seed, args.backend, args.samples,
                      args.block_size, args.sampling, args.near_field,
                      getattr(args, "truncate_factor", 0.05))
            for layer in range(args.layers)
        ]
        self.blocks = nn.ModuleList(Block(args.d_model, args.heads, a) for a in attentions)
        self.norm = nn.LayerNorm(args.d_model)
        # Models saved before the option existed rebuild without it.
        self.activation_checkpointing = getattr(args, "activation_checkpointing", False)
        self._register_load_state_dict_pre_hook(rename_old_keys)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        for block in self.blocks:  # scaled residual projections (GPT-2)
            for p in (block.attn.out_proj.weight, block.mlp[2].weight):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * args.layers))

    def attentions(self):
        return [block.attention for block in self.blocks]

    def set_method(self, method):
        for a in self.attentions():
            a.method = method

    def set_samples(self, samples):
        for a in self.attentions():
            if a.backend == "plsh":
                a.plsh_module.samples = samples

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = checkpointed(block, h) if self.activation_checkpointing and self.training else block(h)
        return self.norm(h) @ self.embed.weight.t()


# ----------------------------------------------------------------------------- train/eval


@torch.no_grad()
def evaluate(model, x, y, batch):
    """Mean loss in nats/byte over all positions of all windows."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(x), batch):
        logits = model(x[i : i + batch])
        total += F.cross_entropy(
            logits.reshape(-1, 256), y[i : i + batch].reshape(-1), reduction="sum"
        ).item()
    model.train(was_training)
    return total / y.numel()


def learning_rate(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def samples_at(step, args):
    """Positional LSH draws s at a training step: --samples, or with --samples-final a geometric
    growth from --samples at step 0 to --samples-final at the last step."""
    if not args.samples_final:
        return args.samples
    progress = step / max(1, args.steps - 1)
    return round(args.samples * (args.samples_final / args.samples) ** progress)


def build_optimizer(model, args):
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "embed" not in n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )


# The arguments that do not change what a run computes: a checkpoint resumes under other values.
NOT_COMPUTED = ("out", "data_cache", "note", "save", "checkpoint", "checkpoint_minutes",
                "stop_at_step", "log_every")


def computed_config(args):
    return {k: v for k, v in vars(args).items() if k not in NOT_COMPUTED}


def write_atomically(path, write):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)


def save_training_state(path, model, optimizer, data_rng, progress):
    """Everything the rest of the run depends on, after `progress["step"]` steps."""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "data_rng": data_rng.get_state(), "torch_rng": torch.get_rng_state(),
             "progress": progress}
    write_atomically(path, lambda tmp: torch.save(state, tmp))


def load_training_state(path, model, optimizer, data_rng, args):
    """The progress saved in `path` (None when there is no checkpoint), with the model, optimiser
    and generators restored."""
    if not path or not os.path.exists(path):
        return None
    state = torch.load(path)
    saved = state["progress"]["config"]
    if saved != computed_config(args):
        changed = sorted(k for k in set(saved) | set(computed_config(args))
                         if saved.get(k) != computed_config(args).get(k))
        sys.exit(f"lm.py: the checkpoint {path} belongs to other arguments ({', '.join(changed)});"
                 f" remove it to start again")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    data_rng.set_state(state["data_rng"])
    torch.set_rng_state(state["torch_rng"])
    return state["progress"]


def run(args):
    torch.set_num_threads(args.threads)
    text = load_bible(args.data_cache)
    train, valid = split(text)
    model = ByteLM(args, args.seed)
    fixed_impl = model.attentions()[0].fixed_impl if args.variant == "fixed" else None
    optimizer = build_optimizer(model, args)
    data_rng = torch.Generator().manual_seed(1_000_003 * args.seed + 17)
    curve_x, curve_y = validation_windows(valid, args.length, args.curve_bytes)
    lengths = [args.length * m for m in args.eval_multiples]
    # The run so far: curve entries are (step, validation loss, training CPU seconds, training
    # wall seconds) with the times summed over the steps before the evaluation.
    progress = {"step": 0, "curve": [], "train_losses": [], "step_time": 0.0, "step_cpu": 0.0,
                "seconds": 0.0, "processes": 0, "config": computed_config(args)}
    resumed = load_training_state(args.checkpoint, model, optimizer, data_rng, args)
    if resumed:
        progress = resumed
        print(f"[{args.variant} seed {args.seed}] resuming at step {progress['step']} from "
              f"{args.checkpoint}", flush=True)
    progress["processes"] += 1
    print(f"[{args.variant} seed {args.seed}] {sum(p.numel() for p in model.parameters())} parameters, "
          f"train {len(train)} bytes, valid {len(valid)} bytes", flush=True)

    start = time.time()
    seconds_before = progress["seconds"]
    last_save = time.time()
    curve, train_losses = progress["curve"], progress["train_losses"]
    for step in range(progress["step"], args.steps):
        if step % args.eval_every == 0:
            curve.append((step, evaluate(model, curve_x, curve_y, args.eval_batch),
                          progress["step_cpu"], progress["step_time"]))
        offsets = torch.randint(0, len(train) - args.length - 1, (args.batch,), generator=data_rng)
        window = torch.stack([train[o : o + args.length + 1] for o in offsets.tolist()])
        t0, c0 = time.time(), time.process_time()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        model.set_samples(samples_at(step, args))
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), window[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        progress["step_time"] += time.time() - t0
        progress["step_cpu"] += time.process_time() - c0
        train_losses.append(loss.item())
        progress["step"] = step + 1
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"[{args.variant} seed {args.seed}] step {step} loss {loss.item():.4f} "
                  f"valid {curve[-1][1]:.4f} {progress['step_time'] / (step + 1) * 1000:.0f} ms/step",
                  flush=True)
        stop = args.stop_at_step is not None and step + 1 == args.stop_at_step
        due = time.time() - last_save >= 60 * args.checkpoint_minutes
        if args.checkpoint and (stop or due) and step + 1 < args.steps:
            progress["seconds"] = seconds_before + time.time() - start
            save_training_state(args.checkpoint, model, optimizer, data_rng, progress)
            last_save = time.time()
        if stop:
            print(f"[{args.variant} seed {args.seed}] stopped after step {step} (--stop-at-step)",
                  flush=True)
            return None
    curve.append((args.steps, evaluate(model, curve_x, curve_y, args.eval_batch),
                  progress["step_cpu"], progress["step_time"]))
    train_seconds = seconds_before + time.time() - start

    eval_methods = [args.variant]
    if args.variant in ("plsh", "truncated"):
        eval_methods.append("alibi")
    elif args.variant == "alibi":
        eval_methods.append("plsh")
    results = {}
    for method in eval_methods:
        if method == "plsh" and args.backend == "torch":
            continue
        model.set_method(method)
        results[method] = {}
        for length in lengths:
            x, y = validation_windows(valid, length, args.eval_bytes)
            loss = evaluate(model, x, y, max(1, args.eval_batch * args.length // length))
            results[method][str(length)] = loss
            print(f"[{args.variant} seed {args.seed}] eval {method} at {length}: {loss:.4f} nats/byte, "
                  f"perplexity {math.exp(loss):.3f}", flush=True)
    model.set_method(args.variant)

    record = {
        "variant": args.variant,
        "seed": args.seed,
        "backend": args.backend,
        "fixed_block_impl": fixed_impl,
        "config": {k: v for k, v in vars(args).items()
                   if k not in ("out", "data_cache", "note", "checkpoint", "stop_at_step")},
        "parameters": sum(p.numel() for p in model.parameters()),
        "curve": curve,
        "train_losses": train_losses,
        "train_loss_first": sum(train_losses[:10]) / len(train_losses[:10]),
        "train_loss_last": sum(train_losses[-10:]) / len(train_losses[-10:]),
        "eval": results,
        "seconds_total": seconds_before + time.time() - start,
        "seconds_train": train_seconds,
        "seconds_per_step": progress["step_time"] / args.steps,
        "cpu_seconds_per_step": progress["step_cpu"] / args.steps,
        "processes": progress["processes"],
        "torch": torch.__version__,
        "plsh_module": plsh_module_file(args.backend),
        "note": args.note,
    }
    if args.save:
        save_checkpoint(model, args)
    if args.out:
        write_atomically(args.out, lambda tmp: json.dump(record, open(tmp, "w"), indent=1))
    if args.checkpoint and os.path.exists(args.checkpoint):
        os.remove(args.checkpoint)
    return record


def save_checkpoint(model, args):
    """Writes the trained weights and the arguments that rebuild the model (see qk_dump.py)."""
    os.makedirs(os.path.dirname(args.save) or ".", exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in NOT_COMPUTED}
    torch.save({"state_dict": model.state_dict(), "config": config}, args.save)


def plsh_module_file(backend):
    if backend != "plsh":
        return None
    import plsh

    return os.path.dirname(os.path.abspath(plsh.__file__))


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--backend", choices=("plsh", "torch"), default="plsh",
                   help="plsh: the plsh.torch kernels (default); torch: dense PyTorch stand-in "
                        "for development only")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=96)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--length", type=int, default=128, help="training length L")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--samples", type=int, default=20, help="Positional LSH partitions s")
    p.add_argument("--sampling", choices=("independent", "latin_hypercube"), default="independent",
                   help="how the Positional LSH partitions of a head are drawn")
    p.add_argument("--near-field", type=float, default=0.0,
                   help="exact ALiBi factor where it is at least this, Positional LSH beyond "
                        "(PlshOptions::near_field; 0: plain Positional LSH)")
    p.add_argument("--samples-final", type=int, default=0,
                   help="if set, s grows geometrically from --samples to this over the training")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-batch", type=int, default=32)
    p.add_argument("--curve-bytes", type=int, default=16384, help="validation bytes for the curves")
    p.add_argument("--eval-bytes", type=int, default=131072, help="validation bytes for the table")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data-cache", default=None, help="cache file for the stripped text")
    p.add_argument("--out", default=None, help="JSON result file")
    p.add_argument("--note", default="", help="free text stored in the result file (e.g. the build)")
    p.add_argument("--save", default=None,
                   help="file for the trained weights (torch.save; read by qk_dump.py)")
    p.add_argument("--truncate-factor", type=float, default=0.05,
                   help="variant truncated: keep the keys whose ALiBi factor is at least this")
    p.add_argument("--eval-multiples", type=lambda text: [int(m) for m in text.split(",")],
                   default=[1, 2, 4], help="validation lengths as multiples of L (default 1,2,4)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in the backward "
                        "(torch.utils.checkpoint)")
    p.add_argument("--checkpoint", default=None,
                   help="training-state file: written every --checkpoint-minutes, resumed from "
                        "when it exists, removed at the end")
    p.add_argument("--checkpoint-minutes", type=float, default=5.0)
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="write the checkpoint after this many steps and exit (tests of resuming)")
    return p


if __name__ == "__main__":
    run(parser().parse_args())
