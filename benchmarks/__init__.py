"""EdgeSync's measurement code, the ``edgesync-bench`` distribution (import name ``edgesync_bench``,
folder ``benchmarks/``): benchmarks that print measured figures beside a baseline (not tests;
never run in CI), the real workloads, fidelity and RAG evaluation, run reports, and the
``edgesync run``/``bench``/``fidelity`` commands (:mod:`.commands`, entry points of the group
``edgesync.commands``). Run a benchmark with ``python -m edgesync_bench.<name>``; README.md says
why this is a distribution of its own."""
