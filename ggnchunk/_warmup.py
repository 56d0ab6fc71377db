"""One-time set-up of a process, paid lazily before a call's memory baseline.

A process's first call of a kind of work pays costs that later calls do not: the code of
the kernels it uses is paged in from the libraries (oneDNN's convolutions: about 14 MiB of
resident memory the first time a convolution runs forward and backward), the engine's
Python paths and autograd's first use, and ``torch.func``'s machinery behind batched
backward passes (about 40 MiB: it imports ``sympy``). None of it is the call's memory:
it stays resident whatever the call does, and a second call never pays it again. Counted
against ``max_memory`` it made the first call in a process plan several times more passes
than later calls, or refuse a budget that a second call met.

So a budgeted (or ``"auto"``) call first runs tiny problems of the kinds of layers its
model has (once per process, kind, dtype and device) and only then takes its baseline,
where the memory measurement counts that set-up (``MemoryBackend.counts_code``: CUDA's
library handles and workspaces, a CPU without ``/proc``). On Linux the CPU's measurement
leaves the pages mapped from files out, so the code needs no warm-up there: the kernel
runs cost a first call 50 ms (109 ms against 58 ms on the 40 ms tutorial autoencoder)
and set up little else (0.1-0.3 MiB per kind of layer).
Nothing happens at import: a process that never calls (a DataLoader worker) pays
nothing; a forked child starts over, as its page tables do not carry the parent's code
pages. ``torch.func`` is set up only for a call that may use it (a loss without closed
form, or a model with glue between its layers, judged before the forward pass from its
modules, as the forward pass's own checks already backpropagate the glue in batches).

The matrix products' library keeps a pool of packing buffers per thread (MKL's memory
manager: 4.8 MiB on one thread, 9.5 MiB on two, measured on this project's CPU) that
grows with the largest products a process has run and is never given back. A first call
grew it inside its budget: the partly frozen ResNet-18 at 22.3 MiB counted 6 MiB more in
use after its forward pass than a second call did and planned 51 passes where the second
planned 25. :func:`ensure_matmul_pool` grows it once per process, dtype and thread count,
before the baseline of a call whose budget the pool is a sizeable share of and whose model
is large enough for its products to grow it, with products
whose buffers every later one fits in (480 products of random shapes and layouts after
them grew it no further).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

import torch
from torch import nn

from ggnchunk._rules.activation import DERIVATIVES

__all__ = ["ensure_batched_autograd", "ensure_matmul_pool", "warm_up_for"]

_LOCK = threading.Lock()
_WARMED: set[tuple] = set()
_ACTIVE = threading.local()  # the warm-up's own calls do not warm up again


def _reset_after_fork() -> None:
    _WARMED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _conv(cls: type, dims: int) -> Callable[[], tuple[nn.Module, tuple[int, ...]]]:
    # batch 2 and channels 2: the shapes for which torch picks the same (oneDNN) kernels
    # as for real batches; a batch of one takes another path
    return lambda: (cls(2, 2, 3, padding=1), (2, 2) + (5,) * dims)


# kinds of layers whose first use pays kernel set-up: a tiny model and its input shape
_KINDS: dict[type, Callable[[], tuple[nn.Module, tuple[int, ...]]]] = {
    nn.Conv1d: _conv(nn.Conv1d, 1),
    nn.Conv2d: _conv(nn.Conv2d, 2),
    nn.Conv3d: _conv(nn.Conv3d, 3),
    nn.ConvTranspose1d: _conv(nn.ConvTranspose1d, 1),
    nn.ConvTranspose2d: _conv(nn.ConvTranspose2d, 2),
    nn.ConvTranspose3d: _conv(nn.ConvTranspose3d, 3),
    nn.LayerNorm: lambda: (nn.Sequential(nn.Linear(5, 5), nn.LayerNorm(5)), (2, 3, 5)),
    nn.GroupNorm: lambda: (nn.Sequential(nn.Conv2d(2, 2, 1), nn.GroupNorm(1, 2)),
                           (2, 2, 5, 5)),
    nn.MaxPool2d: lambda: (nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.MaxPool2d(2)),
                           (2, 2, 6, 6)),
    nn.AvgPool2d: lambda: (nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.AvgPool2d(2)),
                           (2, 2, 6, 6)),
}  # fmt: skip
for _cls in DERIVATIVES:  # every activation with a rule
    # between two convolutions, as in a real model: the rule's derivative kernels and
    # the convolution's backward into it
    _KINDS[_cls] = (lambda cls: lambda: (
        nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), cls(), nn.Conv2d(2, 2, 1)),
        (2, 2, 5, 5),
    ))(_cls)  # fmt: skip


def _windows() -> tuple[nn.Module, tuple[int, ...]]:
    # the windowed path's kernels (gathers, scatters, small batched products, pooling
    # and upsampling on boxes): an output large enough to be windowed, three passes
    # (windowed, dense, windowed). No glue: torch.func is set up only for calls that
    # need it (a budgeted first call pays it outside its budget, see _api)
    model = nn.Sequential(
        nn.Conv2d(2, 2, 3, padding=1), nn.AvgPool2d(2), nn.Conv2d(2, 2, 3, padding=1),
        nn.Upsample(scale_factor=2), nn.Sigmoid(), nn.ConvTranspose2d(2, 2, 3, padding=1),
    )  # fmt: skip
    return model, (2, 2, 16, 16)


_WINDOWED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
             nn.ConvTranspose3d)  # fmt: skip


def _engine() -> tuple[nn.Module, tuple[int, ...]]:
    # the engine's own first use (autograd, the sweep's Python paths, matrix products)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), (3, 4)


def _run(build: Callable[[], tuple[nn.Module, tuple[int, ...]]], dtype, device) -> None:
    from ggnchunk._api import diag_ggn

    model, shape = build()
    model = model.to(device=device, dtype=dtype)
    x = torch.rand(shape, dtype=dtype, device=device)
    with torch.no_grad():
        y = model(x)
    chunks = 3 if build is _windows else 2
    diag_ggn(model, nn.MSELoss(), x, torch.rand_like(y), num_chunks=chunks)


def warm_up_for(model: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Pay the one-time set-up of ``model``'s kinds of layers now, once per process.

    Runs tiny problems (a few milliseconds each after the first) under a forked random
    state, so nothing the user owns changes. Call before taking a memory baseline.

    Args:
        model: The user's model (only the classes of its modules are read).
        dtype: The computation's dtype.
        device: Where it runs.

    Returns:
        Whether anything was set up now (``False`` when the process had it all).
    """
    if getattr(_ACTIVE, "on", False):
        return False
    kinds: set = {None}
    for module in model.modules():
        if isinstance(module, _WINDOWED):
            kinds.add("windows")
        for cls in type(module).__mro__:
            if cls in _KINDS:
                kinds.add(cls)
                break
    todo = [k for k in kinds if (k, dtype, str(device)) not in _WARMED]
    if not todo:
        return False
    devices = [device] if device.type == "cuda" else []
    with _LOCK, torch.random.fork_rng(devices=devices):
        _ACTIVE.on = True
        try:
            for kind in sorted(todo, key=_name):
                if (kind, dtype, str(device)) in _WARMED:
                    continue
                build = (
                    _engine if kind is None else _windows if kind == "windows"
                    else _KINDS[kind]
                )  # fmt: skip
                # a warm-up never fails a call (a dtype without kernels, say): the
                # call itself says what is wrong
                with contextlib.suppress(Exception):
                    _run(build, dtype, device)
                _WARMED.add((kind, dtype, str(device)))
        finally:
            _ACTIVE.on = False
    return True


def _name(kind: type | str | None) -> str:
    return "" if kind is None else kind if isinstance(kind, str) else kind.__name__


def ensure_batched_autograd() -> bool:
    """Set up ``torch.func``'s batched backward passes once per process.

    Returns:
        Whether it ran now (``False`` when it was set up already).
    """
    if ("torch.func", None, None) in _WARMED:
        return False
    from ggnchunk._autograd import warm_up

    with _LOCK, torch.random.fork_rng(devices=[]):
        warm_up()
        with contextlib.suppress(Exception):  # a warm-up never fails a call
            _folded()
        _WARMED.add(("torch.func", None, None))
    return True


def _folded() -> None:
    """Batched backward passes through the folded glue calls (custom functions).

    torch's batching of a custom ``autograd.Function``'s backward sets up on first use:
    about 35 MiB that the first budgeted call of a model with a functional resize or
    attention in its glue counted as in use after its forward pass (41.8 MiB against
    1.2 MiB in a second call), and planned 770 passes of 4 columns where a second call
    planned 111 of 28.
    """
    import torch.nn.functional as F

    from ggnchunk._autograd import quiet_autograd
    from ggnchunk._folding import folded_glue

    x = torch.rand(2, 2, 3, 3, requires_grad=True)
    q = torch.rand(2, 2, 3, 4, requires_grad=True)
    with folded_glue():
        y = F.interpolate(x, scale_factor=2, mode="nearest")
        a = F.scaled_dot_product_attention(q, q, q)
    with quiet_autograd():
        torch.autograd.grad(
            [y, a],
            [x, q],
            [torch.ones(2, *y.shape), torch.ones(2, *a.shape)],
            is_grads_batched=True,
        )


# per dtype, products whose packing buffers hold every later product's (MKL, on 1 and 2
# threads): float32's grow with a wide right factor split between the threads, float64's
# with a tall left one; and one product with a short inner dimension (another kind). Then
# the pool's size per thread (measured: 4.8 and 9.9 MiB)
_POOL = {
    torch.float32: (((64, 512, 8192), (8, 3, 2048)), 5 * 2**20),
    torch.float64: (((8192, 512, 64), (2048, 8, 64)), 10 * 2**20),
}
# where the pool's growth inside a call is worth a set-up: the pool is over this share
# of the budget, and the model holds at least this many parameters (its products grow
# the pool: the partly frozen ResNet-18's by 6.8 MiB over two calls, the 28x28
# autoencoder's 3.4, the 1,000-class classifier's 0.8, the segmenter's 0.15)
_POOL_SHARE = 0.05
_POOL_PARAMETERS = 2**20


def ensure_matmul_pool(
    dtype: torch.dtype, device: torch.device, budget: int, parameters: int
) -> bool:
    """Grow the matrix products' buffer pool of this thread count once per process.

    20-60 ms on one thread (products of zeros; the code of the library's large-product
    kernels paged in), paid only where the pool is more than 5% of the budget and the
    model holds at least 2**20 parameters. A small model's first call paid 30 ms for it
    (22% of the 16x16 segmenter's budgeted call) and planned as many passes without
    it; ResNet-18's planned 10 passes without it where a second call planned 4-6. Only
    on the CPU (a GPU's library workspaces live in the caching allocator, whose reuse the
    budget sees), and for float32 and float64.

    Args:
        dtype: The computation's dtype (each has its own kernels and buffers).
        device: Where it runs.
        budget: The call's budget in bytes.
        parameters: The model's parameter count (trainable or not).

    Returns:
        Whether it ran now.
    """
    shapes, per_thread = _POOL.get(dtype, ((), 0))
    threads = torch.get_num_threads()
    if (
        device.type != "cpu" or not shapes or getattr(_ACTIVE, "on", False)
        or per_thread * threads <= _POOL_SHARE * budget
        or parameters < _POOL_PARAMETERS
    ):  # fmt: skip
        return False
    key = ("matmul pool", dtype, threads)
    if key in _WARMED:
        return False
    with _LOCK:
        if key in _WARMED:
            return False
        with contextlib.suppress(Exception):  # a warm-up never fails a call
            for m, k, n in shapes:
                torch.mm(torch.zeros(m, k, dtype=dtype), torch.zeros(k, n, dtype=dtype))
        _WARMED.add(key)
    return True
