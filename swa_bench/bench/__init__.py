"""Measuring: timing with raw samples, FLOPs and peak memory, the environment, threshold advice."""
