"""Generates text with the miniature byte-level model of lm.py, decoding through plsh from torch.

The model (examples/python/lm.py, the King James Bible, blocks of
plsh.torch.MultiheadAlibiAttention) is trained with --variant (Positional LSH with Latin
hypercube draws, the default, or exact ALiBi; --steps steps) and saved to --checkpoint, or loaded
from it when the file exists. It is then loaded into a fresh model and generates text from
--prompt in two ways:

  exact   exact ALiBi, one token at a time, with the keys and values of the past kept as torch
          tensors and plsh.torch.exact_alibi_attention for the new query; every step is checked
          against recomputing the whole prefix with full exact attention (the same next token).
  plsh    Positional LSH through plsh.torch.KvCache, one cache per layer with the draws the
          layer uses in eval mode: the cache forgets the keys no later query can reach, so its
          resident size stays bounded (about (ln s + ln ln s) / m_min tokens) however long the
          text grows (--variant plsh).
  alibi   exact ALiBi through plsh.torch.AlibiKvCache, one cache per layer, greedy, at each of
          --tolerances (--variant alibi): each layer's key/value heads keep windows sized from
          the largest |scale| |q| |k| and the smallest logit of the exact run (the declaration),
          and every step reports a bound on the weight of the keys it dropped. The text is
          compared with the exact run's.

It prints the generated text, tokens per second and the caches' resident tokens and bytes.

Usage (from the repository root, after `bash scripts/python.sh build`):
  build/python-venv/bin/python examples/python/generate.py --checkpoint build/lm-plsh.pt
  build/python-venv/bin/python examples/python/generate.py --variant alibi \
      --checkpoint build/lm-alibi.pt
examples/python/alibi_cache_study.py measures the AlibiKvCache path for docs/decoding.md.
"""

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lm  # noqa: E402  (the model and the data of the training script)

import plsh.torch as pt  # noqa: E402


def train_or_load(args):
    """The checkpoint's model in eval mode, training and saving it first if the file is missing."""
    if not os.path.exists(args.checkpoint):
        train_args = lm.parser().parse_args([
            "--variant", args.variant, "--sampling", "latin_hypercube", "--steps", str(args.steps),
            "--threads", str(args.threads), "--eval-bytes", "16384", "--log-every", "250",
            "--eval-every", "250", "--data-cache", args.data_cache or "", "--save",
            args.checkpoint])
        if not args.data_cache:
            train_args.data_cache = None
        lm.run(train_args)
        print(f"saved {args.checkpoint}")
    checkpoint = torch.load(args.checkpoint)
    config = argparse.Namespace(**checkpoint["config"])
    model = lm.ByteLM(config, config.seed)
    model.load_state_dict(checkpoint["state_dict"])
    print(f"loaded {args.checkpoint}: {sum(p.numel() for p in model.parameters())} parameters, "
          f"trained with {config.variant} ({config.steps} steps)")
    return model.eval(), config


def block_step(block, h, attend):
    """One block on the newest token h [1, 1, d_model]; attend(q, k, v) -> [1, 1, H, D]."""
    q, k, v = block.attn.project(block.norm1(h))
    h = h + block.attn.out_proj(attend(q, k, v).flatten(-2))
    return h + block.mlp(block.norm2(h))


def logits_of(model, h):
    return (model.norm(h) @ model.embed.weight.t())[0, -1]


@torch.no_grad()
def generate_exact(model, prompt, count):
    """Greedy exact-ALiBi generation with a tensor cache, checked at every step against full
    recomputation. Returns (bytes, seconds of the cached steps, seconds of the recomputations)."""
    model.set_method("alibi")
    tokens = list(prompt)
    keys = [[] for _ in model.blocks]
    values = [[] for _ in model.blocks]
    cached_seconds = full_seconds = 0.0
    position = 0
    while len(tokens) < len(prompt) + count:
        start = time.perf_counter()
        # Feed the tokens not yet in the cache one at a time (the prompt, then each new token).
        while position < len(tokens):
            h = model.embed(torch.tensor([[tokens[position]]]))
            for layer, block in enumerate(model.blocks):
                def attend(q, k, v, layer=layer):
                    keys[layer].append(k)
                    values[layer].append(v)
                    return pt.exact_alibi_attention(q, torch.cat(keys[layer], 1),
                                                    torch.cat(values[layer], 1),
                                                    query_position=position)
                h = block_step(block, h, attend)
            position += 1
        cached = int(logits_of(model, h).argmax())
        cached_seconds += time.perf_counter() - start
        start = time.perf_counter()
        full = int(model(torch.tensor([tokens]))[0, -1].argmax())
        full_seconds += time.perf_counter() - start
        if cached != full:
            sys.exit(f"generate.py: FAILED at token {len(tokens)}: the cache gives {cached}, "
                     f"recomputation {full}")
        tokens.append(cached)
    return bytes(tokens), cached_seconds, full_seconds


@torch.no_grad()
def generate_plsh(model, config, prompt, count, temperature, seed):
    """Generation through one plsh.torch.KvCache per layer (the layer's eval-mode draws), sampled
    at `temperature` from a seeded generator. Returns (bytes, seconds, caches)."""
    model.set_method("plsh")
    heads = config.heads
    dim = config.d_model // heads
    caches = []
    for block in model.blocks:
        module = block.attention.plsh_module  # plsh.torch.AlibiAttention
        caches.append(pt.KvCache(heads, heads, dim, dim, module.alibi_slopes,
                                 samples=module.samples, seed=module.seed,
                                 sampling=module.sampling))
    generator = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    start = time.perf_counter()
    position = 0
    while len(tokens) < len(prompt) + count:
        while position < len(tokens):
            h = model.embed(torch.tensor([[tokens[position]]]))
            for block, cache in zip(model.blocks, caches):
                h = block_step(block, h, lambda q, k, v, c=cache: c.decode(q, k, v))
            position += 1
        probabilities = torch.softmax(logits_of(model, h) / temperature, -1)
        tokens.append(int(torch.multinomial(probabilities, 1, generator=generator)))
    return bytes(tokens), time.perf_counter() - start, caches


class Declaration:
    """The largest |scale| |q| |k| and the smallest logit scale q.k seen in each layer (over its
    heads, every query against every earlier key): what AlibiKvCache's max_score and min_logit
    declare."""

    def __init__(self, layers):
        self.max_score = [0.0] * layers
        self.min_logit = [0.0] * layers

    def observe(self, layer, q, keys):
        """q [1, 1, H, D] against keys [1, t, H, D]."""
        scale = 1 / math.sqrt(q.shape[-1])
        norms = keys[0].norm(dim=-1).amax(dim=0)
        score = float((scale * q[0, 0].norm(dim=-1) * norms).max())
        logit = float((scale * torch.einsum("hd,thd->th", q[0, 0], keys[0])).min())
        self.max_score[layer] = max(self.max_score[layer], score)
        self.min_logit[layer] = min(self.min_logit[layer], logit)

    def options(self, layer, margin):
        """max_score and min_logit of a layer, each widened by the factor `margin`."""
        return dict(max_score=margin * self.max_score[layer],
                    min_logit=margin * self.min_logit[layer])


def token_step(model, token, attends):
    """The logits after feeding `token` through the blocks, layer l attending by attends[l]."""
    h = model.embed(torch.tensor([[token]]))
    for block, attend in zip(model.blocks, attends):
        h = block_step(block, h, attend)
    return logits_of(model, h)


class ExactBuffers:
    """Exact ALiBi over the whole prefix from preallocated key and value tensors [1, capacity, H,
    D] per layer (no copy of the past per step), with a Declaration of what it saw."""

    def __init__(self, model, capacity, declaration=None):
        heads = model.blocks[0].heads
        dim = model.embed.weight.shape[1] // heads
        shape = (1, capacity, heads, dim)
        self.keys = [torch.zeros(shape) for _ in model.blocks]
        self.values = [torch.zeros(shape) for _ in model.blocks]
        self.slopes = [block.attention.slopes for block in model.blocks]
        self.declaration = declaration
        self.position = 0

    def attends(self):
        position = self.position

        def attend(q, k, v, layer):
            self.keys[layer][:, position] = k[:, 0]
            self.values[layer][:, position] = v[:, 0]
            keys = self.keys[layer][:, :position + 1]
            if self.declaration is not None:
                self.declaration.observe(layer, q, keys)
            return pt.exact_alibi_attention(q, keys, self.values[layer][:, :position + 1],
                                            self.slopes[layer], query_position=position)

        return [lambda q, k, v, layer=layer: attend(q, k, v, layer)
                for layer in range(len(self.keys))]

    def step(self, model, token):
        logits = token_step(model, token, self.attends())
        self.position += 1
        return logits


@torch.no_grad()
def generate_greedy(model, prompt, count, step):
    """Greedy generation of `count` tokens after `prompt`; step(token) -> logits feeds one token."""
    tokens = list(prompt)
    position = 0
    while len(tokens) < len(prompt) + count:
        while position < len(tokens):
            logits = step(tokens[position])
            position += 1
        tokens.append(int(logits.argmax()))
    return bytes(tokens)


def alibi_caches(model, tolerance, declaration, margin):
    """One plsh.torch.AlibiKvCache per layer, declared from `declaration` widened by `margin`."""
    heads = model.blocks[0].heads
    dim = model.embed.weight.shape[1] // heads
    return [pt.AlibiKvCache(heads, heads, dim, dim, block.attention.slopes, tolerance=tolerance,
                            **declaration.options(layer, margin))
            for layer, block in enumerate(model.blocks)]


class CacheSteps:
    """Steps through AlibiKvCaches, one per layer, keeping the largest bound and the count of
    steps whose bound exceeded the tolerance."""

    def __init__(self, caches):
        self.caches = caches
        self.largest_bound = 0.0
        self.uncertified = 0
        self.steps = 0

    def step(self, model, token):
        logits = token_step(model, token, [cache.decode for cache in self.caches])
        for cache in self.caches:
            self.largest_bound = max(self.largest_bound, cache.bound)
            self.uncertified += 0 if cache.certified else 1
        self.steps += 1
        return logits


def show_alibi_caches(model, prompt, args):
    """The exact text through ExactBuffers, then the same through AlibiKvCache at each tolerance."""
    declaration = Declaration(len(model.blocks))
    exact = ExactBuffers(model, len(prompt) + args.exact_tokens, declaration)
    model.set_method("alibi")
    reference = generate_greedy(model, prompt, args.exact_tokens,
                                lambda token: exact.step(model, token))
    print("declared per layer (1.1 times what the exact run saw): " + ", ".join(
        f"max_score {o['max_score']:.3g}, min_logit {o['min_logit']:.3g}"
        for o in (declaration.options(layer, 1.1) for layer in range(len(model.blocks)))))
    for tolerance in args.tolerances:
        steps = CacheSteps(alibi_caches(model, tolerance, declaration, 1.1))
        start = time.perf_counter()
        text = generate_greedy(model, prompt, args.alibi_tokens,
                               lambda token: steps.step(model, token))
        seconds = time.perf_counter() - start
        compared = min(len(text), len(reference))
        same = text[:compared] == reference[:compared]
        cache = steps.caches[0]
        print(f"\n== exact ALiBi through plsh.torch.AlibiKvCache, tolerance {tolerance:g}, greedy, "
              f"{args.alibi_tokens} tokens: the first {compared - len(prompt)} "
              f"{'equal' if same else 'differ from'} the exact run's")
        print(show(text[:600]) + (" [...]" if len(text) > 600 else ""))
        print(f"{args.alibi_tokens / seconds:.0f} tokens/s; windows {cache.windows}; after "
              f"{cache.position} positions layer 0 holds {cache.resident_per_head} rows per head; "
              f"largest bound {steps.largest_bound:.3g}, {steps.uncertified} uncertified "
              f"layer steps of {steps.steps * len(steps.caches)}")


def show(text):
    return text.decode("utf-8", errors="replace")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="build/lm-plsh.pt",
                   help="model file (torch.save of lm.py --save); trained if missing")
    p.add_argument("--variant", choices=("plsh", "alibi"), default="plsh",
                   help="attention the model is trained with when --checkpoint is missing, and "
                        "the decoding shown after the exact one")
    p.add_argument("--steps", type=int, default=1500, help="training steps when training")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-cache", default=None, help="cache file of the stripped text (lm.py)")
    p.add_argument("--prompt", default="And God said, ")
    p.add_argument("--exact-tokens", type=int, default=200,
                   help="tokens generated with exact ALiBi, each checked against recomputation")
    p.add_argument("--plsh-tokens", type=int, default=3000,
                   help="tokens generated through the bounded plsh.torch.KvCache")
    p.add_argument("--tolerances", type=float, nargs="+", default=[1e-2, 1e-4, 1e-6],
                   help="tolerances of plsh.torch.AlibiKvCache (--variant alibi)")
    p.add_argument("--alibi-tokens", type=int, default=3000,
                   help="tokens generated through plsh.torch.AlibiKvCache (--variant alibi)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)

    model, config = train_or_load(args)
    prompt = args.prompt.encode()

    text, cached, full = generate_exact(model, prompt, args.exact_tokens)
    print(f"\n== exact ALiBi, greedy, {args.exact_tokens} tokens: equal to full recomputation at "
          f"every step")
    print(show(text))
    print(f"cached: {args.exact_tokens / cached:.0f} tokens/s; full recomputation: "
          f"{args.exact_tokens / full:.0f} tokens/s")

    if args.variant == "alibi":
        show_alibi_caches(model, prompt, args)
        return
    text, seconds, caches = generate_plsh(model, config, prompt, args.plsh_tokens,
                                          args.temperature, args.seed)
    print(f"\n== Positional LSH (s = {caches[0].options['samples']}, "
          f"{caches[0].options['sampling']}) through plsh.torch.KvCache, temperature "
          f"{args.temperature}, {args.plsh_tokens} tokens")
    print(show(text[:600]) + (" [...]" if len(text) > 600 else ""))
    print(f"{args.plsh_tokens / seconds:.0f} tokens/s; after {caches[0].position} positions each "
          f"layer's cache holds {', '.join(str(c.resident) for c in caches)} tokens, "
          f"{sum(c.bytes for c in caches)} bytes in all ({len(caches)} layers)")


if __name__ == "__main__":
    main()
