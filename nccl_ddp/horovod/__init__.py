"""Horovod's API on nccl_ddp's runtime: a Horovod script changes one import line.

    import nccl_ddp.horovod.torch as hvd            # was: import horovod.torch as hvd
    import nccl_ddp.horovod.tensorflow as hvd       # was: import horovod.tensorflow as hvd
    import nccl_ddp.horovod.tensorflow.keras as hvd # was: import horovod.tensorflow.keras as hvd

A compatibility facade above the adapters: `common` (ranks, process sets, async handles, object
collectives, HOROVOD_* settings) and `collectives` (Horovod's collectives on native arrays) are
framework-free; each framework's package translates its tensors and adds Horovod's optimizer
wrappers, whose gradients go through our buckets. Nothing in nccl_ddp imports this package.
Launch with `nccl-ddp-run` or our `horovodrun` (nccl_ddp/launch/horovodrun.py). docs/horovod.md.
"""
