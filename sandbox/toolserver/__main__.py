"""``python -m sandbox.toolserver --socket PATH [--tcp HOST:PORT] [--workdir DIR]``."""

import os
import sys

from sandbox.toolserver.server import main

code = main()
# Everything the server owned (shell, kernel, socket, scratch files) is released by now;
# skipping the interpreter's teardown saves ~15 ms on every sandbox stop.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
