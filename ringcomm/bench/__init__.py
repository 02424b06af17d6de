"""ringcomm.bench: the nccl-tests style benchmark driver, with NCCL and MPI baselines side by side.

Run ``mpiexec -n 4 python -m ringcomm.bench -b 8 -e 128M -f 2`` (or ``ringcomm-bench``); see
``--help``. Modules:

- :mod:`~ringcomm.bench.sizes`: sizes and suffixes, sweeps, element counts, algbw/busbw (pure);
- :mod:`~ringcomm.bench.data`: exactly representable test data and independent expected results;
- :mod:`~ringcomm.bench.impls`: the implementations compared (ringcomm, MPI, NCCL) on shared buffers;
- :mod:`~ringcomm.bench.runner`: warm-up, timing, checking, the cross-rank reduction of a row;
- :mod:`~ringcomm.bench.report`: the table (and its parser), JSON, the plot;
- :mod:`~ringcomm.bench.env`: versions, devices, node layout, the NCCL library a user names;
- :mod:`~ringcomm.bench.cli`: argument parsing that behaves under mpiexec;
- :mod:`~ringcomm.bench.__main__`: the command line, ``main(argv)``.
"""
