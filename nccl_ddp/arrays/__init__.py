"""Arrays and which framework they belong to, below the core: frameworks (the table of adapters,
loaded by name; `NativeArray`, the NumPy/CuPy arrays the core works on) and dlpack (arrays and
dtypes in and out through DLPack). Nothing here imports a framework."""
