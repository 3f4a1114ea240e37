#!/bin/sh
# The preStop hook of an INIT pod's node-local RUN worker (worker-init.yaml), run when the pod
# is being stopped and before that RUN worker gets SIGTERM.
#
# The pod's INIT worker (Celery node name init@<pod>) stops taking jobs from `init` at once,
# but its process stays up (the boxes' keepers are its children, and die with its container);
# then the hook waits until the INIT stages it still runs are done, so that their jobs' RUN,
# queued on `run.<pod>`, is taken here before this RUN worker stops taking work.
# A failure here only means those jobs wait for the sweeper to start them over elsewhere.
set -u
node="init@${ROLLSERVE_NODE_NAME:?}"
celery -A broker.worker_app control cancel_consumer init -d "$node"
# `inspect active` lists the stages the worker runs (each with its "id"); it fails once the
# worker no longer answers.
while celery -A broker.worker_app inspect active -j -d "$node" | grep -q '"id"'; do
    sleep 5
done
