"""Run an example after `mindspore.communication.init()` (tests/test_msrun.py, under msrun):

    msrun ... tests/support/ms_after_init.py examples/ms_ddp_lenet.py ARGS...

The example is imported first (it sets the device and mode, which MindSpore lets a process set
once), then init() runs, then the example's main(). In msrun's scheduler process
(MS_ROLE=MS_SCHED) init() runs MindSpore's scheduler and exits the process; in a worker it joins
MindSpore's cluster, then the example joins ours.
"""

import importlib.util
import sys

from mindspore.communication import get_group_size, get_rank, init

path = sys.argv[1]
spec = importlib.util.spec_from_file_location("example", path)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
init()
print(f"mindspore rank {get_rank()} of {get_group_size()}", flush=True)
sys.argv = sys.argv[1:]
example.main()
