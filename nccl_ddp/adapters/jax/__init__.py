"""JAX: the array adapter and the sharded optax step."""
