"""The Ray setting the cluster's object-store traffic needs: prompt frees.

Weights and gradients no longer pass through the object store within a node (they live in the
node's shared-memory arena, mt_ray/cluster/arena.py), but with several nodes each step still
moves a model's worth of unit-sized objects through every store: partial sums to their owners,
updated units to the other nodes. Ray's raylet frees deleted objects in batches, once a second by
default (`free_objects_period_milliseconds`); at that traffic the second keeps many dead objects
in a store sized for a few alive at once, which then spills to disk. Measured on the H100 when
gradients went through the store (1.5B shape, one worker): 8.2 s a step with the calculated store
spilling, 2.8 s with room to spare. Freed every 10 ms, a store of the calculated size holds a step.

A Ray this process starts gets it as a system config; nodes started with `ray start` read it
from their environment (the mt-ray image sets it, and the README's `ray start` line exports it).
"""

FREE_OBJECTS_PERIOD_MS = 10
SYSTEM_CONFIG = {"free_objects_period_milliseconds": FREE_OBJECTS_PERIOD_MS}
