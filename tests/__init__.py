"""The test suite: one package per layer (engine, policies, kernels, server, sdk); shared fixtures and helpers here."""
