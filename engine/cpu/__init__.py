"""The C++ CPU kernels (csrc/) and their loader."""
