"""The app surface: the ``edgesync`` command, run reports, the real workloads and fidelity runs."""
