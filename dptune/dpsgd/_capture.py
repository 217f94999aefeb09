"""A model as one captured program: what every trial, check and final training runs instead of the user's Python.

Why capture. The clipping guard used to *probe* a model: run it on a few batches and measure each example's effect.
A probe measures the batches it is shown, and three rounds of red-teaming each found a model that behaved at the
probe's batch sizes and mixed rows at another (a padded size the probe never tried, the Nth call, a draw from
numpy's generator). The property "each example moves the clipped sum by at most C" must hold for every batch a
trial can draw, so it is made a property of the program that trains:

- ``capture`` traces the model once, before anything is charged, with ``torch.fx`` symbolic tracing: the input is
  a symbol, not a tensor of some size, so the trace is one graph for every batch size. Python that runs while
  tracing runs once: a call counter, a draw from ``numpy``/``random``, a module-level cache are evaluated at
  capture and fixed in the graph as constants (or left out); a branch on the input's value or size cannot be
  traced and is refused by name (ConfigError: exit 2, nothing charged). Parameters and buffers are explicit nodes.
- train() and eval() are traced separately (``self.training`` is Python, read while tracing); the captured model
  runs the train graph in training mode and the eval graph in evaluation mode (scoring), both over one set of
  parameters: ``CapturedModel`` owns the user's layers (same names, same objects) and none of its Python.
- torch.nn's own layers stay calls of the layer (Opacus' per-layer engines hook them), as does dptune's WSConv2d;
  a user's module, even a subclass of nn.Linear, is traced through, so its weight transforms are graph nodes.

What the graph proves is ``_rows``' job (``row_independence``)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn

from dptune.config import ConfigError
from dptune.models import WSConv2d

__all__ = ["CapturedModel", "capture"]

_OWN_LEAVES = (WSConv2d,)  # dptune's own parameter-owning layers, kept as calls (audited rules in _rows)


class _Tracer(fx.Tracer):
    def __init__(self) -> None:
        super().__init__()
        self.record_stack_traces = True  # a refusal names the user's source line

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, _OWN_LEAVES) or super().is_leaf_module(m, qualname)


def _compile(graph: fx.Graph) -> Any:
    """The graph's Python, as a function of the module that owns its attributes (``forward(self, x)``)."""
    code = graph.python_code(root_module="self")
    scope = dict(code.globals)
    exec(compile(code.src, "<dptune captured program>", "exec"), scope)  # noqa: S102 (fx's own generated code)
    return scope["forward"]


def _adopt(src: nn.Module, dst: nn.Module, target: str) -> None:
    """The top-level attribute of ``src`` that ``target`` lies in, the very object (a child module with its whole
    subtree, so names, indexing and the state dict stay the user's; a parameter, a buffer, a constant)."""
    field = target.split(".")[0]
    if hasattr(dst, field):
        return
    value = getattr(src, field)
    if isinstance(value, nn.Module):
        dst.add_module(field, value)
    elif isinstance(value, nn.Parameter):
        dst.register_parameter(field, value)
    elif isinstance(value, torch.Tensor):
        dst.register_buffer(field, value, persistent=field in getattr(src, "_buffers", {}) and
                            field not in getattr(src, "_non_persistent_buffers_set", set()))
    else:
        setattr(dst, field, copy.deepcopy(value))


class CapturedModel(nn.Module):
    """The user's layers, parameters and buffers, and two graphs over them: ``train_graph`` (training mode) and
    ``eval_graph`` (evaluation mode). Its forward is the graph of its mode; nothing of the user's Python runs."""

    def __init__(self, root: nn.Module, train_graph: fx.Graph, eval_graph: fx.Graph, name: str) -> None:
        super().__init__()
        for graph in (train_graph, eval_graph):
            for node in graph.nodes:
                if node.op in ("get_attr", "call_module"):
                    _adopt(root, self, node.target)
        for field, child in root.named_children():  # layers the graphs do not call stay (state dict, engines)
            if not hasattr(self, field):
                self.add_module(field, child)
        for field, p in root.named_parameters(recurse=False):
            if not hasattr(self, field):
                self.register_parameter(field, p)
        for field, value in vars(root).items():  # plain public attributes (sizes, names) for who reads them
            if not field.startswith("_") and field != "training" and not hasattr(self, field):
                setattr(self, field, value)
        self.train_graph, self.eval_graph, self.captured_from = train_graph, eval_graph, name
        self._programs()

    def _programs(self) -> None:
        self._train_fn, self._eval_fn = _compile(self.train_graph), _compile(self.eval_graph)

    def graph(self, training: bool) -> fx.Graph:
        return self.train_graph if training else self.eval_graph

    def forward(self, x: torch.Tensor) -> Any:
        return (self._train_fn if self.training else self._eval_fn)(self, x)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_train_fn", None)
        state.pop("_eval_fn", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._programs()

    def extra_repr(self) -> str:
        return f"captured from {self.captured_from}"


def capture(model: nn.Module) -> CapturedModel:
    """``model`` as one program for every batch (module docstring); ConfigError naming the construct that cannot
    be captured. The model is left in training mode; a captured model is returned as it is."""
    if isinstance(model, CapturedModel):
        return model
    graphs = []
    try:
        for training in (True, False):
            model.train(training)
            with _custom_functions_refused():
                graph = _Tracer().trace(model)
            _no_state_written(model)
            graph.owning_module = model  # type: ignore[assignment]  # for the impurity checks of its layer calls
            graph.eliminate_dead_code(_impure)  # what reaches neither the output nor a state does not run
            graph.lint()
            graph.owning_module = None
            graphs.append(graph)
    except ConfigError:
        raise
    except Exception as e:  # fx raises TraceError, RuntimeError, TypeError, ... for what it cannot hold
        raise ConfigError("model", f"its forward pass cannot be captured as one program valid for every batch "
                          f"({_construct(e)})", _fix(e)) from e
    finally:
        model.train()
    return CapturedModel(model, graphs[0], graphs[1], type(model).__name__)


class _CustomFunction(Exception):
    """A ``torch.autograd.Function`` called on the traced input: tracing would keep its forward, not its backward."""


@contextlib.contextmanager
def _custom_functions_refused() -> Iterator[None]:
    """While tracing, a custom ``torch.autograd.Function`` applied to a traced value raises ``_CustomFunction``: fx
    would trace its forward as plain ops and its own backward would silently not train."""
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, fx.Proxy) for a in (*args, *kwargs.values())):
            raise _CustomFunction(cls.__name__)
        return original.__get__(None, cls)(*args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        torch.autograd.Function.apply = original  # type: ignore[method-assign]


def _impure(node: fx.Node) -> bool:
    """A node dead-code elimination keeps: fx's own rule, and every in-place op (``buf.mul_(0.9)``: it declares a
    mutation, which the analysis then judges)."""
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    return node.is_impure() or (name.endswith("_") and not name.endswith("__")) or bool(node.kwargs.get("inplace"))


def _no_state_written(model: nn.Module) -> None:
    """Refuse a forward pass that stores a value it computed in the model (``self.prev = h.mean(0)``): state kept
    between calls. Tracing leaves the symbol there, so the attribute is found by name."""
    for prefix, m in model.named_modules():
        for key, value in vars(m).items():
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, fx.Proxy) for v in items):
                name = f"{prefix}.{key}" if prefix else key
                raise ConfigError("model", f"its forward pass writes self.{name} (state kept between forward "
                                  "passes: the next batch would see this one)", "keep no state between forward "
                                  "calls: compute what forward needs from its input and the parameters")


def _construct(e: Exception) -> str:
    if isinstance(e, _CustomFunction):
        return f"a custom torch.autograd.Function ({e}), whose own backward a captured program would not run"
    text = (str(e).splitlines() or [""])[0].strip()
    if "control flow" in text:
        return "a Python branch or loop on a value computed from the input, e.g. `if x.shape[0] == 16:` or " \
               "`if x.sum() > 0:`"
    if "does not belong to this Graph" in text or "different tracer" in text.lower():
        return "a value kept from an earlier call (a cache, an attribute or a global written by forward) used again"
    if "'len' is not supported" in text or "cannot be iterated" in text:
        return "len() of, or a Python loop over, the input or a tensor computed from it"
    return f"{type(e).__name__}: {text[:200]}"


def _fix(e: Exception) -> str:
    if isinstance(e, _CustomFunction):
        return "write it with torch operations (autograd derives their gradient) or a torch.nn layer"
    if "does not belong to this Graph" in str(e):
        return "keep no state between forward calls: compute what forward needs from its input and the parameters"
    return ("compute the same operations for every batch: a per-row condition as torch.where(cond, a, b), "
            "sizes as x.flatten(1) or x.view(x.size(0), -1), and any choice that depends on the batch made in "
            "__init__ instead")
