"""Free task slots as run_elastic's growth check counts them, on a fake SparkContext whose status tracker lags the
scheduler as Spark's does (it learns of tasks from the listener bus)."""

from __future__ import annotations

from types import SimpleNamespace

from spark_hvd.runner.slots import free_slots_beside, group_tasks


class _Tracker:
    """A status tracker whose jobs (by group) each have one stage with ``active`` tasks."""

    def __init__(self, per_executor: list[int], groups: dict[str, int]) -> None:
        self.per_executor, self.groups = per_executor, groups
        self._jobs = {i: g for i, g in enumerate(groups)}

    # the JVM tracker (executor infos) and pyspark's (jobs and stages by group) in one
    def getExecutorInfos(self):
        return [SimpleNamespace(numRunningTasks=lambda n=n: n) for n in self.per_executor]

    def getJobIdsForGroup(self, group):
        return [i for i, g in self._jobs.items() if g == group]

    def getJobInfo(self, job_id):
        return SimpleNamespace(stageIds=[job_id])

    def getStageInfo(self, stage_id):
        return SimpleNamespace(numActiveTasks=self.groups[self._jobs[stage_id]])


def _context(total: int, tracker: _Tracker):
    profiles = SimpleNamespace(defaultResourceProfile=lambda: "default")
    jvm = SimpleNamespace(maxNumConcurrentTasks=lambda profile: total, resourceProfileManager=lambda: profiles,
                          statusTracker=lambda: tracker)
    return SimpleNamespace(_jsc=SimpleNamespace(sc=lambda: jvm), statusTracker=lambda: tracker)


def test_a_stage_the_tracker_has_not_counted_yet_holds_its_slots():
    # 2 slots: another job's task (counted) and our 1-rank attempt's task, not yet counted by the tracker; the old
    # check (total - counted running) saw a free slot and relaunched "to grow" onto the same 1 slot, again and again
    lagging = _Tracker(per_executor=[1], groups={"spark_hvd-xa1": 0, "holder": 1})
    assert free_slots_beside(_context(2, lagging), "spark_hvd-xa1", ours=1) == 0
    counted = _Tracker(per_executor=[2], groups={"spark_hvd-xa1": 1, "holder": 1})
    assert free_slots_beside(_context(2, counted), "spark_hvd-xa1", ours=1) == 0
    assert group_tasks(_context(2, counted), "holder") == 1


def test_a_slot_freed_by_another_job_is_seen():
    done = _Tracker(per_executor=[1], groups={"spark_hvd-xa1": 1, "holder": 0})
    assert free_slots_beside(_context(2, done), "spark_hvd-xa1", ours=1) == 1
    assert free_slots_beside(_context(4, done), "spark_hvd-xa1", ours=1) == 3
