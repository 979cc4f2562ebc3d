"""Lightning, Accelerate and transformers glue over the torch wrapper (their public faces are
nccl_ddp.lightning, nccl_ddp.accelerate and nccl_ddp.transformers)."""
