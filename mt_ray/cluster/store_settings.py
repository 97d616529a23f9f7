"""The Ray setting a data-parallel step's object-store traffic needs: prompt frees.

Each step moves several model-sized sets of objects through every node's object store
(workers' gradients, held sums, published weights), and the calculator sizes the store for
the objects alive at once. Ray's raylet frees deleted objects in batches, once a second by
default (`free_objects_period_milliseconds`); at this traffic that second keeps up to a model's
worth of dead objects in the store, which then spills to disk. Measured on the H100 with the
1.5B shape and one worker: 8.2 s a step with the calculated store spilling, 2.8 s with room to
spare (a 40 GiB store, which the dead objects then filled). Freed every 10 ms, a store of the
calculated size holds the step.

A Ray this process starts gets it as a system config; nodes started with `ray start` read it
from their environment (the mt-ray image sets it, and the README's `ray start` line exports it).
"""

FREE_OBJECTS_PERIOD_MS = 10
SYSTEM_CONFIG = {"free_objects_period_milliseconds": FREE_OBJECTS_PERIOD_MS}
