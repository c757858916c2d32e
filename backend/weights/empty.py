"""Build a module without initialising its parameters, then give it the loaded tensors.

``parameters_on_meta()``: while it is active, every parameter a module registers is moved to
the meta device (shape and dtype, no memory), and ``torch.nn.init``'s initialisers leave a
meta tensor alone (there is nothing to fill; run on the meta device they still cost a
Python decomposition each, a quarter of a second for ResNet-152). Building ResNet-152 under
it takes milliseconds instead of the seconds its random initialisation costs, and allocates
nothing: the tensors the model serves are the state dict's own (``assign_state_dict``),
views of the weights file's pages. Buffers (batch-norm statistics, masks, a model's own
constants) are built as usual: they are small, and a non-persistent one is not in the state
dict.

Not every model can be built that way: one whose ``__init__`` reads its parameters' values
(``.item()``, numpy) fails on the meta device, and one whose ``_load_from_state_dict`` copies
instead of assigning leaves a parameter empty. ``assign_state_dict`` says so
(``NotAssignable``), and the caller builds the model the ordinary way instead.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

_install_lock = threading.Lock()
_installed = 0  # blocks active in any thread (the patch is in place while there are any)
_local = threading.local()  # this thread's depth of blocks


class NotAssignable(Exception):
    """The model cannot take the state dict's tensors as they are (the message says why)."""


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within the block, parameters registered by modules built in this thread live on the
    meta device.

    It patches ``torch.nn.Module.register_parameter`` (what ``nn.Module.__setattr__`` calls
    for a Parameter) and ``torch.nn.init``'s initialisers while any thread is in such a
    block; the patches leave other threads' modules, and every tensor not on the meta
    device, alone.
    """
    global _installed
    with _install_lock:
        if _installed == 0:
            torch.nn.Module.register_parameter = _register_on_meta  # type: ignore[method-assign,assignment]
            for name, skipping in _SKIPPING_INITS.items():
                setattr(torch.nn.init, name, skipping)
        _installed += 1
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
        with _install_lock:
            _installed -= 1
            if _installed == 0:
                torch.nn.Module.register_parameter = _REGISTER  # type: ignore[method-assign]
                for name, original in _INITS.items():
                    setattr(torch.nn.init, name, original)


_REGISTER = torch.nn.Module.register_parameter
#: torch.nn.init's in-place initialisers (their first argument is the tensor to fill).
_INITS: dict[str, Callable[..., Any]] = {
    name: getattr(torch.nn.init, name) for name in (
        "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
        "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
        "orthogonal_", "sparse_")
    if callable(getattr(torch.nn.init, name, None))}


def _skipping_meta(init: Callable[..., Any]) -> Callable[..., Any]:
    """``init``, returning a meta tensor untouched (filling it would do nothing)."""
    @functools.wraps(init)
    def skipping(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return init(tensor, *args, **kwargs)
    return skipping


_SKIPPING_INITS = {name: _skipping_meta(init) for name, init in _INITS.items()}


def _register_on_meta(module: torch.nn.Module, name: str,
                      param: torch.nn.Parameter | None) -> None:
    _REGISTER(module, name, param)
    if param is not None and param.device.type != "meta" and getattr(_local, "depth", 0) > 0:
        kind = type(param)
        module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)


def assign_state_dict(model: torch.nn.Module, state_dict: Mapping[str, Any], *,
                      private_buffers: bool = False) -> int:
    """Make the state dict's tensors the model's own (``load_state_dict(assign=True)``).

    A tensor whose dtype or layout differs from the module's is converted first, as
    ``load_state_dict`` would have copied it (the copy is this process's own); so is every
    buffer when ``private_buffers`` (tensors shared between processes, which a model must not
    change in place). A tied parameter saved once (safetensors' ``save_model`` drops the
    duplicates) is given to every name it has. Returns how many tensors were copied.

    Raises RuntimeError when the keys or shapes do not fit (``load_state_dict``'s message),
    and NotAssignable when a parameter or buffer is still on the meta device afterwards.
    """
    state = dict(state_dict)
    _fill_tied(model, state)
    targets = model.state_dict(keep_vars=True)
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    copied = 0
    for key, value in state.items():
        target = targets.get(key)
        if not isinstance(value, torch.Tensor) or not isinstance(target, torch.Tensor):
            continue  # load_state_dict names what does not fit
        fitted = _fitted(value, target, private=private_buffers and key in buffers)
        if fitted is not value:
            state[key] = fitted
            copied += 1
    model.load_state_dict(state, strict=True, assign=True)
    empty = [name for name, tensor in (*model.named_parameters(), *model.named_buffers())
             if tensor.is_meta]
    if empty:
        raise NotAssignable(f"{len(empty)} tensor(s) still empty after assignment "
                            f"({', '.join(empty[:3])}): the model's own state-dict hooks "
                            f"copy instead of assigning")
    return copied


def _fitted(value: torch.Tensor, target: torch.Tensor, *, private: bool) -> torch.Tensor:
    """``value``, or a copy of it in the target's dtype and strides (when they differ)."""
    if value.shape != target.shape:
        return value  # load_state_dict reports the size mismatch
    same_layout = value.stride() == target.stride() or (value.is_contiguous()
                                                         and target.is_contiguous())
    if not private and value.dtype == target.dtype and same_layout:
        return value
    copy = torch.empty_strided(target.size(), target.stride(), dtype=target.dtype,
                               device=value.device)
    with torch.no_grad():
        copy.copy_(value)
    return copy


def _fill_tied(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """For each tensor the model holds under several names, give the names the state dict
    lacks the value of one it has."""
    names: dict[int, list[str]] = {}
    for name, tensor in (*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(tensor), []).append(name)
    for aliases in names.values():
        present = [name for name in aliases if name in state]
        if present and len(present) < len(aliases):
            for name in aliases:
                state.setdefault(name, state[present[0]])
