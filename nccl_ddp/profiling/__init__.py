"""Seeing the overlap: the step timeline with its NVTX ranges (timeline.py, what the reducer and
the shard core time their phases on) and what a step's spans say (step_summary.py, pure math on
host times that scripts use alone)."""

from nccl_ddp.profiling.timeline import PHASES, Timeline

__all__ = ["PHASES", "Timeline"]
