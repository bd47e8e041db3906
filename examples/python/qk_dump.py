"""Dumps the queries, keys and values of every layer and head of a model trained by lm.py.

The model is rebuilt from the checkpoint that `lm.py --save` writes (weights and arguments), run
in evaluation mode with exact ALiBi attention on one window of the validation text (the bytes
after the first `--offset` bytes of the last 10% of the text, as lm.py splits it), and the q, k
that enter each layer's attention are written, in double, to a binary file read by
examples/error_decay.cpp:

  int64 layers, heads, tokens, dim      (little-endian)
  float64 q[tokens][dim], k[tokens][dim] for layer 0 head 0, layer 0 head 1, ...

followed by nothing else; a JSON file next to it (`<out>.json`) records the model, the slopes
and the window.

With `--qkv-out FILE` it also writes the q, k and v of one layer (`--qkv-layer`, default the
last) rounded to IEEE half precision (binary16, 1.2 MB for 2048 tokens), token-major as plsh's
packed tensors, read by bench/plsh_frontier.cpp:

  int64 layer, heads, tokens, dim       (little-endian)
  binary16 q[tokens][heads][dim], then k, then v (same shape)

with its JSON record in `FILE` with the extension replaced by `.json`.

Usage (from the repository root, after `bash scripts/python.sh build`):
  PYTHONPATH=build/python /usr/bin/python3 examples/python/qk_dump.py \\
      --checkpoint build/accuracy/alibi-s1.pt --length 2048 --out build/accuracy/qk.bin \\
      --qkv-out docs/accuracy/qkv.bin
"""

import argparse
import json
import os
import struct
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lm  # noqa: E402  (the model and the data of the training script)


def dump(args):
    checkpoint = torch.load(args.checkpoint, map_location="cpu")
    config = argparse.Namespace(**checkpoint["config"])
    model = lm.ByteLM(config, config.seed)
    model.load_state_dict(checkpoint["state_dict"])
    model.eval()
    model.set_method("alibi")

    _, valid = lm.split(lm.load_bible(args.data_cache))
    if args.offset + args.length > len(valid):
        sys.exit("qk_dump.py: the window lies beyond the validation text")
    window = valid[args.offset : args.offset + args.length].view(1, -1)

    heads = config.heads
    dim = config.d_model // heads
    records = []
    with torch.no_grad():
        h = model.embed(window)
        for block in model.blocks:
            qkv = block.qkv(block.norm1(h)).view(1, args.length, 3, heads, dim)
            q, k, v = qkv.unbind(2)
            records.append((q[0].double(), k[0].double(), v[0].double()))  # [T, H, D]
            h = block(h)

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "wb") as f:
        f.write(struct.pack("<4q", len(records), heads, args.length, dim))
        for q, k, _ in records:
            for head in range(heads):
                f.write(q[:, head, :].contiguous().numpy().astype("<f8").tobytes())
                f.write(k[:, head, :].contiguous().numpy().astype("<f8").tobytes())
    info = {
        "checkpoint": os.path.basename(args.checkpoint),
        "config": checkpoint["config"],
        "layers": len(records),
        "heads": heads,
        "tokens": args.length,
        "dim": dim,
        "slopes": model.attentions()[0].slopes,
        "window": {"text": "validation", "offset": args.offset, "length": args.length},
    }
    with open(args.out + ".json", "w") as f:
        json.dump(info, f, indent=1)
    print(f"qk_dump.py: {len(records)} layers x {heads} heads of q, k [{args.length}][{dim}] "
          f"written to {args.out}")
    if args.qkv_out:
        write_qkv(args, records, info)


def write_qkv(args, records, info):
    """The q, k, v of one layer, binary16 [tokens][heads][dim] each, after a header."""
    layer = args.qkv_layer if args.qkv_layer >= 0 else len(records) + args.qkv_layer
    if not 0 <= layer < len(records):
        sys.exit(f"qk_dump.py: --qkv-layer {args.qkv_layer} is not one of {len(records)} layers")
    os.makedirs(os.path.dirname(args.qkv_out) or ".", exist_ok=True)
    with open(args.qkv_out, "wb") as f:
        f.write(struct.pack("<4q", layer, info["heads"], info["tokens"], info["dim"]))
        for tensor in records[layer]:
            f.write(tensor.contiguous().numpy().astype("<f2").tobytes())
    qkv_info = dict(info, layers=1, layer=layer, layers_of_model=len(records),
                    format="int64 layer, heads, tokens, dim; binary16 q, k, v [tokens][heads][dim]")
    with open(os.path.splitext(args.qkv_out)[0] + ".json", "w") as f:
        json.dump(qkv_info, f, indent=1)
    print(f"qk_dump.py: layer {layer}: q, k, v [{info['tokens']}][{info['heads']}][{info['dim']}] "
          f"in binary16 written to {args.qkv_out}")


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="file written by lm.py --save")
    p.add_argument("--length", type=int, default=2048, help="window length n")
    p.add_argument("--offset", type=int, default=0, help="first byte of the validation text")
    p.add_argument("--data-cache", default=None, help="cache file of the stripped text (as lm.py)")
    p.add_argument("--out", required=True, help="binary output file")
    p.add_argument("--qkv-out", default=None, help="also write one layer's q, k, v here (binary16)")
    p.add_argument("--qkv-layer", type=int, default=-1,
                   help="the layer of --qkv-out (default -1: the last)")
    return p


if __name__ == "__main__":
    dump(parser().parse_args())
