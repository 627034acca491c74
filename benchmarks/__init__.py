"""Benchmarks of the etweedie ops (DESIGN §8): pytest-benchmark files and a table printer.

    pytest benchmarks/                      # pytest-benchmark, one group per workload
    python -m benchmarks.table [--quick]    # every workload, one markdown table
"""
