"""What every compressor shares: per-parameter settings and state, input checks, the dense
path, and Horovod's ``compress``/``decompress`` entry points.

A compressor is a state object (settings and per-parameter state, keyed by parameter name)
plus ``begin(name, grad) -> Round``: pure tensor work, no communication. The integration
layer (``hvd_compress.integration``) runs the rounds on Horovod.
"""
import math

import torch
from hvd_compress.comm.rounds import Collective, Round, Traffic

# Horovod's all-reduce sums these dtypes; anything else (bf16) travels as float32.
_ALLREDUCE_DTYPES = (torch.float16, torch.float32, torch.float64)


class Compressor:
    """Base class. Subclasses set ``setting_name`` and implement ``_check_setting``,
    ``_compressible`` and ``_begin``.

    ``named_parameters`` (e.g. ``model.named_parameters()``) lets the compressor tell which
    parameter each gradient belongs to when stock ``hvd.DistributedOptimizer`` calls
    ``compress(p.grad)`` without a name. ``min_numel``: smaller gradients, and every 1-D
    gradient, are all-reduced uncompressed.
    """

    setting_name = "setting"
    # False for compressors that keep no per-parameter state and need no name.
    needs_parameter_names = True

    def __init__(self, named_parameters=None, *, default, min_numel=1024):
        if not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"{type(self).__name__}: min_numel must be a non-negative integer, "
                             f"got {min_numel!r}")
        self.parameters = dict(named_parameters) if named_parameters is not None else {}
        self.min_numel = min_numel
        self._check_setting(None, default, None)
        self.default = default
        self._overrides = {}
        self.state = {}
        self.rank, self.size = 0, 1
        self.traffic = Traffic()

    # ----- settings, addressable by parameter name ---------------------------------------
    def setting(self, name):
        return self._overrides.get(name, self.default)

    def set_setting(self, name, value):
        """Changes one parameter's setting from the next step on. Controllers call this on
        every rank at the same step; a rank-only change makes payload shapes disagree."""
        param = self.parameters.get(name)
        self._check_setting(name, value, None if param is None else param.numel())
        self._overrides[name] = value

    def settings(self):
        """{name: setting} for every known parameter."""
        return {name: self.setting(name) for name in self.parameters}

    def _check_setting(self, name, value, numel):
        raise NotImplementedError

    def _error(self, name, message):
        where = f"parameter {name!r}: " if name is not None else ""
        return ValueError(f"{type(self).__name__}: {where}{message}")

    # ----- the exchange protocol ------------------------------------------------------------
    def bind_world(self, rank, size):
        self.rank, self.size = rank, size
        self.traffic.world_size = size

    def begin(self, name, grad):
        """Starts the exchange of ``grad`` (the gradient of parameter ``name``)."""
        if not grad.dtype.is_floating_point:
            raise TypeError(f"{type(self).__name__}: parameter {name!r}: gradient has dtype "
                            f"{grad.dtype}; only floating-point gradients can be compressed")
        if grad.numel() == 0:
            raise ValueError(f"{type(self).__name__}: parameter {name!r}: gradient is empty "
                             f"(shape {tuple(grad.shape)})")
        setting = self.setting(name)
        if not self.compresses(grad.shape, setting):
            return dense_round(grad)
        self._check_setting(name, setting, grad.numel())
        return self._begin(name, grad)

    def compresses(self, shape, setting):
        """Whether a gradient of ``shape`` is compressed at ``setting`` (else sent dense)."""
        return math.prod(shape) >= self.min_numel and self._compressible(shape, setting)

    def _compressible(self, shape, setting):
        """1-D gradients (biases, norms) are a tiny share of the bytes: send them dense."""
        return len(shape) >= 2

    def payload_bytes(self, shape, setting):
        """Bytes handed to collectives per step for a float32 gradient of ``shape`` at
        ``setting``: what L-GreCo's size table counts (indices and norms included)."""
        if not self.compresses(shape, setting):
            return 4 * math.prod(shape)
        return self._compressed_bytes(shape, setting)

    def _compressed_bytes(self, shape, setting):
        raise NotImplementedError

    def end_step(self, comm_seconds=None):
        """Called by the integration once per optimizer step, after every gradient landed;
        ``comm_seconds``: how long the step waited for communication, where measured."""
        self.traffic.end_step()

    def _begin(self, name, grad):
        raise NotImplementedError

    # ----- configuration, checkpointing -------------------------------------------------------
    def config(self):
        """Constructor settings that must agree on every rank."""
        return {"min_numel": self.min_numel, "default": self.default}

    def describe(self):
        return {"compressor": type(self).__name__, "config": self.config(),
                "settings": dict(sorted(self._overrides.items()))}

    def state_dict(self):
        return {"settings": dict(self._overrides),
                "state": {name: dict(vars(st)) for name, st in self.state.items()}}

    def load_state_dict(self, state_dict):
        self._overrides = dict(state_dict["settings"])
        self.state = {name: self._new_state_from(values)
                      for name, values in state_dict["state"].items()}

    def _new_state_from(self, values):
        raise NotImplementedError

    def __getstate__(self):
        # Traffic counts this process's steps; a restored compressor starts counting afresh.
        state = dict(self.__dict__)
        state["traffic"] = Traffic(world_size=self.size)
        return state


def dense_round(grad):
    """All-reduce ``grad`` uncompressed (bf16 travels as float32: Horovod cannot sum bf16)."""
    dtype, shape = grad.dtype, grad.shape
    payload = grad if dtype in _ALLREDUCE_DTYPES else grad.float()
    return Round(payload.reshape(-1), Collective.ALLREDUCE,
                 lambda mean: mean.view(shape).to(dtype), last=True)


def check_positive_int(compressor, name, label, value, upper=None):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise compressor._error(name, f"{label} must be a positive integer, got {value!r}")
    if upper is not None and value > upper:
        raise compressor._error(name, f"{label}={value} is outside (0, {upper}]")
