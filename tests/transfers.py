"""Host<->device transfers counted on the simulated device (``tests/fake_device.py``).

On CUDA every read of a device value by the host (``.tolist()``, ``.item()``, ``int()``,
``bool()``, ``.cpu()``) waits for the device to finish its queue (a sync), and every tensor
made from host data for the device, or indexed by a host index tensor, is a host-to-device
copy. ``TransferCounter`` is the simulated device with both counted, each with the engine line
that made it, so a test can hold a step's transfers to a constant.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch

from tests.fake_device import INDEXING, FakeDevice, _get, _is_meta, _where

READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
}
FROM_HOST_DATA = {torch.tensor, torch.as_tensor}


class TransferCounter(FakeDevice):
    """The simulated device, counting ``syncs`` (device-to-host reads) and ``copies``
    (host-to-device copies) by the engine line that made each (``where``); nothing is counted
    inside ``uncounted()``."""

    def __enter__(self) -> TransferCounter:
        self.syncs: collections.Counter[str] = collections.Counter()
        self.copies: collections.Counter[str] = collections.Counter()
        self.counting = True
        return super().__enter__()

    def reset(self) -> None:
        self.syncs.clear()
        self.copies.clear()

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.counting and _reads_back(func, args, kwargs or {}):
            self.syncs[_where()] += 1
        elif self.counting and _copies_over(func, args, kwargs or {}):
            self.copies[_where()] += 1
        return super().__torch_function__(func, types, args, kwargs)


def _reads_back(func: object, args: tuple, kwargs: dict) -> bool:
    """Whether the call reads a device tensor's values on the host."""
    if not args or _get(args[0]) != "dev":
        return False
    return func in READS or (func is torch.Tensor.to and _to_host(args, kwargs))


def _copies_over(func: object, args: tuple, kwargs: dict) -> bool:
    """Whether the call copies host data to the device."""
    first = args[0] if args else None
    if func in FROM_HOST_DATA:
        return _is_meta(kwargs.get("device")) and not _is_device_tensor(first)
    if func in (torch.Tensor.to, torch.Tensor.cuda):
        return _get(first) == "host" and _to_device(func, args, kwargs)
    if func is torch.Tensor.copy_:
        return _get(first) == "dev" and _get(args[1]) == "host"
    return func in INDEXING and _get(first) == "dev" and _host_index(args[1])


def _is_device_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor) and _get(value) == "dev"


def _target(args: tuple, kwargs: dict) -> object:
    if "device" in kwargs:
        return kwargs["device"]
    return next((a for a in args[1:] if isinstance(a, (torch.device, str, torch.Tensor))), None)


def _to_host(args: tuple, kwargs: dict) -> bool:
    target = _target(args, kwargs)
    if isinstance(target, torch.Tensor):
        return _get(target) == "host"
    return target is not None and not _is_meta(target) and str(target).startswith("cpu")


def _to_device(func: object, args: tuple, kwargs: dict) -> bool:
    if func is torch.Tensor.cuda:
        return True
    target = _target(args, kwargs)
    if isinstance(target, torch.Tensor):
        return _get(target) == "dev"
    return target is not None and _is_meta(target)


def _host_index(index: object) -> bool:
    """Whether an index holds host tensors or lists (copied to the device to index it there)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(
        (isinstance(p, torch.Tensor) and _get(p) == "host" and p.dim() > 0) or isinstance(p, list)
        for p in parts
    )
