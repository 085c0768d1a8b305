import os

# Single-process tests must not pick up a launcher's environment by accident.
os.environ.setdefault("OMP_NUM_THREADS", "1")
