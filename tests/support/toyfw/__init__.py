"""toyfw: a tiny NumPy-backed framework that nccl_ddp knows nothing about, for
tests/adapters/test_toy_framework.py (a third party's adapter to it: tests/support/toyfw_nccl/).

Its arrays are `Tensor`s (a NumPy array inside, shown by `numpy()` without a copy, and a `.grad`
of the framework's own memory, new at every first accumulation as Paddle's), its models
`Module`s; `Linear` is the one model, `mse` the one loss, and `Loss.backward()` computes the
grads by hand, accumulating each parameter's into `p.grad`, runs the parameter's grad hooks right
after, and once backward is done the callbacks queued during it (torch's autograd engine does the
same with `queue_callback`).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import numpy as np

_queued: List[Callable[[], None]] = []  # end-of-backward callbacks of the backward running now


class Tensor:
    """toyfw's array: float32 NumPy memory of its own (or a native array it was given)."""

    def __init__(self, data, requires_grad: bool = False, name: Optional[str] = None) -> None:
        self._data = np.asarray(data) if isinstance(data, np.ndarray) else np.asarray(data, np.float32)
        self.requires_grad = requires_grad
        self.name = name
        self.grad: Optional[Tensor] = None
        self._hooks: List[Callable[[Tensor], None]] = []

    @property
    def shape(self) -> Tuple[int, ...]:
        return self._data.shape

    @property
    def dtype(self) -> np.dtype:
        return self._data.dtype

    def numpy(self) -> np.ndarray:
        """The tensor's memory itself (writable, no copy)."""
        return self._data

    def register_grad_hook(self, fn: Callable[[Tensor], None]) -> Handle:
        """`fn(tensor)` runs each time a backward has accumulated this tensor's grad."""
        self._hooks.append(fn)
        return Handle(self._hooks, fn)


class Handle:
    def __init__(self, hooks: list, fn: Callable) -> None:
        self._hooks, self._fn = hooks, fn

    def remove(self) -> None:
        if self._fn in self._hooks:
            self._hooks.remove(self._fn)


def queue_callback(fn: Callable[[], None]) -> None:
    """Run `fn` once the backward running now has finished."""
    _queued.append(fn)


class Module:
    """A model: its parameters are its `Tensor` attributes that require grad."""

    def named_parameters(self) -> List[Tuple[str, Tensor]]:
        return [(n, v) for n, v in vars(self).items() if isinstance(v, Tensor) and v.requires_grad]

    def parameters(self) -> List[Tensor]:
        return [p for _, p in self.named_parameters()]

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class Linear(Module):
    """y = (x @ weight + bias) * scale; `scale` is used only when forward is asked to."""

    def __init__(self, n_in: int, n_out: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.weight = Tensor(rng.standard_normal((n_in, n_out)).astype(np.float32), True, "weight")
        self.bias = Tensor(rng.standard_normal(n_out).astype(np.float32), True, "bias")
        self.scale = Tensor(np.full(1, 1.5, np.float32), True, "scale")

    def forward(self, x: Tensor, use_scale: bool = True) -> Output:
        xs, w, b, s = x.numpy(), self.weight.numpy(), self.bias.numpy(), self.scale.numpy()
        z = xs @ w + b
        if not use_scale:
            return Output(z, lambda dy: [(self.bias, dy.sum(0)), (self.weight, xs.T @ dy)])
        return Output(
            z * s,
            lambda dy: [
                (self.scale, np.array([(dy * z).sum()], np.float32)),
                (self.bias, (dy * s).sum(0)),
                (self.weight, xs.T @ (dy * s)),
            ],
        )


class Output(Tensor):
    """A model's output: a tensor that knows the grads of its parameters (in backward order)."""

    def __init__(self, data: np.ndarray, grads: Callable[[np.ndarray], list]) -> None:
        super().__init__(data.astype(np.float32))
        self.grads_of = grads


class Loss(Tensor):
    def __init__(self, value: float, out: Output, dy: np.ndarray) -> None:
        super().__init__(np.float32(value))
        self._out, self._dy = out, dy

    def backward(self) -> None:
        """Accumulate every parameter's grad, each followed by its hooks; then the callbacks."""
        for p, g in self._out.grads_of(self._dy):
            g = np.asarray(g, np.float32)
            p.grad = Tensor(g.copy()) if p.grad is None else Tensor(p.grad.numpy() + g)
            for hook in list(p._hooks):
                hook(p)
        while _queued:
            _queued.pop(0)()


def mse(out: Output, target: np.ndarray) -> Loss:
    """0.5 * the mean over rows of the squared error."""
    err = out.numpy() - target
    return Loss(0.5 * float((err**2).sum()) / len(err), out, (err / len(err)).astype(np.float32))
