"""EdgeSync benchmarks: scripts that print measured figures beside a baseline (not tests; never
run in CI). Run one with ``.venv/bin/python -m benchmarks.<name>`` from the project root."""
