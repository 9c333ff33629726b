"""Counting a piece of code's host syncs on any device, the CPU included, where nothing waits: the aten operations
whose result the host would wait for on an accelerator, and `Tensor.tolist`. Tests and benchmarks use it to show that
a step syncs no more than it should (`tests/test_compile.py`, `benchmarks/bench_train_syncs.py`).

    with HostSyncCounter() as syncs:
        model(ids, labels=ids).loss.backward()
    print(syncs.count, syncs.by_op)
    syncs = train_step_syncs(model, ids, optimizer)  # a step as StemTrainer takes it, the backward not counted

A partial count, not a bound either way: `tolist` of a tensor that lives on the host syncs nothing on an accelerator
and is counted; a copy between devices (`.cpu()`, `torch.tensor(..., device=...)` from pageable memory) and an
operation that syncs inside its kernel (indexing with a bool mask) are not seen. And under a dispatch mode autograd
clones a sparse gradient it would otherwise keep as it is: count a backward that makes sparse gradients apart from
what reads them (`tests/test_compile.py` does)."""

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# A value read out (`item`, `bool`, `int` go through `_local_scalar_dense`), or an output whose size depends on the
# values (a coalesce counts its distinct indices).
SYNCING_OPS = frozenset(
    {
        "_local_scalar_dense",
        "nonzero",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "masked_select",
        "equal",
        "is_nonzero",
        "repeat_interleave",
        "_coalesce",
    }
)


class HostSyncCounter(TorchDispatchMode):
    """Counts, while `active`, the syncing aten operations (`SYNCING_OPS`) and `Tensor.tolist` calls made inside it:
    `count` in all, `by_op` per operation. One at a time: it patches `Tensor.tolist` while it is entered."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.by_op: Counter[str] = Counter()
        self.active = True
        self._tolist = None

    def _seen(self, name: str) -> None:
        if self.active:
            self.count += 1
            self.by_op[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCING_OPS:
            self._seen(name)
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> "HostSyncCounter":
        if self._tolist is not None:
            raise RuntimeError("HostSyncCounter: already entered")
        tolist = self._tolist = torch.Tensor.tolist

        def counted(tensor: torch.Tensor, *args, **kwargs):
            if tensor.numel() > 0:
                self._seen("tolist")
            return tolist(tensor, *args, **kwargs)

        torch.Tensor.tolist = counted
        try:
            return super().__enter__()
        except BaseException:
            torch.Tensor.tolist, self._tolist = tolist, None
            raise

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            torch.Tensor.tolist, self._tolist = self._tolist, None


def train_step_syncs(
    model: torch.nn.Module, ids: torch.Tensor, optimizer: torch.optim.Optimizer, max_norm: float = 1.0
) -> HostSyncCounter:
    """One train step as `StemTrainer` takes it (forward with labels, backward, `clip_grad_norm`, the optimizer's
    step), its syncs counted but the backward's: under a dispatch mode autograd clones a sparse gradient it would
    otherwise hand on as it is, which would hide how clipping and the optimizer take it."""
    from .training import clip_grad_norm

    syncs = HostSyncCounter()
    optimizer.zero_grad(set_to_none=True)
    with syncs:
        loss = model(ids, labels=ids).loss
    loss.backward()
    with syncs:
        clip_grad_norm(model.parameters(), max_norm)
        optimizer.step()
    return syncs


__all__ = ["SYNCING_OPS", "HostSyncCounter", "train_step_syncs"]
