"""Job specs and trajectories as the store and the client tests make them."""

from __future__ import annotations

from typing import Any

from broker.jobstore import JobSpec


def make_specs(n_tasks: int, group_size: int, batch_id: str | None = "b1") -> list[JobSpec]:
    specs = []
    for t in range(n_tasks):
        for s in range(group_size):
            specs.append(
                JobSpec(
                    task={"data_source": "math", "question": f"q{t}"},
                    data_source="math",
                    instance_id=f"task-{t}",
                    sampling={"max_tokens": 16},
                    agent={"max_turns": 2, "max_total_tokens": 64},
                    group_id=f"g{t}",
                    sample_index=s,
                    batch_id=batch_id,
                )
            )
    return specs


def make_trajectory(job_id: str, **fields: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "job_id": job_id,
        "group_id": fields.pop("group_id", f"g-{job_id}"),
        "instance_id": fields.pop("instance_id", f"i-{job_id}"),
        "data_source": fields.pop("data_source", "math"),
        "status": fields.pop("status", "completed"),
        "reward": fields.pop("reward", 1.0),
        "prompt_ids": [1, 2, 3],
        "response_ids": [4, 5, 6],
        "loss_mask": [1, 1, 0],
        "logprobs": [-0.5, -0.25, None],
        "turns": [
            {
                "type": "model",
                "prompt_ids": [1, 2, 3],
                "output_ids": [4, 5],
                "logprobs": [-0.5, -0.25],
                "finish_reason": "stop",
                "text": "hi",
            },
            {"type": "env", "observation_ids": [6], "text": "obs"},
        ],
    }
    data.update(fields)
    return data
