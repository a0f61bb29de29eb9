"""Benchmarks of reshard against PyTorch DCP, Orbax and the physical limit.

Run ``python -m bench`` (or ``tox -e bench``) from the repository root; see
``python -m bench --help`` and ``docs/performance.md``. Every measured phase runs
in processes of its own (one per rank), started fresh, so peak RSS is per phase.

Modules
-------
harness
    Worker groups: spawn one process per rank, barrier, time, collect peak RSS.
worker
    The process side of the harness (``python -m bench.worker SPEC``).
data
    Workload definitions: tensor shapes, layouts, deterministic contents.
tasks_reshard, tasks_dcp, tasks_orbax, tasks_plain
    What one rank does in each phase, for each system.
workloads
    W1-W4 and the scaling runs: which groups run, which rows they give.
report
    Medians, ratios, targets, the markdown table.
"""
