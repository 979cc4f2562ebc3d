"""torch's ZeroRedundancyOptimizer over nccl_ddp.zero: the optimizer, its build, guarded grads, gathers, state
and step."""
