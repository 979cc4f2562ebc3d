"""Flat gradient buckets, below both the DDP core (ddp/) and sharding (zero/): which tensor sits
where in which bucket (layout) and the flat buffers that hold them (memory)."""
