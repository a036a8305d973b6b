"""Activation offload's bookkeeping on the CPU, with injected copy streams that record every call: which tensors go
to the host, in which order they come back (one block ahead of its backward), the gradients (the plain model's, bit
for bit), the host bound (blocks dropped, or refused, with the figures), nothing left behind, and the CPU no-op."""

from __future__ import annotations

import copy
import warnings
import weakref

import pytest
import torch
from torch import nn

from lightning_memguard.levers.offload import ActivationOffload, exposed_transfer_ms

BATCH = 32


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.fc(x)))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    widths = [64, 65, 66, 67, 68]
    blocks = [Block(a, b) for a, b in zip(widths, widths[1:], strict=False)]
    return nn.Sequential(*blocks, nn.Linear(widths[-1], 1))


class RecordedCopies:
    """Copy streams on the CPU: the copies made at once, every call written to ``log`` by block (the k-th event of
    copies to the host marks the k-th block call); ``shift`` is added to what comes back, to show it is used."""

    def __init__(self, shift: float = 0.0) -> None:
        self.log: list[tuple[str, int]] = []
        self.copied: list[torch.Tensor] = []
        self.shift = shift
        self._calls = 0

    def to_host(self, tensor, host):
        host.copy_(tensor)
        self.copied.append(tensor)
        self.log.append(("to_host", self._calls))

    def to_host_event(self):
        self._calls += 1
        return ("offloaded", self._calls - 1)

    def to_device(self, pairs, after):
        for host, device in pairs:
            device.copy_(host + self.shift if self.shift else host)
        self.log.append(("to_device", after[1]))
        return ("fetched", after[1])

    def wait(self, event):  # for copies back ("wait") or, before their device tensors go, to the host ("released")
        self.log.append(("wait" if event[0] == "fetched" else "released", event[1]))


def _step(model, x, offload=None, log=None):
    """One forward and backward, the blocks' backward ends logged; the parameters' gradients."""
    handles = []
    if log is not None:
        for i, block in enumerate(model[:-1]):
            handles.append(block.register_full_backward_hook(lambda m, gi, go, i=i: log.append(("backward", i))))
    model.zero_grad(set_to_none=True)
    if offload is None:
        model(x).square().mean().backward()
    else:
        with offload:
            model(x).square().mean().backward()
    for handle in handles:
        handle.remove()
    return [p.grad.clone() for p in model.parameters()]


def _host_buffer(nbytes):
    return torch.empty(nbytes, dtype=torch.uint8)  # pinned on a GPU machine; plain here


def _offload(model, copies, **kwargs):
    kwargs = {"host_allocator": _host_buffer, **kwargs}
    return ActivationOffload(list(model[:-1]), min_bytes=2048, streams=copies, ram=lambda: 64 * 10**9, **kwargs)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # block 0's input needs no gradient
def test_each_block_copies_its_activations_out_and_gets_them_back_one_block_ahead_of_its_backward():
    model, plain = _model(), _model()
    x = torch.randn(BATCH, 64)
    copies = RecordedCopies()
    grads = _step(model, x, _offload(model, copies), log=copies.log)
    assert all(torch.equal(a, b) for a, b in zip(grads, _step(plain, x), strict=True))  # bit for bit
    # activations only: no parameter (their shapes lead with a width, never the batch), nothing under min_bytes;
    # a block's output, saved again by the next block's first layer, goes out once
    assert {tuple(t.shape) for t in copies.copied} == {(BATCH, w) for w in (64, 65, 66, 67, 68)}
    assert len(copies.copied) == 3 + 2 + 2 + 2
    assert copies.log == [
        # the forward, in order; a block's copies are waited for (and their device tensors let go) as the next ends
        *[("to_host", 0)] * 3, *[("to_host", 1)] * 2, ("released", 0), *[("to_host", 2)] * 2, ("released", 1),
        *[("to_host", 3)] * 2, ("released", 2),
        # the gradient reaches block 3: its copies waited for, it is fetched and block 2 prefetched
        ("released", 3), ("to_device", 3), ("to_device", 2),
        ("wait", 3), ("wait", 2), ("backward", 3),  # block 3 uses its input, block 2's output (offloaded by 2)
        ("to_device", 1), ("wait", 1), ("backward", 2),  # block 2's backward: block 1 prefetched, block 2 is back
        ("to_device", 0), ("wait", 0), ("backward", 1),
        ("backward", 0),
    ]  # fmt: skip


def test_the_backward_uses_the_copies_brought_back():
    model, plain = _model(), _model()
    x = torch.randn(BATCH, 64)
    grads = _step(model, x, _offload(model, RecordedCopies(shift=1.0)))
    assert not all(torch.equal(a, b) for a, b in zip(grads, _step(plain, x), strict=True))


def test_under_autocast_parameters_and_their_cast_copies_stay_and_gradients_match():
    model, plain = _model(), _model()
    x = torch.randn(BATCH, 64)
    copies = RecordedCopies()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grads = _step(model, x, _offload(model, copies))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _step(plain, x)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    assert copies.copied and all(t.shape[0] == BATCH for t in copies.copied)
    assert any(t.dtype == torch.bfloat16 for t in copies.copied)  # the activations' own casts do go


def test_the_step_leaves_nothing_behind_buffers_are_pooled_and_the_model_is_unchanged():
    model = _model()
    before = copy.deepcopy(model.state_dict())
    made = []

    def allocator(nbytes):
        made.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    x = torch.randn(BATCH, 64)
    offload = _offload(model, RecordedCopies(), host_allocator=allocator)
    with offload:
        for _ in range(3):
            model(x).square().mean().backward()
            assert offload.in_use_bytes == 0 and not offload._calls  # every host buffer back in the pool
            assert offload.host_bytes == sum(made)  # the pinned memory to declare to MemGuard
    assert len(made) == 9  # the first step's buffers, reused by the next two
    assert offload.moved_bytes == sum(offload.block_bytes.values()) == 4 * BATCH * (64 + 2 * (65 + 66 + 67 + 68))
    assert offload.host_bytes == 0  # released on exit
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_full_host_offloads_fewer_blocks_and_names_them_with_the_figures():
    model, plain = _model(), _model()
    x = torch.randn(BATCH, 64)
    offload = _offload(model, RecordedCopies(), max_host_bytes=80_000)
    with pytest.warns(UserWarning, match="offloads fewer blocks") as caught:
        grads = _step(model, x, offload)
    assert [str(w.message).split(": ", 1)[1] for w in caught] == [
        f"block {i} needs 16.4 kB more pinned host memory (for a tensor of {size} kB) beyond the 73.7 kB held, and"
        f" `max_host_bytes` is 80.0 kB; from now on blocks {dropped} keep their activations on the device, blocks"
        f" {kept} are offloaded"
        for i, size, dropped, kept in [(2, "8.6", [2], [0, 1, 3]), (3, "8.6", [2, 3], [0, 1])]
    ]
    assert all(torch.equal(a, b) for a, b in zip(grads, _step(plain, x), strict=True))
    assert offload.dropped == [2, 3]
    _step(model, x, offload)
    assert sorted(offload.block_bytes) == [0, 1] and offload.host_bytes <= 80_000


def test_a_full_host_is_refused_with_the_figures_when_asked():
    model = _model()
    offload = _offload(model, RecordedCopies(), max_host_bytes=80_000, on_full="refuse")
    match = r"the host cannot hold it: block 2 needs 16\.4 kB .* `max_host_bytes` is 80\.0 kB"
    with pytest.raises(ValueError, match=match):
        _step(model, torch.randn(BATCH, 64), offload)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_bound_beyond_the_available_ram_is_refused_and_the_default_is_a_share_of_it():
    model = _model()
    with pytest.raises(ValueError, match=r"`max_host_bytes` is 8\.00 GB, but only 4\.00 GB of system RAM"):
        offload = ActivationOffload(list(model), max_host_bytes="8GB", streams=RecordedCopies(), ram=lambda: 4 * 10**9)
        offload.__enter__()
    offload = ActivationOffload(list(model), streams=RecordedCopies(), ram=lambda: 4 * 10**9)
    with offload:
        assert offload.max_host_bytes == 2 * 10**9


def test_on_the_cpu_it_does_nothing_and_says_so_once():
    model, plain = _model(), _model()
    x = torch.randn(BATCH, 64)
    offload = ActivationOffload(list(model[:-1]), min_bytes=1)
    with pytest.warns(UserWarning, match="does nothing on the CPU"):
        grads = _step(model, x, offload)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, x, offload)
    assert offload.moved_bytes == 0 and offload.host_bytes == 0
    assert all(torch.equal(a, b) for a, b in zip(grads, _step(plain, x), strict=True))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"blocks": []}, "`blocks` must be one or more modules"),
        ({"on_full": "drop"}, "`on_full` must be one of"),
        ({"min_bytes": 0}, "`min_bytes` must be a positive size"),
        ({"host_share": 1.5}, "`host_share` must be in"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    model = _model()
    args = {"blocks": list(model[:-1]), **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        ActivationOffload(**args)


def test_blocks_inside_one_another_are_refused():
    model = _model()
    with pytest.raises(ValueError, match=r"block 0 holds blocks \[1\]"):
        ActivationOffload([model[0], model[0].fc])


def test_copies_hide_behind_the_next_blocks_compute_except_the_last_blocks():
    # 40 ms copies behind 10 ms forwards: the last copy out ends at 170 ms, 130 after the forward; it comes back in
    # 40 more, and each block's copy back takes 40 ms behind a 20 ms backward: 130 + 40 + 3 * 20
    assert exposed_transfer_ms([10] * 4, [20] * 4, [10**9] * 4, 25.0) == 230.0
    assert exposed_transfer_ms([10] * 4, [20] * 4, [10**9, 10**9, 0, 0], 100.0, between_ms=5) == 0.0
    # a block's copy is waited for as the next block's forward ends (its memory is given back then): a 40 ms copy
    # behind a 10 ms forward holds the forward 30 ms, however long the head after it
    assert exposed_transfer_ms([10] * 4, [20] * 4, [10**9, 0, 0, 0], 25.0, between_ms=100) == 30.0


def test_inside_a_checkpoint_it_moves_nothing_the_checkpoint_keeps_nothing_there():
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.inner, x, use_reentrant=False)

    model, plain = _model(), _model()
    wrapped = nn.Sequential(Checkpointed(model[:2]), *model[2:])  # blocks 0 and 1 inside one checkpoint
    x = torch.randn(BATCH, 64)
    copies = RecordedCopies()
    grads = _step(wrapped, x, _offload(model, copies))
    assert all(torch.equal(a, b) for a, b in zip(grads, _step(plain, x), strict=True))
    # blocks 2 and 3 go to the host as ever; 0 and 1 save nothing of their own in the checkpoint's forward, nor in
    # its recomputation, where their tensors live until their backward only
    assert {k for way, k in copies.log if way == "to_host"} == {0, 1}  # the k-th call with tensors moved: 2 and 3
    assert len(copies.copied) == 3 + 2  # block 2's input too: block 1, in the checkpoint, did not move its output


def test_a_blocks_device_tensors_are_held_until_the_compute_stream_waited_for_their_copies_then_let_go():
    class Watched(RecordedCopies):
        """Copies that watch each block's device tensors: alive when the compute stream waits for their copies (the
        copy stream still reads them), gone from the offload at once after (their memory reused in order)."""

        def __init__(self) -> None:
            super().__init__()
            self.sources: dict[int, list] = {}
            self.seen: list[tuple[int, bool, bool]] = []
            self.batch = None

        def to_host(self, tensor, host):
            host.copy_(tensor)
            self.sources.setdefault(self._calls, []).append(weakref.ref(tensor))
            self.log.append(("to_host", self._calls))

        def wait(self, event):
            super().wait(event)
            if event[0] == "offloaded":
                k = event[1]
                earlier = [ref for j, refs in self.sources.items() if j < k for ref in refs]
                alive = [ref() for ref in earlier if ref() is not None and ref() is not self.batch]  # the test holds x
                self.seen.append((k, all(ref() is not None for ref in self.sources[k]), bool(alive)))

    model, plain = _model(), _model()
    x = torch.randn(BATCH, 64)
    copies = Watched()
    copies.batch = x
    grads = _step(model, x, _offload(model, copies))
    assert all(torch.equal(a, b) for a, b in zip(grads, _step(plain, x), strict=True))
    # each block's tensors alive when waited for, those of the blocks before already gone; block 3's at the backward
    assert copies.seen == [(0, True, False), (1, True, False), (2, True, False), (3, True, False)]
    assert [k for way, k in copies.log if way == "released"] == [0, 1, 2, 3]


def test_a_saved_tensor_that_is_not_dense_stays_on_the_device_and_the_gradients_match():
    class Sliced(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(64, 128)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            wide = self.fc(x)
            return wide[:, :64] * wide[:, 64:]  # mul saves two column slices: strided, not dense

    torch.manual_seed(0)
    model, plain = nn.Sequential(Sliced(), nn.Linear(64, 1)), None
    plain = copy.deepcopy(model)
    x = torch.randn(BATCH, 64)
    copies = RecordedCopies()
    grads = _step(model, x, ActivationOffload([model[0]], min_bytes=1024, streams=copies, ram=lambda: 10**9))
    assert all(torch.equal(a, b) for a, b in zip(grads, _step(plain, x), strict=True))
    assert [tuple(t.shape) for t in copies.copied] == [(BATCH, 64)]  # the input only: the slices stayed
    assert all(t.is_contiguous() for t in copies.copied)


def test_tensors_fetched_for_a_backward_cut_short_are_waited_for_before_their_memory_goes_back():
    model = _model()
    x = torch.randn(BATCH, 64)
    copies = RecordedCopies()
    offload = _offload(model, copies)

    def cut(grad):
        raise RuntimeError("out of memory (a test)")

    def on_output(module, args, out):
        out.register_hook(cut)

    with offload:
        hook = model[2].register_forward_hook(on_output)
        loss = model(x).square().mean()
        with pytest.raises(RuntimeError, match="a test"):
            loss.backward()  # the gradient reached block 2's output: block 1 prefetched, and never used
        assert copies.log[-1] == ("to_device", 1) and offload.in_use_bytes > 0
        copies.copied.clear()  # the recorder's hold on the graph
        del loss  # the graph goes: the compute stream waits for block 1's copies back before it reuses that memory
    assert copies.log[-1] == ("wait", 1)
    assert offload.in_use_bytes == 0
    hook.remove()
