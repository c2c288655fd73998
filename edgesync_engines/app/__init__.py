"""The app surface: the ``edgesync`` command.

Modules:

* :mod:`.cli`: the ``edgesync`` entry point (``main``) and its parser; the subcommands live in
  :mod:`.cli_model` (generate, export-onnx), :mod:`.cli_store` (dump, clear, reindex),
  :mod:`.cli_docs` (docs), :mod:`.compact` (compact), :mod:`.cli_serve` (serve);
  :mod:`.cli_common` holds what they share (``CommandError``: one ``error:`` line, exit 2).
  The measurement commands (run, bench, fidelity) are added by ``edgesync-bench``
  (``benchmarks/``) through the entry-point group ``edgesync.commands``.

Nothing here is imported by the request path or the store.
"""
