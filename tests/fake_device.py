"""A second device, simulated on the CPU, for finding host/device mixing without a GPU.

The engine is built on the CPU; `FakeDevice.adopt(obj)` tags every tensor reachable from it as
living on the device and points every `.device` attribute of its runners at torch.device('meta'),
which names the simulated device (data stays on the CPU). Inside the mode: a tensor made with
device='meta' (or from a device tensor) is a device tensor and reports `.device == meta`; one made
with no device or device='cpu' is a host tensor; `.to('meta')` / `.to('cpu')` move between them.
An op that mixes a non-scalar host tensor with a device tensor raises, as CUDA does; indexing a
device tensor with host indices is allowed, as on CUDA; a generator makes tensors only on its
own device (a factory such as torch.rand with a generator of another device raises). Slow;
meant for tiny models.

The team's shared tool (shared/tools/fake_device.py), kept in the tests so that a clone runs
them on its own."""

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

META = torch.device("meta")
DEVICE_DESCRIPTOR = torch.Tensor.device  # the getset descriptor behind tensor.device
FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.linspace,
    torch.eye,
    torch.randperm,
    torch.empty_strided,
}
LIKE = {
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
    torch.rand_like,
    torch.randn_like,
}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


class DeviceMismatch(RuntimeError):
    pass


def _is_meta(d):
    return (isinstance(d, torch.device) and d.type == "meta") or (isinstance(d, str) and d.startswith("meta"))


def _is_device(d):
    return isinstance(d, torch.device) or (isinstance(d, str) and d.split(":")[0] in ("cpu", "cuda", "meta"))


class FakeDevice(TorchFunctionMode):
    """Also tracks generators: one made without device='meta' is a host generator, and sampling
    device tensors with it raises, as CUDA does."""

    def __enter__(self):
        self.caught = []  # every mismatch, also those the engine catches and swallows
        self._real_generator, self._dev_generators = torch.Generator, set()
        real, devs = self._real_generator, self._dev_generators

        def generator(device=None):
            g = real()
            if device is not None and _is_meta(device):
                devs.add(id(g))
            return g

        torch.Generator = generator
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Generator = self._real_generator
        return super().__exit__(*exc)

    def _raise(self, message):
        self.caught.append(f"{message} at {_where()}")
        raise DeviceMismatch(message)

    def adopt(self, root, depth=8):
        seen, stack = set(), [(root, 0)]
        while stack:
            obj, d = stack.pop()
            if id(obj) in seen or d > depth:
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                _tag(obj, "dev")
                continue
            if isinstance(obj, torch.nn.Module):
                for t in list(obj.parameters()) + list(obj.buffers()):
                    _tag(t, "dev")
            if isinstance(obj, dict):
                stack += [(v, d + 1) for v in obj.values()]
            elif isinstance(obj, (list, tuple, set, frozenset)):
                stack += [(v, d + 1) for v in obj]
            elif (
                hasattr(obj, "__dict__")
                and not isinstance(obj, type)
                and type(obj).__module__.split(".")[0] in ("multiguess", "torch", "transformers")
            ):
                if (
                    isinstance(getattr(obj, "device", None), torch.device)
                    and obj.device.type == "cpu"
                    and type(obj).__module__.startswith("multiguess")
                ):
                    object.__setattr__(obj, "device", META)
                stack += [(v, d + 1) for v in vars(obj).values()]
        return root

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if getattr(func, "__self__", None) is DEVICE_DESCRIPTOR:  # reading tensor.device
            return META if _get(args[0]) == "dev" else func(*args, **kwargs)
        if func in FACTORIES or func in LIKE:
            dev = kwargs.get("device")
            if dev is not None:
                tag = "dev" if _is_meta(dev) else "host"
                kwargs["device"] = "cpu"
            else:
                tag = _get(args[0]) if func in LIKE and args else "host"
            gen = kwargs.get("generator")
            if gen is not None and (tag == "dev") != (id(gen) in self._dev_generators):
                self._raise(
                    f"{getattr(func, '__qualname__', func)}: a generator makes a tensor on another device"
                )
            return tree_map(lambda x: _tag(x, tag), func(*args, **kwargs))
        if func in (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda):
            target = kwargs.get("device")
            if target is None:
                target = next((a for a in args[1:] if _is_device(a) or isinstance(a, torch.Tensor)), None)
            if func is torch.Tensor.cpu:
                tag = "host"
            elif func is torch.Tensor.cuda or _is_meta(target):
                tag = "dev"
            elif isinstance(target, torch.Tensor):
                tag = _get(target)
            elif target is not None:
                tag = "host"
            else:
                tag = _get(args[0])
            if "device" in kwargs:
                kwargs["device"] = "cpu"
            args = tuple("cpu" if (i > 0 and _is_device(a)) else a for i, a in enumerate(args))
            if func is torch.Tensor.cuda:
                func, args = torch.Tensor.to, (args[0], "cpu")
            return tree_map(lambda x: _tag(x, tag), func(*args, **kwargs))
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if any(_is_meta(a) for a in flat if not isinstance(a, torch.Tensor)):
            args, kwargs = tree_map(lambda a: "cpu" if _is_meta(a) else a, (args, kwargs))
        gen = kwargs.get("generator")
        if gen is not None and any(_get(t) == "dev" for t in tensors) and id(gen) not in self._dev_generators:
            self._raise(f"{getattr(func, '__qualname__', func)}: a host generator samples a device tensor")
        out = func(*args, **kwargs)
        if func is torch.Tensor.copy_ or not tensors:
            return out
        tags = [(_get(t), t.dim()) for t in tensors]
        if func in INDEXING:
            base = _get(args[0])
            if (
                func is torch.Tensor.__setitem__
                and base == "dev"
                and len(args) > 2
                and isinstance(args[2], torch.Tensor)
                and _get(args[2]) == "host"
                and args[2].dim() > 0
            ):
                self._raise("__setitem__: host values written into a device tensor")
            return tree_map(lambda x: _tag(x, base), out)
        has_dev = any(tg == "dev" for tg, _ in tags)
        if has_dev and any(tg == "host" and d > 0 for tg, d in tags):
            self._raise(f"{getattr(func, '__qualname__', func)}: a host tensor meets a device tensor")
        result = "dev" if has_dev else ("host" if any(tg == "host" for tg, _ in tags) else None)
        return tree_map(lambda x: _tag(x, result), out)


def _where():
    import traceback

    frames = [f for f in traceback.extract_stack() if "/multiguess/" in f.filename]
    return f"{frames[-1].filename.split('multiguess/')[-1]}:{frames[-1].lineno}" if frames else "?"


def _get(t):
    return getattr(t, "_fake_device_tag", None) if isinstance(t, torch.Tensor) else None


def _tag(x, tag):
    if isinstance(x, torch.Tensor) and tag in ("dev", "host"):
        with contextlib.suppress(AttributeError, TypeError, RuntimeError):
            x._fake_device_tag = tag
    return x
