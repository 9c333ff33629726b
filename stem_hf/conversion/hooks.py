"""Reading what a model's modules take in, and stopping a forward once nothing after that point is needed."""

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from torch import nn

__all__ = ["StopForward", "capture_inputs", "run_until"]


class StopForward(Exception):
    """Raised by a hook to end a forward early: the modules after it have nothing to contribute."""


def run_until(forward: Callable[[object], object], items: Iterable, hooks: list) -> None:
    """Calls `forward` on each item, each call ending early when one of `hooks` (made by `register_*` calls) raises
    `StopForward`, then removes the hooks."""
    try:
        for item in items:
            try:
                forward(item)
            except StopForward:
                pass
    finally:
        for handle in hooks:
            handle.remove()


@contextmanager
def capture_inputs(modules: list[nn.Module], stop: nn.Module | None = None) -> Iterator[dict[nn.Module, tuple]]:
    """Yields a dict that the forwards run inside the block fill with each of `modules`' positional inputs (the last
    call's); the forward raises `StopForward` when it reaches `stop`."""
    got = {}

    def hook(module: nn.Module, args: tuple) -> None:
        got[module] = args
        if module is stop:
            raise StopForward

    handles = [module.register_forward_pre_hook(hook) for module in modules]
    try:
        yield got
    finally:
        for handle in handles:
            handle.remove()
