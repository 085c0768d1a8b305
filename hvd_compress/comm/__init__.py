"""The communication plan: which collective carries each payload, and in what order rounds run."""
from hvd_compress.comm.rounds import Collective, Round, Traffic

__all__ = ["Collective", "Round", "Traffic"]
