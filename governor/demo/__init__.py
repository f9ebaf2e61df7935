"""The demo model ladders (`governor demo-models`): tooling for `make run`, the tests and the benchmarks, not the
runtime engine."""
