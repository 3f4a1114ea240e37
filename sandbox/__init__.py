"""Sandboxes for agents' tools: one interface (`sandbox.base`), several backends
(`sandbox.backends`), a reaper for orphans (`sandbox.reaper`), and the tool server that runs
inside a box (`sandbox.toolserver`).

Nothing is imported here: the tool server starts inside every sandbox as
`python -m sandbox.toolserver`, and importing the backends first would slow that start.
"""
