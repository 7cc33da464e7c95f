"""Sparse-attention methods, KV codecs and pruning scorers against references from their definitions."""
