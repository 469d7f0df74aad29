"""Measuring this machine: CPU description, matmul/copy/disk rates, the CPU compute dtype."""
