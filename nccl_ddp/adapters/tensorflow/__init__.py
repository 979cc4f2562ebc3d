"""TensorFlow: the variable/tensor adapter."""
