"""GRPO through rollserve, on CPU: rollouts and rewards from the service, the loss here,
weights pushed back to the service's inference fleet after every optimizer step.

Per step: a batch of `prompts` casing tasks, `group_size` samples each, is submitted through
the REST API; rollserve's EVAL grades every sample. Advantages are group-normalised rewards
(GRPO). The loss is PPO's clipped surrogate per token, with the importance ratio taken
against the logprobs the service returned (the policy that actually generated each token, as
its `policy_version` says), so tokens from older weights are weighted correctly; averaged over
the loss mask's tokens; optionally plus `kl` times a k3 estimate of KL to the starting policy.
By default the objective is decoupled PPO (AReaL's): the clip is taken against the trainer's
policy as the step began, and the service's logprobs enter as a capped importance weight.
After the step the new weights are saved and `update_weights` switches every backend to them
(drain, load, resume with `policy_version` = the step count). A trajectory of several segments
(`core.flatten.sequences`) is one sample per segment, each with its job's advantage: a job counts
once in its group's normalisation.

`mode="async"` overlaps rollout and training, one step off-policy (as AReaL and slime do):
batch k+1 is submitted before the trainer works on batch k, and rolls out while it trains;
jobs carry `agent.max_staleness`, so none trains on turns older than the bound allows.
"""

from __future__ import annotations

import math
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from api.client import RolloutClient
from core.flatten import sequences
from core.schemas import BatchAccepted, JobStatus, Segment, Trajectory
from rollserve_casing.policy import token_logprobs


@dataclass
class Config:
    url: str
    policy_dir: Path
    """The starting policy (what the fleet serves before the first step)."""
    work_dir: Path
    """Where each step's weights are written (on a disk the inference servers read)."""
    steps: int = 30
    prompts: int = 8
    group_size: int = 8
    max_tokens: int = 12
    lr: float = 3e-3
    clip: float = 0.2
    kl: float = 0.0
    ppo_epochs: int = 1
    """Optimizer updates per batch (each one step of the same policy version); the ratio
    against the service's logprobs and its clipping keep the later ones close."""
    decoupled: bool = True
    """Decoupled PPO (as AReaL): clip against the trainer's own policy as the batch found it
    (the proximal policy), and weight each token by proximal over behaviour probability (the
    service's logprobs), capped at `behaviour_cap`. Plain PPO clips against the behaviour
    policy itself, so tokens from older weights start outside the trust region and give no
    gradient, and off-policy batches learn less per step."""
    behaviour_cap: float = 5.0
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = 1
    on_stale: Literal["rerun", "drop"] = "rerun"
    seed: int = 0
    token: str | None = None
    threads: int = 1
    """Torch threads of the trainer (the rest of the machine rolls out)."""


@dataclass
class StepStats:
    step: int
    reward_mean: float
    seconds: float
    rollout_wait_s: float
    train_s: float
    switch_s: float
    switch_per_backend_s: dict[str, float]
    turn_versions: dict[int, int]
    """Model turns per policy version that generated them."""
    staleness: dict[int, int]
    """Model turns per steps they were behind the weights they were trained into."""
    failed: int
    max_ratio_deviation: float
    """Largest |ratio - 1| over the batch's tokens before the update (0 when on-policy)."""
    extra: dict[str, Any] = field(default_factory=dict)


def describe(row: StepStats) -> str:
    """One step's line of progress."""
    return (
        f"step {row.step:3d}  reward {row.reward_mean:.3f}  {row.seconds:5.1f}s  "
        f"(waited {row.rollout_wait_s:4.1f}s, trained {row.train_s:4.1f}s, "
        f"switch {row.switch_s:.2f}s)  versions {row.turn_versions}"
    )


def tasks_for(step: int, cfg: Config) -> list[dict[str, Any]]:
    rng = random.Random(cfg.seed * 100_003 + step)
    return [
        {"data_source": "casing", "words": rng.randint(3, 6), "case": "lower"}
        for _ in range(cfg.prompts)
    ]


def submit(client: RolloutClient, step: int, cfg: Config) -> BatchAccepted:
    return client.submit_batch(
        tasks_for(step, cfg),
        group_size=cfg.group_size,
        sampling={
            "max_tokens": cfg.max_tokens,
            "temperature": 1.0,
            "seed": cfg.seed * 7919 + step * cfg.group_size * cfg.prompts,
        },
        agent={"max_staleness": cfg.max_staleness, "on_stale": cfg.on_stale},
    )


def collect(client: RolloutClient, batch: BatchAccepted) -> list[Trajectory]:
    return list(client.iter_batch_results(batch.batch_id))


def advantages(trajectories: list[Trajectory]) -> list[float]:
    """Group-normalised rewards; 0 for a group whose rewards are all equal (no signal)."""
    groups: dict[str, list[int]] = {}
    for index, traj in enumerate(trajectories):
        groups.setdefault(traj.group_id, []).append(index)
    out = [0.0] * len(trajectories)
    for members in groups.values():
        rewards = [trajectories[i].reward or 0.0 for i in members]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(1, len(rewards) - 1))
        for i, r in zip(members, rewards, strict=True):
            out[i] = 0.0 if std < 1e-6 else (r - mean) / std
    return out


def samples(trajectories: list[Trajectory]) -> list[tuple[Segment, float]]:
    """Every segment of the trajectories with a response, each with its job's advantage
    (normalised over the jobs of its group, each job once)."""
    return [
        (part, advantage)
        for traj, advantage in zip(trajectories, advantages(trajectories), strict=True)
        for part in sequences(traj)
        if part.response_ids
    ]


class Trainer:
    """The policy being trained, its optimizer and the reference for the KL term."""

    def __init__(self, cfg: Config) -> None:
        import torch
        from transformers import AutoTokenizer, Qwen3ForCausalLM

        torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.torch = torch
        self.model = Qwen3ForCausalLM.from_pretrained(cfg.policy_dir, dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.policy_dir)
        self.pad = int(self.tokenizer.pad_token_id)
        self.reference = None
        if cfg.kl > 0:
            self.reference = Qwen3ForCausalLM.from_pretrained(cfg.policy_dir, dtype=torch.float32)
            self.reference.requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.version = 0

    def step(self, trajectories: list[Trajectory]) -> float:
        """`ppo_epochs` optimizer updates on the batch (the policy's version moves on by
        one); returns the largest |ratio - 1| of the first (0 when exactly on-policy)."""
        completed = [t for t in trajectories if t.status is JobStatus.completed]
        used = samples([t for t in completed if any(p.response_ids for p in sequences(t))])
        if not used:
            return 0.0
        proximal = None
        if self.cfg.decoupled:
            with self.torch.no_grad():
                rows = [(part.prompt_ids, part.response_ids) for part, _ in used]
                proximal, _ = token_logprobs(self.model, rows, self.pad)
        deviations = [self._update(used, proximal) for _ in range(self.cfg.ppo_epochs)]
        self.version += 1
        return deviations[0]

    def _update(self, used: list[tuple[Segment, float]], proximal: Any = None) -> float:
        torch = self.torch
        rows = [(part.prompt_ids, part.response_ids) for part, _ in used]
        logp, pad_mask = token_logprobs(self.model, rows, self.pad)
        span = logp.shape[1]
        behaviour = torch.zeros_like(logp)
        mask = torch.zeros_like(logp)
        for i, (part, _) in enumerate(used):
            n = len(part.response_ids)
            behaviour[i, :n] = torch.tensor([lp or 0.0 for lp in part.logprobs[:n]])
            mask[i, :n] = torch.tensor(part.loss_mask[:n], dtype=torch.float32)
        mask = mask * pad_mask
        adv = torch.tensor([a for _, a in used]).unsqueeze(1).expand(-1, span)
        deviation = torch.exp((logp.detach() - behaviour) * mask)
        weight = torch.ones_like(logp)
        anchor = behaviour
        if proximal is not None:
            anchor = proximal
            weight = torch.exp((proximal - behaviour) * mask)
            # Tokens whose behaviour probability is far below the proximal one are too
            # stale to correct: left out, as AReaL does past its cap.
            mask = mask * (weight <= self.cfg.behaviour_cap).float()
        ratio = torch.exp((logp - anchor) * mask)
        clipped = torch.clamp(ratio, 1 - self.cfg.clip, 1 + self.cfg.clip)
        surrogate = torch.minimum(ratio * adv, clipped * adv) * weight
        tokens = mask.sum().clamp(min=1.0)
        loss = -(surrogate * mask).sum() / tokens
        if self.reference is not None:
            with torch.no_grad():
                ref, _ = token_logprobs(self.reference, rows, self.pad)
            k3 = torch.exp(ref - logp) - (ref - logp) - 1
            loss = loss + self.cfg.kl * (k3 * mask).sum() / tokens
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(((deviation - 1).abs() * mask).max())

    def save(self, path: Path) -> Path:
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        for extra in ("generation_config.json", "chat_template.jinja"):
            source = self.cfg.policy_dir / extra
            if source.exists():
                shutil.copy(source, path / extra)
        return path


def publish(
    client: RolloutClient, trainer: Trainer, work_dir: Path
) -> tuple[float, dict[str, float]]:
    """Save the trainer's weights and switch the fleet to them; the seconds the switch took
    (in all, and per backend). The previous step's directory is removed once unused."""
    path = trainer.save(work_dir / f"policy-v{trainer.version}")
    began = time.perf_counter()
    report = client.update_weights(str(path), policy_version=trainer.version)
    seconds = time.perf_counter() - began
    failed = [b for b in report.backends if not b.ok]
    if failed:
        raise RuntimeError(f"weight update to version {trainer.version} failed: {failed}")
    old = work_dir / f"policy-v{trainer.version - 2}"
    shutil.rmtree(old, ignore_errors=True)
    return seconds, {b.id: b.total_seconds for b in report.backends}


def train(
    cfg: Config,
    on_step: Callable[[StepStats], None] | None = None,
    on_batch: Callable[[int, list[Trajectory]], None] | None = None,
) -> list[StepStats]:
    """Run `cfg.steps` GRPO steps through the service; the statistics of each. `on_step` sees
    each step's statistics, `on_batch` each step's trajectories as they came back."""
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg)
    stats: list[StepStats] = []
    with RolloutClient(cfg.url, token=cfg.token, timeout=120) as client:
        # The fleet serves the starting policy as version 0.
        publish_path = trainer.save(cfg.work_dir / "policy-v0")
        client.update_weights(str(publish_path), policy_version=0)
        pending = submit(client, 0, cfg)
        for step in range(cfg.steps):
            began = time.perf_counter()
            trajectories = collect(client, pending)
            waited = time.perf_counter() - began
            if on_batch is not None:
                on_batch(step, trajectories)
            if cfg.mode == "async" and step + 1 < cfg.steps:
                pending = submit(client, step + 1, cfg)  # rolls out while this one trains
            versions: Counter[int] = Counter()
            staleness: Counter[int] = Counter()
            for t in trajectories:
                for turn in t.turns:
                    if turn.type == "model" and turn.policy_version is not None:
                        versions[turn.policy_version] += 1
                        staleness[trainer.version - turn.policy_version] += 1
            started = time.perf_counter()
            deviation = trainer.step(trajectories)
            trained = time.perf_counter() - started
            switch, per_backend = publish(client, trainer, cfg.work_dir)
            if cfg.mode == "sync" and step + 1 < cfg.steps:
                pending = submit(client, step + 1, cfg)
            rewards = [t.reward for t in trajectories if t.reward is not None]
            row = StepStats(
                step=step,
                reward_mean=sum(rewards) / len(rewards) if rewards else 0.0,
                seconds=time.perf_counter() - began,
                rollout_wait_s=waited,
                train_s=trained,
                switch_s=switch,
                switch_per_backend_s=per_backend,
                turn_versions=dict(versions),
                staleness=dict(staleness),
                failed=sum(1 for t in trajectories if t.status is not JobStatus.completed),
                max_ratio_deviation=deviation,
            )
            stats.append(row)
            if on_step is not None:
                on_step(row)
    return stats
