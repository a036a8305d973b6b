"""The autograd internals the library names in one place (lightning_memguard/_autograd.py), read on the CPU: a torch
release that renames one fails here, by name."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from lightning_memguard import _autograd


def test_batch_norms_saved_statistics_and_input_are_read_from_its_node():
    bn = torch.nn.BatchNorm2d(3).train()
    x = torch.randn(4, 3, 5, 5, requires_grad=True)
    out = bn(x)
    mean, invstd = _autograd.batch_norm_saved_statistics(out)
    torch.testing.assert_close(mean, x.detach().mean(dim=(0, 2, 3)))
    var = x.detach().var(dim=(0, 2, 3), unbiased=False)
    torch.testing.assert_close(invstd, (var + bn.eps).rsqrt())
    assert _autograd.saved_input(out) is x
    plain = torch.randn(2, 3)  # no node: nothing saved
    assert _autograd.saved_input(plain) is None
    assert _autograd.batch_norm_saved_statistics(plain) == (None, None)


def test_the_saved_tensor_hooks_in_force_and_checkpoints_own():
    assert _autograd.saved_tensors_hooks_in_force() is None

    def pack(t):
        return t

    def unpack(t):
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert _autograd.saved_tensors_hooks_in_force() == (pack, unpack)
    assert not _autograd.checkpoint_hook(pack)
    seen = []

    def inside(x):
        hooks = _autograd.saved_tensors_hooks_in_force()
        seen.append(hooks is not None and _autograd.checkpoint_hook(hooks[0]))
        return x.sin()

    checkpoint(inside, torch.randn(3, requires_grad=True), use_reentrant=False)
    assert seen == [True]


def test_version_moves_with_in_place_changes_and_a_views_root_is_its_base():
    t = torch.zeros(4)
    before = _autograd.version(t)
    t.add_(1)
    assert _autograd.version(t) == before + 1
    view = t[1:]
    assert _autograd.view_root(view) is t and _autograd.view_root(t) is t
