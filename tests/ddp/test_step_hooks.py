"""The step lifecycle of the adapter contract (ddp/interfaces.py): the reducer calls the wrapped
module's `step_opened`, `before_step_end` and `step_ended` on every path a step takes (its last
grad, `finalize()`, a no_sync() step), and `before_step_end` runs before the missing grads are
reduced, so what it writes is this rank's contribution. 2 ranks on threads."""

import numpy as np
from fakegroup import run_threads

from nccl_ddp.adapters.arrays import ArrayModule
from nccl_ddp.ddp.data_parallel import DistributedDataParallel


class Recording(ArrayModule):
    """An array module that logs its step hooks and fills a missing grad with 4.0."""

    def __init__(self, params):
        super().__init__(params)
        self.events = []
        self.driver = None

    def attach(self, driver):
        self.driver = driver

    def step_opened(self, syncs):
        self.events.append(("opened", syncs))

    def before_step_end(self, missing):
        self.events.append(("before_end", list(missing)))
        for i in missing:
            self.driver.grads[i][...] = 4.0

    def step_ended(self, synced):
        self.events.append(("ended", synced, self.driver.steps))


def _rank(group):
    model = Recording([np.zeros(3, np.float32), np.zeros(2, np.float32)])
    ddp = DistributedDataParallel(model, process_group=group, find_unused_parameters=True)
    log = {}
    # 1. every grad comes: the last one ends the step
    ddp.reducer.prepare()  # (what the wrapper's forward does)
    ddp.mark_ready(0, np.ones(3, np.float32))
    ddp.mark_ready(1, np.ones(2, np.float32))
    log["last grad"], model.events = model.events, []
    ddp.finalize()  # no step open: nothing happens
    log["finalize, none open"], model.events = model.events, []
    # 2. rank 1 gives no grad 1: finalize() ends the step, rank 1's slot says 4.0 first
    ddp.zero_grad()
    ddp.reducer.prepare()
    ddp.mark_ready(0, np.ones(3, np.float32))
    if group.rank == 0:
        ddp.mark_ready(1, np.full(2, 2.0, np.float32))
    ddp.finalize()
    log["finalize"], model.events = model.events, []
    log["grad 1"] = np.array(ddp.grads[1])
    # 3. a no_sync() step
    with ddp.no_sync():
        ddp.reducer.prepare()
        ddp.mark_ready(0, np.ones(3, np.float32))
        ddp.finalize()
    log["no_sync"] = model.events
    ddp.close()
    return log


def test_the_reducer_calls_the_step_hooks_on_every_path():
    for rank, log in enumerate(run_threads(_rank, 2)):
        assert log["last grad"] == [("opened", True), ("ended", True, 1)]
        assert log["finalize, none open"] == []
        missing = [("before_end", [1])] if rank == 1 else []
        assert log["finalize"] == [("opened", True), *missing, ("ended", True, 2)]
        np.testing.assert_array_equal(log["grad 1"], np.full(2, 3.0, np.float32))  # (2 + 4) / 2
        assert log["no_sync"] == [("opened", False), ("ended", False, 2)]
