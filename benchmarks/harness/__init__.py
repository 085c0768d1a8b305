"""What every benchmark shares: its jobs (``jobs``), the machine it ran on (``machine``), step
times (``stats``), training a workload on every rank (``training``), the method labels of its
tables (``methods``) and its page and figures, written from its JSON record (``render``)."""
