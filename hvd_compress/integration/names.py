"""Parameters' names: which parameter a gradient belongs to (stock Horovod calls
``compress(p.grad)`` without the name, and ``p.grad`` is a new tensor every step under
``zero_grad(set_to_none=True)``), and the names of an optimizer's parameters."""

import sys

import torch

from hvd_compress import arguments


class GradientOwners:
    """Maps a gradient tensor to its parameter's name.

    A post-accumulate-grad hook on each parameter records ``id(p.grad) -> name``; these hooks
    fire before Horovod's hook on the same parameter calls ``compress``, so lookups are O(1).
    Gradients created elsewhere (Horovod zero-fills parameters that got no gradient) are found
    by identity among the parameters' current gradients. A sparse gradient that Horovod
    densified (``sparse_as_dense=True``) is a new tensor: its parameter is the one Horovod's
    ``_allreduce_grad_async(p)`` is working on, read from the call stack."""

    def __init__(self, named_parameters):
        self.parameters = named_parameters
        self._by_grad_id = {}
        self._hooks = [
            param.register_post_accumulate_grad_hook(self._recorder(name))
            for name, param in named_parameters.items()
            if param.requires_grad
        ]

    def _recorder(self, name):
        def record(param):
            self._by_grad_id[id(param.grad)] = name

        return record

    def name_of(self, grad):
        name = self._by_grad_id.get(id(grad))
        if name is not None and self.parameters[name].grad is grad:
            return name
        for name, param in self.parameters.items():
            if param.grad is grad:
                return name
        return self._name_of_parameter_being_reduced(grad)

    def _name_of_parameter_being_reduced(self, grad):
        frame = sys._getframe(1)
        while frame is not None:
            param = frame.f_locals.get("p")
            if torch.is_tensor(param) and param.shape == grad.shape:
                for name, candidate in self.parameters.items():
                    if candidate is param:
                        return name
            frame = frame.f_back
        return None

    def remove(self):
        for hook in self._hooks:
            hook.remove()


def parameter_names(param_groups, named_parameters):
    """{parameter: name} over the optimizer's ``param_groups``, with Horovod's checks and its
    default names (``allreduce.noname.i.j``)."""
    if named_parameters is None:
        return {
            p: f"allreduce.noname.{i}.{j}"
            for i, group in enumerate(param_groups)
            for j, p in enumerate(group["params"])
        }
    named = arguments.named_parameters("DistributedOptimizer", named_parameters)
    by_param = {p: name for name, p in named.items()}
    unnamed = [p for group in param_groups for p in group["params"] if p not in by_param]
    if unnamed:
        raise ValueError(
            f"named_parameters: {len(unnamed)} optimizer parameter(s) are not named, "
            f"with shapes {[tuple(p.shape) for p in unnamed]}"
        )
    return {p: by_param[p] for group in param_groups for p in group["params"]}
