"""`fully_shard` (ZeRO-3, torch FSDP2's contract) over our process group: api (fully_shard,
FSDPModule), unit (one unit's gather / free / reduce-scatter and the shared schedule), param
(one sharded parameter as a DTensor), hooks (forward and autograd hooks), torch_methods
(register_fsdp_forward_method and torch's FSDPModule methods ours refuses or accepts)."""
