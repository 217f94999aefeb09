"""Whether a captured program keeps the rows of its batch apart, proven from its graph for every batch size.

The per-layer engines (hooks, ghost, book-keeping, alc) compute each example's gradient from the batch's
activations; they are exact only when no operation lets one row of the batch reach another: then row i of every
activation is a function of example i alone, for any batch, of any size, and one example moves the clipped sum by
at most C. ``row_independence`` proves this of a ``CapturedModel``'s graph (train or eval), or names the first node
that it cannot prove:

1. **Batch-carrying values** are the nodes that depend on the input (data flow from the placeholder); parameters,
   buffers and constants do not.
2. **Every batch-carrying tensor has the batch at dim 0**, and the rest of its shape does not depend on the batch:
   the graph is run on ``BATCHES`` (two sizes, random inputs, no data) and each such tensor must be ``(B, *s)``
   with the same ``s`` at both. This refuses every reduction, reshape, transpose, slice, concatenation or product
   that loses or moves the batch dim (``x.mean(0)``, ``x.t()``, ``x.view(-1)``, ``x[1:]``, ``x @ x.T``).
3. **Every operation on one is on an allow-list** with its rule: elementwise ops (broadcast against constants or
   other rows' own values), torch.nn's row-wise layers (linear, convolutions, GroupNorm, LayerNorm, pooling, ...;
   only their input may carry the batch, never their weight), reshapes, and ops along a dim that must not be dim
   0 (softmax, cumsum, sort, flip, roll, normalize: these keep the shape, so rule 2 alone would not see them).
   Indexing must keep dim 0 whole (``x[:, 1]``, never ``x[perm]``); a product of two batch-carrying tensors must be
   batched (both at least 3-d). An unknown operation is refused with its name.
4. **The batch size itself never enters a computation**: a value computed from the input's size (``x.size(0)``) may
   only give a shape its leading dim (``x.view(x.size(0), -1)``). Under Poisson sampling the batch size depends on
   every example, so a model that scaled or branched on it would let one example move every other's gradient.
5. **No buffer or parameter is written from data** (an in-place op on one, with a batch-carrying operand).

Rules 2 to 5 are checked node by node, so the proof covers every batch size: the graph is the same program for all
of them (``_capture``), and each node's rule holds for it whatever the size (rule 2's two sizes fix which dim is
the batch; rule 4 keeps the size out of every value). torch.nn modules outside the list (BatchNorm, RNNs,
attention) are refused: they are not proven, and the engines are not trusted with them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from dptune.config import ConfigError, clipping
from dptune.dpsgd._capture import CapturedModel
from dptune.models import WSConv2d, channels_last

__all__ = ["BATCHES", "Mixing", "check_program", "row_independence"]

def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


BATCHES = (7, 11)  # two batch sizes, coprime with each other and with the usual channel and class counts

_ELEMENTWISE = _words("""add sub subtract rsub mul multiply div divide true_divide floor_divide truediv floordiv mod
remainder fmod pow neg negative pos abs absolute exp exp2 expm1 log log2 log10 log1p sqrt rsqrt square reciprocal sin
cos tan tanh sinh cosh asin acos atan atan2 asinh acosh atanh sigmoid relu relu6 gelu silu elu selu celu leaky_relu
hardtanh hardswish hardsigmoid mish softplus softsign logsigmoid tanhshrink hardshrink softshrink threshold sign sgn
floor ceil round trunc frac clamp clip clamp_min clamp_max maximum minimum fmax fmin where lerp erf erfc erfinv
masked_fill nan_to_num addcmul addcdiv isfinite isnan isinf logical_not logical_and logical_or logical_xor and_ or_
xor invert lt le gt ge eq ne float double half bfloat16 to type type_as contiguous clone detach dropout dropout1d
dropout2d dropout3d alpha_dropout feature_alpha_dropout prelu rrelu copysign hypot logit xlogy""")
_SHAPE = _words("""view reshape view_as reshape_as expand expand_as flatten unflatten squeeze unsqueeze chunk split
tensor_split narrow select cat concat concatenate stack hstack repeat tile pad movedim moveaxis permute transpose
swapaxes swapdims t""")
_LAYERS = _words("""linear conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d group_norm layer_norm
rms_norm instance_norm embedding max_pool1d max_pool2d max_pool3d avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d
adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d lp_pool1d
lp_pool2d interpolate upsample pixel_shuffle pixel_unshuffle channel_shuffle local_response_norm""")
# ops along one dim that keep the shape (rule 2 cannot see them) or reduce it: the dim must be given and not 0.
# name -> (position of the dim after the tensor, its default: None = every dim, or the implicit legacy dim)
_ALONG: dict[str, tuple[int, int | None]] = {
    **dict.fromkeys(("softmax", "log_softmax", "softmin", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp",
                     "sum", "mean", "nansum", "nanmean", "prod", "amax", "amin", "max", "min", "argmax", "argmin",
                     "std", "var", "norm", "logsumexp", "all", "any", "median", "count_nonzero"), (1, None)),
    "normalize": (2, 1), "cosine_similarity": (2, 1), "glu": (1, -1), "sort": (1, -1), "argsort": (1, -1),
    "topk": (2, -1), "kthvalue": (2, -1), "flip": (1, None), "roll": (2, None)}
_PRODUCTS = {"matmul", "mm", "bmm", "einsum", "tensordot", "outer", "inner", "dot", "bilinear", "baddbmm", "kron"}
_SIZES = {"size", "dim", "ndimension", "numel", "nelement"}
_SIZE_ATTRS = {"shape", "ndim", "dtype", "device", "is_cuda", "requires_grad"}
_GIVES_SHAPE = {"view", "reshape", "expand", "new_zeros", "new_ones", "new_empty", "new_full", "zeros", "ones",
                "empty", "full", "rand", "randn", "unflatten"}

_ROW_MODULES: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.GroupNorm, nn.LayerNorm, nn.Embedding, nn.Identity, nn.Flatten, nn.Unflatten, nn.ReLU, nn.ReLU6, nn.GELU,
    nn.SiLU, nn.ELU, nn.SELU, nn.CELU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid,
    nn.Mish, nn.Softplus, nn.Softsign, nn.LogSigmoid, nn.PReLU, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
    nn.AlphaDropout, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d, nn.Upsample, nn.PixelShuffle, nn.PixelUnshuffle, nn.ZeroPad2d, nn.ConstantPad1d,
    nn.ConstantPad2d, nn.ConstantPad3d, nn.ReflectionPad1d, nn.ReflectionPad2d, nn.ReplicationPad1d,
    nn.ReplicationPad2d, nn.Softmax, nn.LogSoftmax, nn.Softmin)


@dataclass(frozen=True)
class Mixing:
    """The first node the analysis cannot prove row-independent: its name, what it is, where in the user's source,
    and the rule it breaks."""

    node: str
    op: str
    source: str
    why: str
    writes_state: bool = False  # a buffer or parameter written from data: refused in every mode

    def __str__(self) -> str:
        where = f" at {self.source}" if self.source else ""
        return f"node {self.node} ({self.op}){where}: {self.why}"


def _source(node: fx.Node) -> str:
    found = [f for f in re.findall(r'File "([^"]+)", line (\d+)', node.stack_trace or "") if "/torch/" not in f[0]]
    return f"{found[-1][0].rsplit('/', 1)[-1]}:{found[-1][1]}" if found else ""


def _op(node: fx.Node, model: nn.Module) -> str:
    if node.op == "call_module":
        return f"{type(model.get_submodule(str(node.target))).__name__} {node.target}"
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    target = node.target
    return f"{getattr(target, '__module__', '') or ''}.{getattr(target, '__name__', str(target))}".lstrip(".")


class _Run(fx.Interpreter):
    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self.fetch_attr(target)(*args, **kwargs)  # a layer called under two names is still found


def _values(model: CapturedModel, graph: fx.Graph, shape: tuple[int, ...], b: int) -> dict[fx.Node, Any]:
    param = next(iter(model.parameters()), None)
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    gen = torch.Generator().manual_seed(20261206 + b)  # synthetic inputs: no data is read
    run = _Run(model, garbage_collect_values=False, graph=graph)
    device = param.device if param is not None else torch.device("cpu")
    # dropout draws from the global generators: forked, so the analysis leaves the trial's random state untouched
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        run.run(torch.randn((b, *shape), generator=gen, dtype=dtype).to(device))
    return dict(run.env)


def _tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return [t for x in v for t in _tensors(x)]
    return []


def _name(node: fx.Node) -> str:
    t = node.target
    return str(t) if node.op == "call_method" else getattr(t, "__name__", str(t))


def _dims(node: fx.Node, name: str, ndim: int) -> list[int] | None:
    """The dims ``node`` runs ``name`` along, normalised (None: not given and every dim, or not constant)."""
    pos, default = _ALONG[name]
    d: Any = node.kwargs.get("dims" if name in ("flip", "roll") else "dim", default)
    if len(node.args) > pos:
        d = node.args[pos] if not (name == "flip" and len(node.args) > pos + 1) else node.args[pos:]
    if d is None:
        return None
    ds = list(d) if isinstance(d, (list, tuple)) else [d]
    if not all(isinstance(x, int) for x in ds):
        return None
    return [x % max(ndim, 1) for x in ds]


def row_independence(model: CapturedModel, input_shape: tuple[int, ...], training: bool,
                     per_row: bool = False) -> Mixing | None:
    """None when the graph of ``model`` in ``training`` mode keeps examples apart (module docstring), else the first
    node it cannot prove. ``per_row``: also every layer with parameters sees one row per example (what per-layer
    engines assume; a reshape to k rows per example keeps examples apart but not that). Runs the graph twice on
    random inputs (no data)."""
    graph = model.graph(training)
    was = model.training
    # the graph's declared mutations (a step counter) run here too: every parameter and buffer is put back after
    saved = {id(t): (t, t.detach().clone()) for t in (*model.parameters(), *model.buffers())}
    model.train(training)
    try:
        runs = [_values(model, graph, tuple(input_shape), b) for b in BATCHES]
    except Exception as e:  # a program that does not run at some batch size is not one for every batch
        failed = re.search(r"While executing %(\w+)", str(e))
        at = next((n for n in graph.nodes if failed and n.name == failed.group(1)), None)
        return Mixing(at.name if at else "?", _op(at, model) if at else "", _source(at) if at else "",
                      f"the program fails at a batch of {BATCHES[0]} or {BATCHES[1]} rows "
                      f"({type(e).__name__}: {str(e).splitlines()[0][:160]})")
    finally:
        model.train(was)
        with torch.no_grad():
            for t, value in saved.values():
                t.copy_(value)
    carries: set[fx.Node] = set()
    sized: set[fx.Node] = set()  # non-tensor values that change with the batch size
    first: Mixing | None = None
    for node in graph.nodes:
        if node.op == "placeholder":
            carries.add(node)
            continue
        if node.op in ("get_attr", "output") or not any(a in carries or a in sized for a in node.all_input_nodes):
            continue  # parameters, constants and what is computed from them (or a dtype, a device) alone
        why = _rule(node, model, runs, carries, sized)
        if _tensors(runs[0][node]):
            carries.add(node)
        elif runs[0][node] != runs[1][node]:
            sized.add(node)  # the batch size, or a value computed from it: checked where it is used
        if not why and per_row:
            why = _one_row(node, model, runs, carries)
        if why:
            found = Mixing(node.name, _op(node, model), _source(node), why, why.startswith("it writes data"))
            if found.writes_state:
                return found  # refused in every mode: reported before any mixing
            first = first or found
    return first


def check_program(model: nn.Module, input_shape: tuple[int, ...], mode: str, sees_batch: bool,
                  refuse: bool = True) -> Mixing | None:
    """What the trainer asks of the program it trains, before it trains it: a captured model (``_capture``); in a
    per-example mode, an eval graph that keeps rows apart (scoring: one validation example moves the count by at
    most one); and, for an engine that sees the batch, a train graph that does too, one row per example at every
    layer. ConfigError otherwise (``refuse``: also for the train graph); returns the train graph's first node that
    only a whole-model vmap may train (None: proven)."""
    if not isinstance(model, CapturedModel):
        raise ConfigError("model", f"the {mode} engine was given a model that was not captured "
                          f"({type(model).__name__})", "build models with dptune.dpsgd.init_model")
    if not clipping.mode(mode).per_example:
        return None  # batch clipping: batch statistics are its point; its invariant is the clipped mean's
    evaluated = row_independence(model, input_shape, training=False)
    if evaluated is not None:
        raise ConfigError("model", f"in eval() its forward pass mixes the rows of a batch ({evaluated}): one "
                          "validation example could change another's prediction, so the released score would "
                          "move by more than one example", "make the eval() forward per example too (no batch "
                          "statistics, no operation across dim 0)")
    trained = row_independence(model, input_shape, training=True, per_row=sees_batch)
    if trained is not None and trained.writes_state:
        raise ConfigError("model", f"its forward pass changes the model's state from data ({trained})",
                          "keep no state between forward calls (a buffer updated in forward is carried into the "
                          "next step and released with the model)")
    if trained is not None and sees_batch and refuse:
        raise ConfigError("clipping", f"{mode} clipping needs a model graph that keeps the rows of a batch apart, "
                          f"and this one does not: {trained}", "set fixed.clipping: functorch (each example alone, "
                          "exact for any graph) or auto, or remove the operation")
    return trained


def _rule(node: fx.Node, model: nn.Module, runs: list[dict[fx.Node, Any]], carries: set[fx.Node],
          sized: set[fx.Node]) -> str | None:
    v = [r[node] for r in runs]
    name = _name(node)
    first = node.args[0] if node.args else None
    x = runs[0].get(first) if isinstance(first, fx.Node) else None
    if node.op != "call_module" and name in _SIZES | {"getattr", "getitem"} and not isinstance(x, torch.Tensor) \
            or name == "getattr" and len(node.args) > 1 and node.args[1] in _SIZE_ATTRS:
        return None if not _tensors(v[0]) else _shape(v)  # a size is checked where it is used
    if node.op != "call_module" and name in _SIZES:
        return None
    if not any(isinstance(runs[0].get(a), torch.Tensor) for a in node.all_input_nodes) and not _tensors(v[0]):
        return None  # arithmetic on sizes (n * 4): still a size
    uses_size = [a for a in node.all_input_nodes if a in sized]
    if uses_size and not (name in _GIVES_SHAPE and _leading_only(node, uses_size)):
        return (f"it computes with the batch size ({uses_size[0].name}); only a shape's leading dim may be the batch "
                "size, since under Poisson sampling it depends on every example")
    why = _allowed(node, model, name, x, carries)
    if why:
        return why
    if not _tensors(v[0]) and not isinstance(v[0], (int, float, bool)):
        return None
    if not _tensors(v[0]):
        return "it turns the batch into a Python number"
    return _shape(v)


def _leading_only(node: fx.Node, uses: list[fx.Node]) -> bool:
    shape = node.args[1:] if not (len(node.args) == 2 and isinstance(node.args[1], (tuple, list))) else node.args[1]
    if _name(node) in ("zeros", "ones", "empty", "full", "rand", "randn"):
        shape = node.args[0] if node.args and isinstance(node.args[0], (tuple, list)) else node.args
    return bool(shape) and all(a is shape[0] for a in uses) and all(a not in uses for a in list(shape)[1:])


def _rows_per_example(t: torch.Tensor, u: torch.Tensor) -> int | None:
    """k when the tensors are (k·B, *s) at both batch sizes (a row-major reshape keeps each example's k rows a
    block: example i's elements stay rows [i·k, (i+1)·k)); None otherwise."""
    if t.dim() == 0 or t.shape[0] % BATCHES[0] or u.shape[0] % BATCHES[1]:
        return None
    k = t.shape[0] // BATCHES[0]
    return k if k >= 1 and u.shape[0] == k * BATCHES[1] else None


def _one_row(node: fx.Node, model: nn.Module, runs: list[dict[fx.Node, Any]], carries: set[fx.Node]) -> str | None:
    owns = node.op == "call_module" and any(True for _ in model.get_submodule(str(node.target)).parameters(False))
    if not owns and not (node.op == "call_function" and _name(node) in _LAYERS):
        return None
    first = node.args[0] if node.args else None
    t, u = (runs[0].get(first), runs[1].get(first)) if isinstance(first, fx.Node) else (None, None)
    if isinstance(t, torch.Tensor) and isinstance(u, torch.Tensor) and _rows_per_example(t, u) not in (None, 1):
        return (f"it runs over {_rows_per_example(t, u)} rows per example, and the per-layer engines take each row "
                "of a layer's input for an example")
    return None


def _shape(v: list[Any]) -> str | None:
    pairs = list(zip(_tensors(v[0]), _tensors(v[1]), strict=False))
    for a, b in pairs:
        if _rows_per_example(a, b) is None:
            return (f"its result {tuple(a.shape)} does not keep the batch at dim 0 (a reduction, reshape, "
                    "transpose or slice across the batch)")
        if a.shape[1:] != b.shape[1:]:
            return f"the shape of its result ({tuple(a.shape)}) depends on the batch size beyond dim 0"
    return None


def _allowed(node: fx.Node, model: nn.Module, name: str, x: Any, carries: set[fx.Node]) -> str | None:
    if node.op == "call_module":
        return _module_rule(model.get_submodule(str(node.target)))
    base = name.rstrip("_") if name.endswith("_") and not name.endswith("__") else name
    if base != name and isinstance(node.args[0], fx.Node) and node.args[0] not in carries:
        return f"it writes data into {_origin(node.args[0])} in place (a buffer or parameter changed by a batch)"
    if base == "getitem":
        return _index_rule(node, x)
    if base == "getattr":
        return None
    ndim = x.dim() if isinstance(x, torch.Tensor) else 0
    if base in ("max", "min") and len(node.args) > 1 and isinstance(node.args[1], fx.Node):
        return None  # elementwise max/min of two tensors
    if base in _ALONG:
        dims = _dims(node, base, ndim)
        return None if dims is not None and 0 not in dims else \
            f"it runs {base} over the batch dim{' (no dim given: every dim)' if dims is None else ''}"
    if base in _PRODUCTS:  # every operand counted, the same node twice too (h @ h.T, einsum("..", h, h))
        tensors = [a for a in _operands(node) if a in carries]
        if len(tensors) > 1 and not (base in ("matmul", "bmm") and ndim >= 3):
            return f"it multiplies two batch-carrying tensors ({base}), which contracts across rows"
        return None
    if base in _LAYERS:
        extra = [a for a in node.all_input_nodes[1:] if a in carries and a is not node.args[0]]
        return f"its weight ({extra[0].name}) is computed from the batch" if extra else None
    if base in _ELEMENTWISE or base in _SHAPE or base in _GIVES_SHAPE or node.target is channels_last:
        return None
    return f"{base} is not on the list of operations known to keep rows apart"


def _operands(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(a) or a)  # type: ignore[func-returns-value]
    return found


def _origin(node: fx.Node) -> str:
    return str(node.target) if node.op == "get_attr" else node.name


def _index_rule(node: fx.Node, x: Any) -> str | None:
    if not isinstance(x, torch.Tensor):
        return None
    idx = node.args[1]
    head = idx[0] if isinstance(idx, tuple) and idx else idx
    if head is Ellipsis or isinstance(head, slice) and all(
            not isinstance(s, fx.Node) for s in (head.start, head.stop, head.step)):
        return None  # a slice of the batch dim changes its size: rule 2 catches it
    return f"it indexes the batch dim with {type(head).__name__ if not isinstance(head, fx.Node) else head.name}"


def _module_rule(m: nn.Module) -> str | None:
    if type(m) not in _ROW_MODULES and not isinstance(m, WSConv2d):
        return f"{type(m).__name__} is not on the list of layers known to keep rows apart"
    if isinstance(m, (nn.Softmax, nn.LogSoftmax, nn.Softmin)) and (m.dim is None or m.dim == 0):
        return f"{type(m).__name__}(dim={m.dim}) runs over the batch dim"
    return None

