"""Horovod 0.28.1's own optimizer tests with each of our compressors injected: the runner
(``suite.py``: one ``mpirun -np 2`` job per method and path, outcomes to a JSON record) and the
pytest plugin loaded into every rank (``horovod_inject.py``). ``python -m benchmarks
horovod_suite`` runs it from the checkout's root and writes its page from the record."""
