"""Tensor parallelism on torch.distributed (gloo on CPUs, NCCL on GPUs).

``sharding`` (which slice of each weight a rank holds), ``parallel_state`` (the group and its
collectives), ``weights`` (reading only a rank's shard), ``launcher`` (where ranks run, how they
meet, core pinning), ``worker`` (a rank's start-up and order loop), ``tp_runner`` (rank 0's
runner, which sends every step's plan to the workers) and ``kv_tiers`` (each rank's share of the
disk / remote KV tier).
"""
