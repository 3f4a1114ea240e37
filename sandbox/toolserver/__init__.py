"""The in-sandbox tool server: bash, IPython, a file editor and finish over a Unix socket.

Run as ``python -m sandbox.toolserver --socket PATH [--workdir DIR]``; talk to it with
`sandbox.toolclient`. The wire format is in `sandbox.toolserver.protocol`. This package is
started inside every sandbox, so importing it stays cheap: nothing heavy at import time.
"""
