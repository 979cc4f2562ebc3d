"""torch's ZeroRedundancyOptimizer over nccl_ddp.zero: the optimizer, its build, grads, gathers, state
and step."""
