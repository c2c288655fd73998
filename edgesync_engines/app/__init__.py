"""The app surface: the ``edgesync`` command, run reports, the real workloads and fidelity runs.

Modules:

* :mod:`.cli`: the ``edgesync`` entry point (``main``) and its parser; the subcommands live in
  :mod:`.cli_model` (generate, run, export-onnx), :mod:`.cli_store` (dump, clear, reindex),
  :mod:`.compact` (compact), :mod:`.cli_fidelity` (fidelity); :mod:`.cli_common` holds what they
  share (``CommandError``: one ``error:`` line, exit 2);
* :mod:`.run_report`: the summary and table of ``edgesync run``;
* :mod:`.workloads`: the real request workloads (``seed``, ``doc-qa``) built from the shared data;
* :mod:`.fidelity` (+ :mod:`.fidelity_vectors`, its vector cache): what the approximate mode
  serves and how its answers compare.

Nothing here is imported by the request path or the store.
"""
