"""Training draft heads (Medusa-1 now), on accelerate: one script for CPU, multi-process and multi-GPU."""
