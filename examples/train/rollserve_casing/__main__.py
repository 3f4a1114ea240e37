"""`python -m rollserve_casing --url http://127.0.0.1:8600 --steps 30 [--mode async]`: train the
casing policy through a running rollserve whose fleet serves the starting policy."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from rollserve_casing.grpo import Config, describe, train
from rollserve_casing.policy import make_policy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=None, help="the gateway (default: $ROLLSERVE_URL)")
    parser.add_argument("--base-model", type=Path, default=Path(".rollserve/tiny-qwen3"))
    parser.add_argument("--work-dir", type=Path, default=Path(".rollserve/casing"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--plain-ppo",
        action="store_true",
        help="clip against the service's logprobs (not decoupled)",
    )
    args = parser.parse_args(argv)
    policy = make_policy(args.base_model.resolve(), (args.work_dir / "start").resolve())
    cfg = Config(
        url=args.url or "",
        policy_dir=policy,
        work_dir=(args.work_dir / args.mode).resolve(),
        steps=args.steps,
        mode=args.mode,
        max_staleness=args.max_staleness,
        seed=args.seed,
        decoupled=not args.plain_ppo,
    )

    stats = train(cfg, lambda row: print(describe(row), flush=True))
    print(json.dumps([asdict(s) for s in stats]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
