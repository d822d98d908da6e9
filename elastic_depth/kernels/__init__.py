"""Pallas kernels for elastic-depth (import the submodules, e.g. `kernels.kl_halting`)."""
