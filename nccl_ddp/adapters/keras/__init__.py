"""Keras 3: DistributedOptimizer, variable broadcast and the grad reducer on keras.Variables."""
