"""plsh.torch's modules under torch.utils.checkpoint: the recomputed forward of Positional LSH
uses the partitions of the forward it recomputes, so the gradients equal those of the same steps
run without checkpointing, and the counter of training forwards counts steps."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import plsh.torch as pt

REENTRANT = [True, False]


def inputs(seed, tokens=64, heads=4, dim=8):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, tokens, heads, dim, dtype=torch.float64, generator=generator)
            .requires_grad_() for _ in range(3)]


def gradients(module, tensors, weight, use_checkpoint, use_reentrant=True):
    """(output, gradients of q, k, v) of sum(weight * module(q, k, v))."""
    if use_checkpoint:
        out = checkpoint(module, *tensors, use_reentrant=use_reentrant)
    else:
        out = module(*tensors)
    (out * weight).sum().backward()  # checkpointing supports backward(), not autograd.grad
    return out.detach(), [t.grad for t in tensors]


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_recomputation_uses_the_partitions_of_its_forward(use_reentrant):
    """Three training steps, checkpointed and not: equal outputs and gradients step by step.
    Before the fix the recomputation took the next seed: max |dq - dq_ref| was about 0.2."""
    checkpointed = pt.AlibiAttention(4, samples=5, seed=11)
    plain = pt.AlibiAttention(4, samples=5, seed=11)
    weight = torch.randn(2, 64, 4, 8, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(3))
    for step in range(3):
        tensors = inputs(step)
        out, grads = gradients(checkpointed, tensors, weight, True, use_reentrant)
        out_ref, grads_ref = gradients(plain, tensors, weight, False)
        assert torch.equal(out, out_ref)
        for grad, grad_ref, name in zip(grads, grads_ref, "qkv"):
            assert torch.allclose(grad, grad_ref, rtol=1e-12, atol=1e-12), (step, name)
        assert int(checkpointed.training_forwards) == step + 1
    assert int(plain.training_forwards) == 3
    # The steps drew different partitions: a fresh seed per step, as without checkpointing.
    first, _ = gradients(pt.AlibiAttention(4, samples=5, seed=11), inputs(0), weight, False)
    assert not torch.equal(first, out)


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_multihead_block_gradients_under_checkpointing(use_reentrant):
    """A block of MultiheadAlibiAttention and an MLP, checkpointed: the parameters' gradients
    equal those of the same block without checkpointing, over two steps."""

    def block(seed):
        torch.manual_seed(seed)
        return torch.nn.ModuleDict({
            "attn": pt.MultiheadAlibiAttention(32, 4, method="plsh", samples=7, seed=5,
                                               dtype=torch.float64),
            "mlp": torch.nn.Linear(32, 32, dtype=torch.float64)})

    def run(layer, x):
        return layer["mlp"](x + layer["attn"](x))

    checkpointed, plain = block(0), block(0)
    for step in range(2):
        x = torch.randn(2, 48, 32, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(10 + step)).requires_grad_()
        checkpoint(run, checkpointed, x, use_reentrant=use_reentrant).square().sum().backward()
        run(plain, x).square().sum().backward()
        for (name, p), (_, p_ref) in zip(checkpointed.named_parameters(),
                                         plain.named_parameters()):
            assert torch.allclose(p.grad, p_ref.grad, rtol=1e-12, atol=1e-12), (step, name)
    assert int(checkpointed["attn"].attention.training_forwards) == 2


def test_recomputation_without_the_generator_state_raises():
    """preserve_rng_state=False: the recomputation cannot find its forward's partitions and says
    so instead of differentiating other ones."""
    module = pt.AlibiAttention(4, samples=5, seed=11)
    tensors = inputs(0)
    out = checkpoint(module, *tensors, use_reentrant=True, preserve_rng_state=False)
    with pytest.raises(RuntimeError, match="preserve_rng_state=True"):
        out.sum().backward()


def test_forwards_outside_checkpointing_leave_torch_generator_alone():
    module = pt.AlibiAttention(4, samples=5, seed=11)
    state = torch.get_rng_state()
    module(*inputs(0)).sum().backward()
    assert torch.equal(torch.get_rng_state(), state)
    assert int(module.training_forwards) == 1
