"""MindSpore: the Cell adapter and its DDP wrapper."""
