"""PyTorch: the module adapter, its DDP wrapper, grads, tensors, comm hooks, parameter watch, the
torch.distributed-first join and ZeRO-2's pooled grads; the sharded optimizer in zero/, Lightning,
Accelerate and transformers in integrations/."""
