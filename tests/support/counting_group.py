"""Stand-ins for reducer tests on the fake CUDA device: `CountingGroup`, a 'nccl' group of 2 whose
collectives only count and complete at once (`Done`), and `PackOnly`, an ArrayModule whose grads
cannot become bucket views (so the reducer packs and unpacks)."""

from nccl_ddp.adapters.arrays import ArrayModule
from nccl_ddp.comm.group import ProcessGroup, Work


class Done(Work):
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def result(self):
        return None


class CountingGroup(ProcessGroup):
    """A 'nccl' group of 2 that only counts (rank 0's view; the collectives do nothing)."""

    backend, rank, size, ranks, timeout, name = "nccl", 0, 2, (0, 1), 5.0, "fake"

    def __init__(self, counts):
        self.counts = counts

    def all_reduce(self, buf, op=None, stream=None, *, tag=None):
        self.counts["all_reduce"] += 1
        return Done()

    def broadcast(self, buf, root=0, stream=None, *, tag=None):
        return Done()

    def all_gather(self, out, inp, stream=None, *, tag=None):
        raise NotImplementedError

    def reduce_scatter(self, out, inp, op=None, stream=None, *, tag=None):
        raise NotImplementedError

    def barrier(self, stream=None, *, tag=None):
        return Done()

    def new_subgroup(self, ranks):
        raise NotImplementedError

    def shutdown(self):
        return None


class PackOnly(ArrayModule):
    """An ArrayModule whose grads cannot become bucket views (the reducer packs/unpacks)."""

    @property
    def can_install_grads(self) -> bool:
        return False
