"""Typed configuration of a data-parallel run on Ray."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ClusterConfig(BaseModel):
    """How the data-parallel trainer places its actors and survives a lost worker."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    address: str | None = Field(
        None, description="Ray address to join; None: 'auto' when RAY_ADDRESS is set, else start Ray in-process."
    )
    gpus_per_worker: float | None = Field(
        None, ge=0, description="GPUs each worker actor reserves; None: 1 when the cluster has GPUs, else 0 (CPU)."
    )
    num_nodes: int = Field(
        1, ge=1, description="Nodes the workers spread over, the same number on each (a STRICT_SPREAD placement "
        "group). Each node has a coordinator shard that sums its workers' gradients and owns 1/num_nodes of the "
        "fp32 master weights and Adam moments, so a model may outgrow any one host and each node's gradient sum "
        "crosses the network once a step."
    )
    placement_timeout_s: float = Field(
        300.0, gt=0, description="How long to wait for the cluster to offer num_nodes nodes with room for their workers."
    )
    cpus_per_worker: float = Field(1.0, ge=0, description="CPUs each worker actor reserves.")
    coordinator_cpus: float = Field(
        0.0, ge=0, description="CPUs each coordinator shard reserves (its optimizer threads are set by "
        "engine.optimizer_threads)."
    )
    object_store_memory_gb: float | None = Field(
        None, gt=0, description="Object store size when Ray is started in-process; None: planned from the model "
        "(one version of the compute-dtype weights, the gradients held for clipping in the space the backward "
        "frees, and a few unit-sized gradients in flight per worker; `mt-ray calc --workers N` prints it)."
    )
    grad_reduce: Literal["host", "nccl"] = Field(
        "host", description="How a node's workers' gradients are summed. host: each lands in the node's shared "
        "memory and the coordinator shard adds them. nccl: the node's GPUs reduce each unit's gradient between them "
        "(torch.distributed; gloo on CPU workers) and one device->host copy per node lands the sum. Text models only."
    )
    grad_ring_mb: float | None = Field(
        None, gt=0, description="MiB of each further worker's gradient ring in its node's shared memory (grad_reduce "
        "host; the node's first worker lands in the gradient slots): gradients land in it in pieces of a quarter of "
        "it, copied out by the worker's ship thread, and the coordinator shard sums each piece as every worker's is "
        "in. None: two of the largest layers' gradients, at most 1 GiB. Smaller saves host memory per worker; a ring "
        "the shard cannot keep up with holds the worker's gradients on its GPU (at most a ring's worth), then its GPU."
    )
    rollout_gpus: float | None = Field(
        None, ge=0, description="GRPO's rollout (the policy's copies that sample completions). None: a rollout "
        "replica beside each worker, on its GPU (or CPUs), each generating a share of the prompts; a number: one "
        "replica with that many GPUs of its own on the first node, beside its workers (VERL's split layout), "
        "added to that node's bundle."
    )
    num_cpus: int | None = Field(None, ge=1, description="CPUs of an in-process Ray; None: all of them.")
    snapshot_every: int = Field(
        0, ge=0, description="Keep an in-memory copy of master weights and moments every N steps (12 B/param more "
        "per node). Only needed without clipping, where a worker lost mid-step can leave units updated: with a "
        "snapshot that step is replayed in memory, without one the run restarts from its newest checkpoint "
        "(cluster.job_restarts). With clipping a lost worker's step is simply redone. 0: no snapshots."
    )
    max_restarts: int = Field(3, ge=0, description="Worker failures survived before the run gives up.")
    job_restarts: int = Field(
        1, ge=0, description="Times `jobs.train` starts a new cluster and resumes from the newest checkpoint after "
        "losing the coordinator or a node (steps since that checkpoint are replayed exactly); 0: the job fails."
    )
    recovery_grace_s: float = Field(
        30.0, ge=0, description="After a failure, how long the other workers get to finish the step and be kept."
    )
    step_timeout_s: float | Literal["auto"] = Field(
        "auto", description="Seconds after which a step counts as hung: its worker is replaced and the step redone, "
        "and every wait inside the step (for weights, for a sum) ends with an error naming the unit. auto: 10x the "
        "calculator's estimate of the step, at least 600 s."
    )

    @field_validator("step_timeout_s")
    @classmethod
    def _positive(cls, v: float | str) -> float | str:
        if v != "auto" and v <= 0:
            raise ValueError("must be 'auto' or a positive number of seconds")
        return v
