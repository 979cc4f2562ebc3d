"""`nccl-ddp-run` (also `python -m nccl_ddp.launch`): one process per GPU, fail-fast, signals,
rank-prefixed output."""
from nccl_ddp.launch.launcher import LaunchConfig, launch, main, parse_args

__all__ = ["LaunchConfig", "launch", "main", "parse_args"]
