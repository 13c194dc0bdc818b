"""The guard's route handlers, one module per job; the route table is :mod:`gateway.guard.app`."""
