"""Adapters that plug rollserve into RL trainers' own training loops.

Each talks to the gateway through `api.client` and reads the wire models of `core.schemas`, and
imports no other package of the project (`tests/test_layers.py`). `trainers.trl`: TRL's
`GRPOTrainer`, through its `rollout_func`.
"""
