"""`nccl-ddp-run` (also `python -m nccl_ddp.launch`): one process per GPU, fail-fast, signals,
rank-prefixed output."""

from nccl_ddp.launch.cli import main, parse_args
from nccl_ddp.launch.config import LaunchConfig
from nccl_ddp.launch.launcher import launch

__all__ = ["LaunchConfig", "launch", "main", "parse_args"]
