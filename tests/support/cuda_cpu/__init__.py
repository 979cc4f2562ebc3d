"""The CUDA kernels of kernels/bucket.cu built for and run on the CPU (tests only): translate.py,
cuda_cpu.h, runtime.py."""
