"""Load tests and the open-loop serving benchmark (``python -m load_tests.bench --help``)."""
