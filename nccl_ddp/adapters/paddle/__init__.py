"""PaddlePaddle: the module adapter and its DDP wrapper."""
