"""A pytest plugin for ``tests.horovod_suite.suite``: loaded into each rank of Horovod's own
test run (``pytest -p tests.horovod_suite.horovod_inject``), it makes every ``hvd.DistributedOptimizer``
the tests build use one of our compressors, and writes each test's outcome on this rank to a
JSON file.

Environment: ``HVD_COMPRESS_SUITE_METHOD`` (a name in ``hvd_compress.COMPRESSORS``, or
"horovod" for Horovod's own optimizer untouched), ``HVD_COMPRESS_SUITE_PATH`` ("stock": the
compressor goes into ``hvd.DistributedOptimizer(compression=...)`` where the test leaves
Horovod's default; "wrapper": ``hvd_compress.DistributedOptimizer`` replaces it),
``HVD_COMPRESS_SUITE_OUT`` (a folder: ``outcomes.<rank>.json``).

In every job, Horovod's baseline included, ``torch.optim.Optimizer.__subclasses__()`` leaves out
the optimizers newer than the tests that refuse the tests' models (``NEWER_THAN_TESTS``): Horovod
0.28.1's ``test_broadcast_state``, ``test_broadcast_state_options`` and ``test_force_allreduce``
loop over all of them, and ``torch.optim.Muon`` (PyTorch 2.9+) takes only 2-D parameters, so
those tests would fail on Horovod's own optimizer before reaching ours."""

import json
import os
from pathlib import Path

OUTCOMES = {}
NEWER_THAN_TESTS = ("Muon",)


def _hide_newer_optimizers():
    import torch

    def subclasses(cls):
        return [c for c in type.__subclasses__(cls) if c.__name__ not in NEWER_THAN_TESTS]

    torch.optim.Optimizer.__subclasses__ = classmethod(subclasses)


def pytest_configure(config):
    _hide_newer_optimizers()
    method = os.environ["HVD_COMPRESS_SUITE_METHOD"]
    if method == "horovod":
        return
    import horovod.torch as hvd

    import hvd_compress as hc

    stock = hvd.DistributedOptimizer
    path = os.environ["HVD_COMPRESS_SUITE_PATH"]

    def compressed(optimizer, named_parameters=None, compression=hvd.Compression.none, **options):
        if compression is not hvd.Compression.none:  # the test chose a Horovod compressor
            return stock(optimizer, named_parameters=named_parameters, compression=compression, **options)
        ours = hc.COMPRESSORS[method].build(small=True)
        if path == "stock":
            return stock(optimizer, named_parameters=named_parameters, compression=ours, **options)
        return hc.DistributedOptimizer(optimizer, named_parameters, ours, **options)

    hvd.DistributedOptimizer = compressed


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        previous = OUTCOMES.get(report.nodeid)
        if previous in (None, "passed"):  # a failure in set-up or tear-down counts too
            OUTCOMES[report.nodeid] = report.outcome


def pytest_sessionfinish(session):
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0"))
    out = Path(os.environ["HVD_COMPRESS_SUITE_OUT"])
    (out / f"outcomes.{rank}.json").write_text(json.dumps(OUTCOMES, indent=1, sort_keys=True))
