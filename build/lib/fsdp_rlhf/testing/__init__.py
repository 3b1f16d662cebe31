"""Fixtures for the tests, the demo and the benchmark: tiny models and a tokenizer built
locally, synthetic data sets, and a local torchrun command line. Not used by the trainers."""
