"""The Ray settings the cluster needs: prompt frees of its object-store traffic, and no idle worker pool.

Weights and gradients no longer pass through the object store within a node (they live in the
node's shared-memory arena, mt_ray/cluster/arena.py), but with several nodes each step still
moves a model's worth of unit-sized objects through every store: partial sums to their owners,
updated units to the other nodes. Ray's raylet frees deleted objects in batches, once a second by
default (`free_objects_period_milliseconds`); at that traffic the second keeps many dead objects
in a store sized for a few alive at once, which then spills to disk. Measured on the H100 when
gradients went through the store (1.5B shape, one worker): 8.2 s a step with the calculated store
spilling, 2.8 s with room to spare. Freed every 10 ms, a store of the calculated size holds a step.

Ray also starts an idle Python worker per CPU once the first driver connects, for tasks to come.
The cluster runs no tasks, only its actors (each started in a process of its own), so those idle
workers (about 45 MiB each, 16 of them on a 16-core node) are node memory for nothing.

A Ray this process starts gets these as a system config; nodes started with `ray start` read
them from their environment (the mt-ray image sets them, and the README's `ray start` line
exports them, as RAY_<name>=<value>).
"""

FREE_OBJECTS_PERIOD_MS = 10
SYSTEM_CONFIG = {"free_objects_period_milliseconds": FREE_OBJECTS_PERIOD_MS, "prestart_worker_first_driver": False}
