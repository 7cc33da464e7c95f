"""Tensor parallelism: the rank group and its collectives (state), sharded layers (layers), rank processes
(workers). At a world size of 1 every piece is the single-device code path."""
