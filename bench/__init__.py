"""kvstage's benchmarks: one ``bench_<name>.py`` module per part, each with ``run(quick) -> dict``.

Run them all with ``python -m bench`` (or ``python bench/run_all.py``); see :mod:`bench.run_all`.
Not part of the installed package.
"""
