"""echonccl-perf: nccl-tests-style bandwidth and accuracy tools for echonccl's collectives.

``mpirun -np N echonccl-perf -b 1K -e 1G -f 2`` (or ``python -m echonccl.perf.all_reduce``)
times the baseline all-reduce (NCCL on GPU, MPI on CPU) against echonccl's
4-bit algorithms over a sweep of sizes, checks every result against the
exact float64 sum, and prints a table (plus JSON, CSV and a plot on request).

`common` is the driver every tool shares; `all_reduce` describes the
all-reduce and holds the console script's ``main``.
"""
