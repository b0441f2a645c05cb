"""Comparisons and studies: each module is a script (`python -m benchmarks.NAME --help`) whose
figures land in results/. Not installed: they run from a checkout."""
