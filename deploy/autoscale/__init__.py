"""The fleet autoscaler: sizes the INIT, RUN and EVAL worker fleets from their queues.

- `policy`: the pure decision (bounds, target busy share, cool-downs, hysteresis);
- `state`: each queue's waiting and in-flight jobs, read from Redis;
- `launcher`: the interface of where workers run, with `local` (processes here), `slurm`
  (batch jobs) and `kubernetes` (a Deployment's replicas);
- `autoscaler`: the loop; `command`: `rollserve autoscale`.
"""
