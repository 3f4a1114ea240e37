"""What the benchmarks share: the report conventions and the baselines they run in workers.

Nothing here is a benchmark itself (`make bench` runs `bench/*.py`, not this package).
"""
