"""Workers as the replicas of one Kubernetes Deployment per queue, scaled with `kubectl`.

The fleet of `queue` is the Deployment `<prefix>-<queue>` (as `deploy/k8s` would define
it, each pod running `rollserve worker <queue>`); scaling sets its replica count with
`kubectl scale deployment/<name> --replicas=N` and reading it uses `kubectl get deployment`.
A pod Kubernetes removes gets SIGTERM on its main process, which is Celery's warm shutdown:
the Deployment's `terminationGracePeriodSeconds` must exceed the longest stage, or the kubelet
kills the pod (SIGKILL) with its job. Which pods go is Kubernetes' choice, not ours. The
shipped manifests also define KEDA ScaledObjects on the same Deployments: use one or the
other, or the two fight over the replica count.

No client library: `kubectl` on PATH, with whatever context and credentials it has. The
tests drive a stand-in `kubectl` that records its arguments; no cluster runs there.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

from deploy.autoscale.launcher import Launcher, LauncherError, Worker, run_command


class KubernetesLauncher(Launcher):
    """Sets the replica count of each queue's Deployment in `namespace`."""

    name = "k8s"

    def __init__(
        self,
        namespace: str | None = None,
        prefix: str = "rollserve-worker",
        kubectl: str = "kubectl",
        env: dict[str, str] | None = None,
    ) -> None:
        self.namespace = namespace
        self.prefix = prefix
        self.kubectl = kubectl
        self.env = dict(os.environ if env is None else env)

    def deployment(self, queue: str) -> str:
        return f"{self.prefix}-{queue}"

    def _run(self, *args: str) -> str:
        argv = [self.kubectl, *args]
        if self.namespace:
            argv += ["--namespace", self.namespace]
        return run_command(argv, self.env, f"kubectl {args[0]}")

    def replicas(self, queue: str) -> int:
        """The replica count the queue's Deployment asks for."""
        out = self._run("get", f"deployment/{self.deployment(queue)}", "--output=json")
        try:
            return int(json.loads(out)["spec"].get("replicas", 1))
        except (ValueError, KeyError, TypeError) as exc:
            raise LauncherError(f"kubectl get deployment: unreadable answer: {exc}") from exc

    def set_replicas(self, queue: str, count: int) -> None:
        self._run("scale", f"deployment/{self.deployment(queue)}", f"--replicas={count}")

    def workers(self, queue: str) -> list[Worker]:
        name = self.deployment(queue)
        return [Worker(f"{name}#{i}", queue, 0.0) for i in range(self.replicas(queue))]

    def start(self, queue: str, count: int) -> list[Worker]:
        current = self.replicas(queue)
        self.set_replicas(queue, current + count)
        name = self.deployment(queue)
        return [Worker(f"{name}#{i}", queue, time.time()) for i in range(current, current + count)]

    def stop(self, queue: str, workers: Sequence[Worker]) -> None:
        self.set_replicas(queue, max(0, self.replicas(queue) - len(workers)))

    def scale(self, queue: str, desired: int) -> int:
        current = self.replicas(queue)
        if desired != current:
            self.set_replicas(queue, desired)
        return current
