"""The Triton backend: one portable Triton kernel source per config (FP8 and BF16)."""
