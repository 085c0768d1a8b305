"""What every benchmark shares: how its jobs are launched and bounded (``jobs``), the machine it
ran on (``machine``), step-time statistics (``stats``) and the writing of its page and figures
from its JSON record (``render``)."""
