"""Run by tests/test_elastic.py: which controller a run has inside ``hvd.elastic.run``."""

import horovod.torch as hvd

hvd.init()


@hvd.elastic.run
def report(state):
    if hvd.rank() == 0:
        print(f"CONTROLLER gloo={hvd.gloo_enabled()} mpi={hvd.mpi_enabled()} size={hvd.size()}", flush=True)


report(hvd.elastic.TorchState())
