"""echonccl-perf: nccl-tests-style bandwidth and accuracy tools for echonccl's collectives.

``mpirun -np N echonccl-perf -b 1K -e 1G -f 2`` (or ``python -m echonccl.perf.all_reduce``)
times the baseline all-reduce (NCCL on GPU, plain and, NCCL >= 2.27, on
symmetric windows; MPI on CPU) against echonccl's 4-bit algorithms over a
sweep of sizes, checks every result against the exact float64 sum, and
prints a table (plus JSON, CSV and a plot on request).

`all_reduce` describes the all-reduce and holds the console script's
``main``; the rest is shared by every tool: `bench` (the driver: `run`,
`Bench`, timing), `options` (command line, sizes), `arrays` (numpy/cupy
arrays, input data), `check` (accuracy against the exact reference, the
`Result`/`Row` records), `table` (header, table, footer, progress bar) and
`report` (summary, JSON/CSV/plot files). ``python -m echonccl.perf.report
run.json --markdown --plot run.png`` re-reads a ``-J`` file: a markdown
table, the plot.
"""
