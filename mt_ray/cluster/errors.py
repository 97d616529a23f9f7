"""Errors of the cluster layer."""

from mt_ray.errors import MtRayError


class ClusterError(MtRayError, RuntimeError):
    """The data-parallel run cannot continue (too many failures, a lost shard, a bad batch)."""


class StaleGenerationError(MtRayError, RuntimeError):
    """A worker of an aborted generation asked for weights; it is about to be replaced."""


class ClusterLostError(ClusterError):
    """A part that holds the run's state (a coordinator shard, or its node) was lost, or a step was
    left half-applied with no snapshot: the run goes on only from a checkpoint, with a new cluster
    (what `jobs.train` does)."""


class StepTimeoutError(ClusterError):
    """A step ran past `cluster.step_timeout_s`: a hung worker or shard; the message names what it waits for."""
