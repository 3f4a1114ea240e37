#!/usr/bin/env python3
"""A stand-in `kubectl` for the Kubernetes launcher's tests: no cluster runs there.

It appends its arguments (one JSON list a line) to `$FAKE_KUBECTL_DIR/calls.jsonl` and keeps
each Deployment's replica count in `$FAKE_KUBECTL_DIR/replicas.json`: `get deployment/NAME
--output=json` answers `{"spec": {"replicas": N}}` (exit 1 for an unknown one, as kubectl
does), `scale deployment/NAME --replicas=N` sets it.
"""

import json
import os
import sys
from pathlib import Path

state_dir = Path(os.environ["FAKE_KUBECTL_DIR"])
args = sys.argv[1:]
with (state_dir / "calls.jsonl").open("a") as calls:
    calls.write(json.dumps(args) + "\n")
replicas_file = state_dir / "replicas.json"
replicas = json.loads(replicas_file.read_text()) if replicas_file.exists() else {}
name = next((a.split("/", 1)[1] for a in args if a.startswith("deployment/")), "")
if args[:1] == ["get"]:
    if name not in replicas:
        print(f'Error from server (NotFound): deployments.apps "{name}" not found', file=sys.stderr)
        sys.exit(1)
    print(json.dumps({"kind": "Deployment", "spec": {"replicas": replicas[name]}}))
elif args[:1] == ["scale"]:
    count = next(int(a.split("=", 1)[1]) for a in args if a.startswith("--replicas="))
    replicas[name] = count
    replicas_file.write_text(json.dumps(replicas))
    print(f"deployment.apps/{name} scaled")
else:
    print(f"fake kubectl: unsupported {args}", file=sys.stderr)
    sys.exit(2)
