"""How `make test` spreads the suite over pytest-xdist workers (`-n N --dist loadgroup`).

The suite mostly waits (Ray starting and stopping, subprocesses, servers), so several workers share CI's two
cores. A unit of work is a test module (its module-scoped fixtures, a Ray session among them, are built
once), or an `xdist_group`. Two rules:

- Units that start Ray (or another long multi-process flow, marked `slow`) carry an `xdist_group` named
  `heavy:<module>` (tests/conftest.py adds it), and while plain modules are left, at most `HEAVY_AT_ONCE`
  of them run at a time: the rest of the workers take plain modules meanwhile. Ray clusters side by side
  beside CPU-bound modules on two cores would starve each other's heartbeats and the tests' bounded waits.
- Units start longest first (`SECONDS`, measured; an unlisted module counts as short), so the run does not
  end waiting on one long module that started last.

No test depends on this: any order and any worker count give the same results (`-n 0` included).
"""

from __future__ import annotations

from collections import OrderedDict

from xdist.scheduler import LoadScopeScheduling

HEAVY = "heavy:"
HEAVY_AT_ONCE = 2

# Each long module's total test time, in seconds, from a 4-worker run on a loaded 2-core machine: only the
# order matters. Regenerate from `--durations=0` when a module's time changes much.
SECONDS = {
    "tests/unit/cluster/test_data_parallel.py": 1800,
    "tests/unit/engine/test_sizing.py": 1250,
    "tests/integration/cluster/test_train_data_parallel.py": 1190,
    "tests/unit/engine/test_family_sweep.py": 715,
    "tests/integration/notebooks/test_notebooks.py": 700,
    "tests/unit/engine/test_parity.py": 580,
    "tests/unit/cluster/test_data_parallel_preference.py": 560,
    "tests/unit/cluster/test_data_parallel_grpo.py": 520,
    "tests/unit/training/test_grpo_trl.py": 510,
    "tests/integration/cluster/test_sweep.py": 475,
    "tests/unit/engine/test_calculator.py": 415,
    "tests/integration/cluster/test_sharded_nodes.py": 410,
    "tests/unit/engine/test_preference.py": 405,
    "tests/integration/cluster/test_node_memory.py": 350,
    "tests/unit/engine/test_kept_blocks.py": 330,
    "tests/integration/cluster/test_sweep_job.py": 300,
    "tests/unit/cluster/test_data_parallel_vlm.py": 145,
    "tests/integration/tracking/test_mlflow_server.py": 145,
    "tests/unit/engine/test_optimizer_overlap.py": 125,
    "tests/unit/engine/test_evaluate.py": 125,
    "tests/integration/cluster/test_job_submit.py": 115,
    "tests/unit/training/test_auto_fit.py": 110,
    "tests/integration/tracking/test_sigkill_resume.py": 110,
    "tests/unit/models/test_weights_io.py": 105,
    "tests/integration/cluster/test_two_nodes.py": 100,
    "tests/unit/engine/test_state_on_nvme.py": 80,
    "tests/integration/infra/test_stack_env.py": 75,
    "tests/unit/models/test_grouped_experts.py": 75,
    "tests/integration/test_cli_and_demo.py": 60,
    "tests/integration/tracking/test_sigkill_resume_nvme.py": 60,
}


def module_of(scope: str) -> str:
    return scope.removeprefix(HEAVY)


class SuiteScheduling(LoadScopeScheduling):
    """LoadScopeScheduling with module units ordered longest first and at most HEAVY_AT_ONCE heavy ones running."""

    def _split_scope(self, nodeid: str) -> str:
        if nodeid.rfind("@") > nodeid.rfind("]"):  # an xdist_group (a '@' inside a parameter id is not one)
            return nodeid.rsplit("@", 1)[-1]
        return nodeid.split("::", 1)[0]

    def schedule(self) -> None:
        if self.collection is None and self.collection_is_completed:
            self.config.option.loadscopereorder = False  # the order is ours, set below
            self._assign_work_unit = lambda node: False
            try:
                super().schedule()  # checks the workers' collections and queues the units; assigns nothing
            finally:
                del self._assign_work_unit
            units = sorted(self.workqueue.items(), key=lambda kv: -SECONDS.get(module_of(kv[0]), len(kv[1]) * 0.1))
            self.workqueue = OrderedDict(units)
        for node in self.nodes:
            self._reschedule(node)

    def _reschedule(self, node) -> None:
        """Give `node` units until it holds at least 3 tests (xdist's heuristic), or none may start now."""
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        while self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
            if not self._assign_work_unit(node):
                return

    def _heavy_running(self) -> int:
        """Heavy units a worker is on. One with a single test left counts no more: xdist holds a worker's last
        test back until the worker is given more work (or told to stop), so that worker must be free to take one."""
        return sum(1 for work in self.assigned_work.values() for scope, unit in work.items()
                   if scope.startswith(HEAVY) and list(unit.values()).count(False) >= 2)

    def _assign_work_unit(self, node) -> bool:
        # Once no plain module is left to run beside them, heavy units take every free worker.
        heavy_free = (self._heavy_running() < HEAVY_AT_ONCE
                      or all(s.startswith(HEAVY) for s in self.workqueue))
        scope = next((s for s in self.workqueue if heavy_free or not s.startswith(HEAVY)), None)
        if scope is None:
            return False  # only heavy units wait: this worker gets one when a heavy unit ends (mark_test_complete)
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])
        return True

    def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
        super().mark_test_complete(node, item_index, duration)
        for other in self.nodes:  # a worker left waiting for a heavy slot may take one now
            if other is not node and self._pending_of(self.assigned_work.get(other, {})) < 2:
                self._reschedule(other)
