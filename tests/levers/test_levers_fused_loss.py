"""The fused linear cross-entropy against ``F.cross_entropy`` on the logits: the loss and every gradient, with
ignored tokens, label smoothing, tied weights, chunks of ignored tokens only, sequences shorter than a chunk and
bf16 autocast; both implementations (this library's chunks, and torch's ``F.linear_cross_entropy`` where installed);
and what it keeps for backward: its gradients, never the logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_memguard import fused_linear_cross_entropy
from lightning_memguard.levers import fused_loss

IMPLEMENTATIONS = [
    "chunked",
    pytest.param(
        "torch",
        marks=pytest.mark.skipif(
            not fused_loss.has_torch_linear_cross_entropy(), reason="torch < 2.13 has no F.linear_cross_entropy"
        ),
    ),
]


def _plain(hidden, weight, labels, bias=None, shift=False, **kwargs):
    logits = F.linear(hidden, weight, bias).float()
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), **kwargs)


def _inputs(tokens=(3, 7), features=16, vocabulary=50, seed=0, bias=True):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*tokens, features, generator=generator, requires_grad=True)
    weight = torch.randn(vocabulary, features, generator=generator, requires_grad=True)
    b = torch.randn(vocabulary, generator=generator, requires_grad=True) if bias else None
    labels = torch.randint(0, vocabulary, tokens, generator=generator)
    return hidden, weight, b, labels


def _loss_and_grads(loss_fn, hidden, weight, bias, upstream=1.7):
    loss = loss_fn()
    wanted = [t for t in (hidden, weight, bias) if t is not None]
    return loss.detach(), torch.autograd.grad(loss * upstream, wanted)


def _assert_same(fused, plain, atol=1e-5, rtol=1e-5):
    torch.testing.assert_close(fused[0], plain[0], atol=atol, rtol=rtol)
    for got, want in zip(fused[1], plain[1], strict=True):
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("shift", [False, True])
def test_loss_and_gradients_equal_cross_entropy_on_the_logits_with_ignored_tokens(implementation, reduction, shift):
    hidden, weight, bias, labels = _inputs()
    labels[0, :5] = -100  # ignored tokens, some of them in a chunk of their own
    labels[2, 3] = -100
    kwargs = {"reduction": reduction}
    fused = _loss_and_grads(
        lambda: fused_linear_cross_entropy(
            hidden, weight, labels, bias=bias, shift=shift, chunk_tokens=4, implementation=implementation, **kwargs
        ),
        hidden,
        weight,
        bias,
    )
    plain = _loss_and_grads(lambda: _plain(hidden, weight, labels, bias, shift=shift, **kwargs), hidden, weight, bias)
    _assert_same(fused, plain)


@pytest.mark.parametrize("smoothing", [0.1, 1.0])
def test_label_smoothing_is_cross_entropys(smoothing):
    hidden, weight, bias, labels = _inputs()
    labels[1, :2] = -100
    fused = _loss_and_grads(
        lambda: fused_linear_cross_entropy(
            hidden, weight, labels, bias=bias, label_smoothing=smoothing, chunk_tokens=5
        ),
        hidden,
        weight,
        bias,
    )
    plain = _loss_and_grads(
        lambda: _plain(hidden, weight, labels, bias, label_smoothing=smoothing), hidden, weight, bias
    )
    _assert_same(fused, plain)


def test_a_tied_weight_receives_the_embeddings_gradient_and_the_heads():
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(40, 8)
    tokens = torch.randint(0, 40, (2, 6))

    def step(loss_of_hidden):
        embedding.zero_grad()
        hidden = torch.tanh(embedding(tokens))
        loss_of_hidden(hidden).backward()
        return embedding.weight.grad.clone()

    fused = step(lambda h: fused_linear_cross_entropy(h, embedding.weight, tokens, shift=True, chunk_tokens=3))
    plain = step(lambda h: _plain(h, embedding.weight, tokens, shift=True))
    torch.testing.assert_close(fused, plain, atol=1e-6, rtol=1e-5)
    assert fused[tokens.unique()].abs().sum() > 0  # both paths reach the weight: the embedding's rows and the head's


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_sequence_shorter_than_a_chunk_and_a_batch_with_no_counted_token(implementation):
    hidden, weight, bias, labels = _inputs(tokens=(1, 3))
    fused = _loss_and_grads(
        lambda: fused_linear_cross_entropy(hidden, weight, labels, bias=bias, implementation=implementation),
        hidden,
        weight,
        bias,
    )
    _assert_same(fused, _loss_and_grads(lambda: _plain(hidden, weight, labels, bias), hidden, weight, bias))

    labels[:] = -100  # nothing counted: a nan loss and zero gradients, as F.cross_entropy gives
    loss, grads = _loss_and_grads(
        lambda: fused_linear_cross_entropy(hidden, weight, labels, bias=bias, implementation=implementation),
        hidden,
        weight,
        bias,
    )
    assert torch.isnan(loss) and torch.isnan(_plain(hidden, weight, labels, bias))
    if implementation == "chunked":
        assert all(not g.any() for g in grads)
    else:  # torch's gives nan gradients here (a micro-batch of prompt tokens only): one reason "auto" is "chunked"
        assert all(g.isnan().all() for g in grads)


def test_bf16_autocast_stays_within_bf16_tolerance_of_the_float32_reference():
    hidden, weight, bias, labels = _inputs(tokens=(4, 32), features=64, vocabulary=300)
    labels[:, :4] = -100
    reference = _loss_and_grads(lambda: _plain(hidden, weight, labels, bias), hidden, weight, bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = _loss_and_grads(
            lambda: fused_linear_cross_entropy(hidden, weight, labels, bias=bias, chunk_tokens=48),
            hidden,
            weight,
            bias,
        )
        plain = _loss_and_grads(lambda: _plain(hidden, weight, labels, bias), hidden, weight, bias)
    assert fused[0].dtype == torch.float32  # the softmax and the sums in float32
    assert all(g.dtype == t.dtype for g, t in zip(fused[1], (hidden, weight, bias), strict=True))
    _assert_same(fused, reference, atol=2e-2, rtol=2e-2)
    # no further from the float32 reference than the plain head under the same autocast
    for got, plain_got, want in zip(fused[1], plain[1], reference[1], strict=True):
        assert (got - want).abs().max() <= 1.5 * (plain_got - want).abs().max() + 1e-6
    assert (fused[0] - reference[0]).abs() <= 1.5 * (plain[0] - reference[0]).abs() + 1e-6


def test_softcap_and_logit_scale_match_their_formulas():
    hidden, weight, bias, labels = _inputs()

    def plain():
        logits = F.linear(hidden, weight, bias) * 0.5
        logits = 3.0 * torch.tanh(logits / 3.0)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    fused = _loss_and_grads(
        lambda: fused_linear_cross_entropy(
            hidden, weight, labels, bias=bias, logit_scale=0.5, softcap=3.0, chunk_tokens=4
        ),
        hidden,
        weight,
        bias,
    )
    _assert_same(fused, _loss_and_grads(plain, hidden, weight, bias))


class _KeptBytes(TorchDispatchMode):
    """Every storage an operation makes; :meth:`kept` counts those still alive but the ones named."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made.append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
        return out

    def kept(self, *held):
        skip = {StorageWeakRef(t.untyped_storage()).cdata for t in held}
        return sum({ref.cdata: n for ref, n in self.made if not ref.expired() and ref.cdata not in skip}.values())


def _kept(loss_fn, autocast):
    hidden, weight, _, labels = _inputs(tokens=(4, 512), features=32, vocabulary=1000, bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), _KeptBytes() as probe:
        loss = loss_fn(hidden, weight, labels)
    return probe.kept(hidden, weight, labels, loss), hidden, weight


@pytest.mark.parametrize("autocast", [False, True])
def test_the_forward_keeps_only_the_gradients_and_torchs_keeps_no_fewer(autocast):
    def fused(h, w, y, implementation="chunked"):
        return fused_linear_cross_entropy(h, w, y, chunk_tokens=256, implementation=implementation)

    kept, hidden, weight = _kept(fused, autocast)
    size = 2 if autocast else 4
    assert kept == (hidden.numel() + weight.numel()) * size  # the two gradients, in the compute dtype
    plain, _, _ = _kept(lambda h, w, y: _plain(h, w, y), autocast)
    assert plain > 4 * 2048 * 1000  # the plain loss keeps float32 logits-sized tensors
    if fused_loss.has_torch_linear_cross_entropy():  # why "auto" picks the chunks: torch's saves no more
        torchs, _, _ = _kept(lambda h, w, y: fused(h, w, y, "torch"), autocast)
        assert torchs >= kept


def test_under_no_grad_it_computes_the_loss_alone():
    hidden, weight, bias, labels = _inputs()
    with torch.no_grad(), _KeptBytes() as probe:
        loss = fused_linear_cross_entropy(hidden, weight, labels, bias=bias)
    assert probe.kept(hidden, weight, bias, labels, loss) == 0
    torch.testing.assert_close(loss, _plain(hidden, weight, labels, bias).detach())


def test_torch_compile_gives_the_same_loss_and_gradients():
    hidden, weight, bias, labels = _inputs()
    compiled = torch.compile(
        lambda h, w, b, y: fused_linear_cross_entropy(h, w, y, bias=b, chunk_tokens=8), backend="aot_eager"
    )
    fused = _loss_and_grads(lambda: compiled(hidden, weight, bias, labels), hidden, weight, bias)
    _assert_same(fused, _loss_and_grads(lambda: _plain(hidden, weight, labels, bias), hidden, weight, bias))


def test_torchs_implementation_is_refused_by_name_where_torch_has_none(monkeypatch):
    hidden, weight, _, labels = _inputs()
    monkeypatch.delattr(F, "linear_cross_entropy", raising=False)  # torch 2.11, as on the GPU machine
    assert not fused_loss.has_torch_linear_cross_entropy()
    with pytest.raises(ValueError, match=r"implementation='torch'.*torch 2\.13"):
        fused_linear_cross_entropy(hidden, weight, labels, implementation="torch")
    loss = fused_linear_cross_entropy(hidden, weight, labels)  # "auto" still works
    torch.testing.assert_close(loss, _plain(hidden, weight, labels))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"reduction": "none"}, r"`reduction` must be 'mean' or 'sum', got 'none'"),
        ({"label_smoothing": 1.5}, r"`label_smoothing` must be in \[0, 1\], got 1.5"),
        ({"chunk_tokens": 0}, r"`chunk_tokens` must be a positive int, got 0"),
        ({"softcap": -1.0}, r"`softcap` must be positive or None, got -1.0"),
        ({"implementation": "liger"}, r"`implementation` must be .*, got 'liger'"),
        ({"implementation": "torch", "label_smoothing": 0.1}, r"has no label_smoothing; got `label_smoothing=0.1`"),
    ],
)
def test_what_it_does_not_support_is_refused_by_name(kwargs, match):
    hidden, weight, _, labels = _inputs()
    if kwargs.get("implementation") == "torch" and not fused_loss.has_torch_linear_cross_entropy():
        pytest.skip("torch < 2.13")
    with pytest.raises(ValueError, match=match):
        fused_linear_cross_entropy(hidden, weight, labels, **kwargs)


def test_shapes_that_do_not_fit_are_refused_with_them():
    hidden, weight, _, labels = _inputs()
    with pytest.raises(ValueError, match=r"`weight` must be \(vocabulary, 16\).*got \(50, 8\)"):
        fused_linear_cross_entropy(hidden, weight[:, :8], labels)
    with pytest.raises(ValueError, match=r"`labels` must have the shape .*\(3, 7\), got \(3, 6\)"):
        fused_linear_cross_entropy(hidden, weight, labels[:, :6])
    with pytest.raises(ValueError, match=r"`shift=True` needs .* got \(21, 16\)"):
        fused_linear_cross_entropy(hidden.flatten(0, 1), weight, labels.flatten(), shift=True)


@pytest.fixture
def one_rank_mesh():
    """A device mesh of this process alone (gloo), as FSDP2 and tensor parallelism build theirs; torn down after."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_sharded_head_or_a_tensor_parallel_input_is_refused_saying_what_to_do(one_rank_mesh, implementation):
    """The CPU twin of the two-rank refusals (test_levers_fused_loss_distributed.py): a DTensor weight (FSDP2's
    parameter outside its module's forward, a ``ColwiseParallel`` head), hidden states or bias, by name, before
    anything is computed."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    hidden, weight, bias, labels = _inputs()
    sharded = {
        "weight": distribute_tensor(weight.detach(), one_rank_mesh, [Shard(0)]),
        "hidden": distribute_tensor(hidden.detach(), one_rank_mesh, [Replicate()]),
        "bias": distribute_tensor(bias.detach(), one_rank_mesh, [Shard(0)]),
    }
    placements = {"weight": r"\(Shard\(dim=0\),\)", "hidden": r"\(Replicate\(\),\)", "bias": r"\(Shard\(dim=0\),\)"}
    for name, tensor in sharded.items():
        given = {"hidden": hidden, "weight": weight, "bias": bias, name: tensor}
        match = (
            rf"`{name}` is a DTensor \(placements {placements[name]} on a mesh of 1 ranks\), as FSDP2's fully_shard "
            r"or tensor parallelism .* call it inside the forward of the module that holds the head, where the "
            r"weight is gathered .*a tensor-parallel head is not supported"
        )
        with pytest.raises(ValueError, match=match):
            fused_linear_cross_entropy(
                given["hidden"], given["weight"], labels, bias=given["bias"], implementation=implementation
            )


def test_the_triton_kernel_computes_the_chunks_as_pytorchs_operations_do():
    """CPU twin of test_the_fused_losss_kernel_on_cuda (tests/gpu/test_gpu.py), in Triton's interpreter (in a process
    of its own: the interpreter must be chosen before Triton is imported): every chunk by the kernel, the ignored
    tokens left out before chunking, or masked in the chunks (one of which then holds ignored tokens only), the head's
    300 words padded to 320 (and, in one case, not padded); float32 to rounding, bf16 autocast within one bf16 step
    of PyTorch's operations and no further from the float32 reference."""
    pytest.importorskip("triton")
    script = Path(__file__).resolve().parents[1] / "fused_loss_kernel_run.py"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for name, case in result.items():
        # the 73 counted of 120 tokens in chunks of 32; masked: all 120 of them, the first chunk ignored tokens only
        assert case["kernel_chunks"] == [True] * (4 if name.endswith("masked") else 3), name
        # the vocabulary of 300 padded to 320 words (fused_loss.PAD_WORDS), or not where padding is off
        assert set(case["kernel_columns"]) == {300 if name.endswith("unpadded") else 320}, name
        if name.startswith("bf16"):
            assert max(case["vs_torch_ops"]) <= 2**-7, name  # one bf16 step at most
            for ours, theirs in zip(case["vs_plain_float32"], case["torch_ops_vs_plain_float32"], strict=True):
                assert ours <= 1.5 * theirs + 1e-3, name
        else:
            assert max(case["vs_torch_ops"]) <= 1e-5 and max(case["vs_plain_float32"]) <= 1e-5, name


def test_a_kernel_that_cannot_build_leaves_pytorchs_operations_and_says_so_once(monkeypatch):
    # the head's 50 words were padded to 64 for the kernel: PyTorch's operations then take the words alone
    class Unbuildable:
        def __getitem__(self, grid):
            raise RuntimeError("no compiler for this GPU")

    monkeypatch.setattr(fused_loss, "_failed", [])
    monkeypatch.setattr(fused_loss, "_kernel", lambda: Unbuildable())
    monkeypatch.setattr(fused_loss._compiler, "triton_runs_on", lambda tensor: True)  # a CPU tensor goes to it
    hidden, weight, bias, labels = _inputs()
    with pytest.warns(RuntimeWarning, match="fused loss's kernel cannot run here .*no compiler for this GPU"):
        fused = _loss_and_grads(
            lambda: fused_linear_cross_entropy(hidden, weight, labels, bias=bias), hidden, weight, bias
        )
    _assert_same(fused, _loss_and_grads(lambda: _plain(hidden, weight, labels, bias), hidden, weight, bias))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the next call goes to PyTorch's operations without a word
        fused_linear_cross_entropy(hidden, weight, labels, bias=bias)


def test_only_the_counted_tokens_go_through_the_head():
    """A masked language model counts about 15 % of its tokens: the head's matmuls (forward and the gradients) are
    done for those alone, and the loss and gradients are still the plain loss's (zero on the ignored rows)."""
    from torch.utils.flop_counter import FlopCounterMode

    hidden, weight, bias, labels = _inputs(tokens=(4, 64), features=32, vocabulary=500)
    masked = torch.where(torch.arange(labels.numel()).view(labels.shape) % 7 == 0, labels, -100)  # 37 of 256

    def flops(y):
        with FlopCounterMode(display=False) as counter:
            loss = fused_linear_cross_entropy(hidden, weight, y, bias=bias, chunk_tokens=16)
            torch.autograd.grad(loss, (hidden, weight, bias))
        return counter.get_total_flops()

    assert flops(masked) <= 0.16 * flops(labels)  # 37 / 256 of the rows, and nothing else of the head's size
    fused = _loss_and_grads(
        lambda: fused_linear_cross_entropy(hidden, weight, masked, bias=bias, chunk_tokens=16), hidden, weight, bias
    )
    _assert_same(fused, _loss_and_grads(lambda: _plain(hidden, weight, masked, bias), hidden, weight, bias))
    assert fused[1][0].flatten(0, 1)[masked.flatten() == -100].abs().max() == 0


def test_a_few_ignored_rows_stay_in_the_head_masked_and_many_are_left_out():
    """A causal model's last position (1 of each sequence's 128 rows) is masked in the chunks: no copy of the other
    rows, the same work as every row; 1 of every 16 ignored is left out. The loss and gradients are the plain loss's
    either way."""
    from torch.utils.flop_counter import FlopCounterMode

    hidden, weight, bias, labels = _inputs(tokens=(2, 128), features=32, vocabulary=500)
    positions = torch.arange(labels.numel()).view(labels.shape)

    def flops(y, **kwargs):
        with FlopCounterMode(display=False) as counter:
            loss = fused_linear_cross_entropy(hidden, weight, y, bias=bias, chunk_tokens=32, **kwargs)
            torch.autograd.grad(loss, (hidden, weight, bias))
        return counter.get_total_flops()

    every = flops(labels, counted_only=False)
    assert flops(labels, shift=True) == every  # 2 of 256 rows ignored (under 1/64): kept, masked
    sparse = torch.where(positions % 16 == 0, -100, labels)  # 16 of 256 ignored: left out
    assert flops(sparse) < every
    for y, shift in ((labels, True), (sparse, False)):

        def fused(y=y, shift=shift):
            return fused_linear_cross_entropy(hidden, weight, y, bias=bias, shift=shift, chunk_tokens=32)

        def plain(y=y, shift=shift):
            return _plain(hidden, weight, y, bias, shift=shift)

        _assert_same(_loss_and_grads(fused, hidden, weight, bias), _loss_and_grads(plain, hidden, weight, bias))


def test_counted_only_false_takes_every_row_through_the_head_with_the_same_loss():
    """The choice without the device sync (its GPU twin, ``test_counted_only_false_makes_no_device_sync``, runs under
    CUDA's sync debug mode): every row through the head's matmuls, the ignored ones masked, the same numbers."""
    from torch.utils.flop_counter import FlopCounterMode

    hidden, weight, bias, labels = _inputs(tokens=(4, 64), features=32, vocabulary=500)
    masked = torch.where(torch.arange(labels.numel()).view(labels.shape) % 7 == 0, labels, -100)

    def loss_of(y, counted_only):
        return fused_linear_cross_entropy(hidden, weight, y, bias=bias, chunk_tokens=16, counted_only=counted_only)

    def flops(y, counted_only):
        with FlopCounterMode(display=False) as counter:
            torch.autograd.grad(loss_of(y, counted_only), (hidden, weight, bias))
        return counter.get_total_flops()

    assert flops(masked, counted_only=False) == flops(labels, counted_only=True)
    fused = _loss_and_grads(lambda: loss_of(masked, False), hidden, weight, bias)
    _assert_same(fused, _loss_and_grads(lambda: _plain(hidden, weight, masked, bias), hidden, weight, bias))
    with pytest.raises(ValueError, match=r"`counted_only` must be a bool, got 'no'"):
        loss_of(masked, "no")
