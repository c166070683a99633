"""Benchmarks shipped with the package: ``streamkv bench serve`` (serve.py), the serving
benchmark in vLLM benchmark_serving's form. The other benchmarks live in the repository's
benchmarks/ folder."""
