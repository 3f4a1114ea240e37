"""Runs mini-swe-agent (2.4.6) on one task, without a human, inside a job's box.

Run with the harnesses' Python (`sandbox.harnesses.harness_python()`) under the endpoint
forwarder (`sandbox.keeper.run_harness`), which sets `OPENAI_BASE_URL` and `OPENAI_API_KEY`:

    python mini_swe_agent.py --task-file /workspace/.task.md --model openai/SERVED-NAME
        [--step-limit 50] [--cwd /workspace] [--command-timeout 60] [--actions toolcall|text]
        [--output /tmp/mini.traj.json] [--retries 3]

mini-swe-agent's own loop (`DefaultAgent`, no prompts, no confirmations) with its commands run
as subprocesses of this one (`LocalEnvironment`, in `--cwd`) and litellm as its model client
(`openai/...` goes to `OPENAI_BASE_URL`), cost tracking off (an unknown model has no price).
`--actions toolcall` (its v2 default, `mini.yaml`) declares one `bash` tool and runs each tool
call; `text` (`mini_textbased.yaml`) runs the one ```mswea_bash_command block of each reply.
The agent ends when a command's output starts with the line
`COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` (the rest of it is the submission), at the step
limit, or on an error. The last line on stdout is a JSON summary (`exit_status`,
`submission`, `model_calls`); the exit status is 0 when it submitted, 2 at a limit, 3 after
repeated format errors, 1 on an error. The trajectory goes to `--output` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

EXIT_STATUS = {"Submitted": 0, "LimitsExceeded": 2, "TimeExceeded": 2, "RepeatedFormatError": 3}


def quiet_environment(retries: int) -> None:
    """What mini-swe-agent and litellm read before they are imported: no banner, no first-run
    setup, no fetch of litellm's price list (the box has no network), no cost tracking, few
    retries against an endpoint that refuses, and a config dir in the writable /tmp."""
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    os.environ.setdefault("MSWEA_CONFIGURED", "true")
    os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
    os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", str(retries))
    os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", "/tmp/.mini-swe-agent")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import litellm
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import get_config_from_spec
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    litellm.suppress_debug_info = True  # its hints on stdout are for humans
    text = args.actions == "text"
    config = get_config_from_spec("mini_textbased.yaml" if text else "mini.yaml")
    model_kwargs = dict(config["model"].get("model_kwargs", {}))
    if os.environ.get("OPENAI_BASE_URL"):
        model_kwargs["api_base"] = os.environ["OPENAI_BASE_URL"]
    model_class = LitellmTextbasedModel if text else LitellmModel
    model_config = {**config["model"], "model_name": args.model, "model_kwargs": model_kwargs}
    model = model_class(**model_config, cost_tracking="ignore_errors")
    environment = LocalEnvironment(
        **{**config["environment"], "cwd": args.cwd, "timeout": args.command_timeout}
    )
    agent_config = {key: value for key, value in config["agent"].items() if key != "mode"}
    agent_config.update(step_limit=args.step_limit, cost_limit=0, output_path=args.output)
    agent = DefaultAgent(model, environment, **agent_config)
    task = Path(args.task_file).read_text(encoding="utf-8")
    try:
        result = agent.run(task)
    except Exception as exc:  # the agent recorded it as its last message too
        result = {"exit_status": type(exc).__name__, "submission": "", "error": str(exc)}
    return {**result, "model_calls": agent.n_calls}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task-file", required=True, help="the task's instruction")
    parser.add_argument("--model", required=True, help="litellm's name: openai/SERVED-NAME")
    parser.add_argument("--step-limit", type=int, default=50, help="model calls at most")
    parser.add_argument("--cwd", default="/workspace", help="where commands run")
    parser.add_argument("--command-timeout", type=int, default=60, help="seconds per command")
    parser.add_argument("--actions", choices=("toolcall", "text"), default="toolcall")
    parser.add_argument("--output", type=Path, default=None, help="trajectory file")
    parser.add_argument("--retries", type=int, default=3, help="attempts per model call")
    args = parser.parse_args(argv)
    quiet_environment(args.retries)
    summary = run(args)
    print(json.dumps({k: summary.get(k) for k in ("exit_status", "submission", "model_calls",
                                                   "error") if k in summary}))  # fmt: skip
    return EXIT_STATUS.get(str(summary.get("exit_status")), 1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
