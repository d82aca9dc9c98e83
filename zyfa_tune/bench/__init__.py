"""`zyfa-tune bench`: our kernels beside FA3, cuDNN and SDPA in one process, and its report."""
