"""Tensor parallelism: the process group and the collectives the parallel layers use."""
