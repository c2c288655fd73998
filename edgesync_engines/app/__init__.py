"""The app surface: the ``edgesync`` command (:mod:`.cli`, which lists its subcommand modules).

Nothing here is imported by the request path or the store.
"""
