"""The job store in Redis: job records, state transitions, trajectories, group and batch counters.

Every write that decides a job's fate is one Lua script (the `.lua` files under `lua/`, each
headed by its KEYS and ARGV), so a stage that runs twice (after a redelivery) or a cancel
racing a finishing worker cannot record a job twice. `JobStore` composes one class per
concern over one Redis connection (`base`): `records` (job records and trajectories),
`batches` (progress and result streams), `dynamic` (dynamic-sampling batches, cancellation
passes), `marks` (stage marks, stop confirmation), `liveness` (heartbeats, held stages,
the once-only takeover of a dead worker's stage) and `metrics`.

Dynamic-sampling (DAPO) batches keep their whole bookkeeping in the same scripts: the script
that records a job's end also decides, when it was the last job of its group, the group's
verdict (accepted, filtered, failed, cancelled, surplus), draws and creates the next groups
from the batch's task pool, and flips the batch to `cancelling` when its target is met — all
atomically, so concurrent workers never overdraw or cancel twice. Keys (`{p}` is the prefix):

- `{p}batch:{b}` hash: the plain batch counters, and for a dynamic batch `dynamic`=1, `state`
  (`running` → `draining` | `cancelling` → `done`), `target`, `inflight_max`, `attempts_max`,
  `early_cancel`, `pool_size`, `groups_seq|drawn|inflight|accepted|filtered|failed|cancelled|
  surplus`, `rollouts_*` and `seconds_*` (`used`, `filtered`, `wasted`), `t_target`, `t_done`;
- `{p}batch:{b}:spec` hash: `task:{i}`, `ds:{i}`, `iid:{i}` per pool task, `agent`, and
  `sampling:{a}` per attempt (attempt a of a task samples with seeds `seed + a*G + i`);
- `{p}batch:{b}:draws` list: pool indexes still to draw (a set-aside task is pushed back while
  it has attempts left); `{p}batch:{b}:attempts` hash: draws per pool index;
- `{p}batch:{b}:done` stream (any batch): the id of each job of the batch that ended, appended
  once by the finish script, in finishing order;
- `{p}batch:{b}:accepted` stream: job ids of accepted groups, then one `end` entry when the
  batch is done (a batch's results stream reads `done`, or `accepted` for a dynamic batch; the
  entry ids are the place in it that the gateway's cursors name); `{p}batch:{b}:groups`
  list: accepted group ids in order;
- `{p}batch:{b}:unsent` sorted set: drawn jobs whose Celery chain is not yet sent (by time);
- `{p}batch:{b}:stopping` set (any batch): cancelled jobs not yet confirmed stopped — a stage
  of theirs still running (`active` in the job hash) or a sandbox not yet released — plus one
  token per cancellation pass in progress. A cancelling batch is done when it empties.

Dynamic jobs are created inside the scripts with ids `{b}-{seq}-{i}` (group `{b}-{seq}`); the
scripts compute keys from the prefix, so the store needs one Redis server (not a Cluster).
"""

from broker.jobstore.liveness import Holding
from broker.jobstore.metrics import STAGE_BUCKETS
from broker.jobstore.model import (
    DynamicOptions,
    FinishOutcome,
    JobNotFound,
    JobRecord,
    JobSpec,
    PoolTask,
    job_of_task,
    stage_task_ids,
)
from broker.jobstore.store import JobStore

__all__ = [
    "STAGE_BUCKETS",
    "DynamicOptions",
    "FinishOutcome",
    "Holding",
    "JobNotFound",
    "JobRecord",
    "JobSpec",
    "JobStore",
    "PoolTask",
    "job_of_task",
    "stage_task_ids",
]
