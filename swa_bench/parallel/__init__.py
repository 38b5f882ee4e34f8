"""Replay beyond one device: data-parallel route agreement, tensor/expert-parallel model shards and
the collectives they need, on torch.distributed (torchrun; NCCL on GPUs, gloo on CPU)."""
