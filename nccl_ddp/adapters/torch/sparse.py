"""Sparse grads (`nn.Embedding(sparse=True)`, `nn.EmbeddingBag(sparse=True)`) reduced as sparse,
as torch's DDP on gloo reduces them: kept out of the buckets (a bucket would hold the whole table
dense), their grads all-gathered (indices and values, of each rank's own size) when a
synchronised backward ends and summed into one coalesced sparse grad, averaged over the group.

Each rank's grad is coalesced and divided by the group size first (torch's reducer divides a
sparse grad before its all-reduce), then the nonzero counts are exchanged (one all-gather for
every such parameter), then indices and values padded to the largest count. A parameter whose
`.grad` is None on every rank keeps it None. Under `no_sync()` autograd accumulates them locally;
the next synchronised step reduces the sum.

With a comm hook written for torch registered (`register_comm_hook`), each such grad goes through
the hook instead, in a bucket of its own, as torch's reducer sends it (`through_hook`, set by
adapters/torch/comm_hooks.py `route_sparse`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, List, Optional, Set, Tuple

from nccl_ddp.adapters.torch.tensors import to_native
from nccl_ddp.comm.api import device_of
from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.errors import ConfigError

if TYPE_CHECKING:
    import torch


MARK = "_nccl_ddp_sparse_grad"
"""Set on each parameter with sparse grads that a wrapper reduces: its name (what
`ZeroRedundancyOptimizer` reads to refuse it, `refuse_in_optimizer`)."""


def sparse_grad_params(module: torch.nn.Module) -> Set[int]:
    """`id()`s of the trainable parameters whose grads autograd makes sparse: the weights of the
    module's `Embedding` / `EmbeddingBag` built with `sparse=True`."""
    import torch

    kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    found = [m.weight for m in module.modules() if isinstance(m, kinds) and m.sparse]
    return {id(w) for w in found if w.requires_grad}


class SparseParams:
    """The wrapped module's parameters with sparse grads, by name: reduced by `reduce`."""

    def __init__(self, named: List[Tuple[str, torch.nn.Parameter]]) -> None:
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.ids = {id(p) for p in self.params}
        self.through_hook: Optional[Callable[[SparseParams, ProcessGroup], None]] = None
        """Set when a registered comm hook reduces these grads (one bucket each) instead."""
        for n, p in named:
            setattr(p, MARK, n)

    @classmethod
    def of(cls, module: torch.nn.Module) -> SparseParams:
        """Those of `module`'s trainable parameters (`sparse_grad_params`)."""
        ids = sparse_grad_params(module)
        return cls([(n, p) for n, p in module.named_parameters() if id(p) in ids])

    def __bool__(self) -> bool:
        return bool(self.params)

    def refuse(self, rank: int, what: str, instead: str = "") -> None:
        """ConfigError naming these parameters, if any, when `what` needs every grad dense."""
        refuse(rank, what, self.names, instead)

    def reduce(self, group: ProcessGroup) -> None:
        """Replace each parameter's `.grad` with the group's average, sparse and coalesced
        (a collective: every rank calls it at the end of each synchronised backward); with a
        comm hook registered, the hook's result (`through_hook`)."""
        import torch

        if not self.params:
            return
        if self.through_hook is not None:
            self.through_hook(self, group)
            return
        world = group.size
        local: List[Optional[torch.Tensor]] = []
        for p in self.params:
            g = None if p.grad is None else as_sparse(p.grad)
            local.append(None if g is None else (g.coalesce() / world).coalesce())
        device = self.params[0].device
        counts = torch.tensor([-1 if g is None else g._nnz() for g in local], device=device)
        every = _all_gather(group, counts).cpu()
        for k, (p, g) in enumerate(zip(self.params, local)):
            nnz = [int(c) for c in every[:, k]]
            if max(nnz) < 0:  # no rank has a grad: .grad stays None
                continue
            p.grad = _gathered(p, g, nnz, group)


def as_sparse(grad: torch.Tensor) -> torch.Tensor:
    """`grad` as an embedding's sparse grad (rows as the one sparse dim): one set by hand may be
    dense or sparse over more dims."""
    if grad.is_sparse and grad.sparse_dim() == 1:
        return grad
    return grad.to_dense().to_sparse(sparse_dim=1)


def refuse_in_optimizer(params: Iterable[torch.Tensor], rank: int, what: str) -> None:
    """ConfigError naming the parameters among `params` whose grads are sparse (marked)."""
    refuse(rank, what, [str(getattr(p, MARK)) for p in params if hasattr(p, MARK)])


def refuse(rank: int, what: str, names: List[str], instead: str = "") -> None:
    """ConfigError naming `names` (parameters with sparse grads), if any: `what` (ZeRO, a
    compressing comm hook) works on dense grads only; `instead`: what else would do."""
    if names:
        raise ConfigError(
            f"rank {rank}: {what} works on dense grads only, but parameter(s) {names} get sparse "
            "grads (Embedding/EmbeddingBag with sparse=True), which DistributedDataParallel "
            "reduces as sparse, outside the buckets: build those modules with sparse=False, or "
            f"do without {what}{instead}"
        )


def _gathered(
    p: torch.Tensor, g: Optional[torch.Tensor], nnz: List[int], group: ProcessGroup
) -> torch.Tensor:
    """The coalesced sum of every rank's (already divided) sparse grad of `p`: indices and
    values all-gathered, each rank's padded to the largest count."""
    import torch

    world, most = group.size, max(max(nnz), 0)
    idx = torch.zeros((1, most), dtype=torch.int64, device=p.device)  # (an embedding's: rows)
    val = torch.zeros((most, *p.shape[1:]), dtype=p.dtype, device=p.device)
    if g is not None and g._nnz():
        idx[:, : g._nnz()] = g._indices()
        val[: g._nnz()] = g._values()
    if most:
        all_idx, all_val = _all_gather(group, idx), _all_gather(group, val)
    else:  # every grad is empty: nothing to send
        all_idx, all_val = idx.expand(world, *idx.shape), val.expand(world, *val.shape)
    parts = [(all_idx[r][:, : max(n, 0)], all_val[r][: max(n, 0)]) for r, n in enumerate(nnz)]
    indices = torch.cat([i for i, _ in parts], dim=1)
    values = torch.cat([v for _, v in parts], dim=0)
    return torch.sparse_coo_tensor(indices, values, p.shape, dtype=p.dtype, device=p.device).coalesce()


def _all_gather(group: ProcessGroup, t: torch.Tensor) -> torch.Tensor:
    """Every rank's `t` (the same shape on every rank), stacked in rank order."""
    import torch

    out = torch.empty((group.size, *t.shape), dtype=t.dtype, device=t.device)
    stream = device_of(group).current_stream()
    work = group.all_gather(to_native(out).reshape(-1), to_native(t.contiguous()).reshape(-1), stream)
    work.wait(group.timeout)
    return out
