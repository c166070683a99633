"""Benchmarks shipped with the package: ``streamkv bench serve`` (serve.py, with its clients
in serve_client.py and the server it watches in server_process.py), the serving benchmark in
vLLM benchmark_serving's form. The other benchmarks live in the repository's benchmarks/
folder."""
