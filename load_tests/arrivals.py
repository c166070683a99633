"""Open-loop arrival times; they live in the package (streamkv/bench/arrivals.py), where
``streamkv bench serve`` uses them too."""

from streamkv.bench.arrivals import arrival_times, parse_rates

__all__ = ["arrival_times", "parse_rates"]
