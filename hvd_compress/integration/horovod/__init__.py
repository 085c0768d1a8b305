"""Horovod: the stock optimizer's Compression API (``compression.py``), our
``DistributedOptimizer`` (``optimizer.py``) and the elastic state handlers (``elastic.py``). Each
imports Horovod at module level; the package loads them only where Horovod imports."""
