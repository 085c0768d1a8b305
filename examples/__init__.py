"""The examples, run as scripts (``python examples/train_digits.py``), and what benchmarks and
tests import from them as a package from the checkout's root: the workloads (``workloads/``) and
advise's model factories (``models.py``)."""
