"""jaxlp's benchmark scripts (a source checkout only, not installed): ``python -m benchmarks``
lists them and runs one; the results are in ``benchmarks/RESULTS.md``."""
