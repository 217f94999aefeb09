"""The graph analysis (dptune/dpsgd/_rows.py): it refuses each operation that mixes the rows of a batch, naming the
node and the user's source line, and proves every shipped model, in train() and eval(), for the per-layer engines.
Each case is a real model captured as the trainer captures it; the refusals are checked against what the op does
(a model the analysis proves must give each example's output from that example alone)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptune.config import ConfigError, TrialConfig
from dptune.dpsgd._capture import capture
from dptune.dpsgd._checked import checked_model
from dptune.dpsgd._rows import check_program, row_independence
from dptune.models import build_model

Mix = Callable[[torch.Tensor], torch.Tensor]


class Head(nn.Module):
    def __init__(self, mix: Mix) -> None:
        super().__init__()
        self.fc, self.head, self.mix = nn.Linear(64, 16), nn.Linear(16, 10), mix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.fc(x.flatten(1))))


MIXING: dict[str, tuple[Mix, str]] = {  # the op, and the node the refusal must name
    "mean over the batch": (lambda h: h - h.mean(0), "mean"),
    "sum of everything": (lambda h: h + h.sum(), "sum"),
    "sort over the batch": (lambda h: h.sort(0).values, "sort"),
    "flip over the batch": (lambda h: h.flip(0), "flip"),
    "roll without dims": (lambda h: torch.roll(h, 1), "roll"),
    "roll over the batch": (lambda h: h.roll(1, 0), "roll"),
    "cumsum over the batch": (lambda h: h.cumsum(0), "cumsum"),
    "softmax over the batch": (lambda h: torch.softmax(h, 0), "softmax"),
    "normalize over the batch": (lambda h: F.normalize(h, dim=0), "normalize"),
    "index with a permutation": (lambda h: h[torch.randperm(h.size(0))], "randperm"),
    "index with a mask": (lambda h: h[h[:, 0] > 0][:1].expand_as(h), "getitem"),
    "matmul over the batch": (lambda h: (h @ h.t()) @ h, "t"),
    "contraction over rows": (lambda h: torch.einsum("bi,ci,cj->bj", h, h, h), "einsum"),
    "scaled by the batch size": (lambda h: h * h.size(0), "mul"),
    "batch norm as a function": (lambda h: F.batch_norm(h, None, None, training=True), "batch_norm"),
    "unknown op": (lambda h: torch.kthvalue(h, 2, 0).values.expand_as(h), "kthvalue"),
    "reshape across rows": (lambda h: h.reshape(16, -1).reshape(h.size(0), 16), "reshape"),
    "works at even sizes only": (lambda h: h.reshape(-1, 32).reshape(-1, 16), "reshape"),
}
ROW_WISE: dict[str, Mix] = {
    "elementwise": lambda h: torch.tanh(h) * 2 + 1,
    "along features": lambda h: h - h.mean(1, keepdim=True) + torch.softmax(h, -1) + h.cumsum(1) + h.flip(1),
    "view by size(0)": lambda h: h.view(h.size(0), 4, 4).flatten(1),
    "sort along features": lambda h: h.sort(dim=1).values,
    "feature index": lambda h: h[:, torch.arange(16).flip(0)],
}


@pytest.mark.parametrize("case", list(MIXING))
def test_each_mixing_op_is_refused_with_its_node_and_line(case: str) -> None:
    mix, node = MIXING[case]
    model = capture(Head(mix).double())
    found = row_independence(model, (1, 8, 8), training=True)
    assert found is not None, case
    assert found.node.startswith(node) and "test_rows.py:" in found.source, (case, str(found))
    with pytest.raises(ConfigError) as e:
        check_program(model, (1, 8, 8), "hooks", sees_batch=True)
    assert e.value.field == "model" and "in eval()" in e.value.problem  # scoring mixes too: refused in every mode


@pytest.mark.parametrize("case", list(ROW_WISE))
def test_row_wise_models_are_proven_and_are_row_wise(case: str) -> None:
    model = capture(Head(ROW_WISE[case]).double())
    assert row_independence(model, (1, 8, 8), training=True, per_row=True) is None
    x = torch.randn(5, 1, 8, 8, dtype=torch.float64)
    with torch.no_grad():  # the control: each example's output from that example alone
        together, alone = model(x), torch.cat([model(x[i:i + 1]) for i in range(5)])
    assert torch.allclose(together, alone, atol=1e-12)


def test_patch_rows_keep_examples_apart_but_not_one_row_per_layer() -> None:
    class Patches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.head = nn.Linear(16, 8), nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.shape[0]
            return self.head(torch.tanh(self.proj(x.reshape(n * 4, 16))).reshape(n, 32))

    model = capture(Patches().double())
    assert row_independence(model, (1, 8, 8), training=True) is None  # functorch and scoring may run it
    found = row_independence(model, (1, 8, 8), training=True, per_row=True)
    assert found is not None and "4 rows per example" in found.why and found.op.startswith("Linear")


def test_a_buffer_written_from_data_is_refused_in_every_mode() -> None:
    class Online(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("running", torch.zeros(64))
            self.fc = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.flatten(1)
            if self.training:
                self.running.mul_(0.9).add_(0.1 * x.detach()[:, :64].sum(1).mean())
            return self.fc(x - self.running)

    model = capture(Online().double())
    for mode, sees in (("functorch", False), ("hooks", True)):
        with pytest.raises(ConfigError) as e:
            check_program(model, (1, 8, 8), mode, sees_batch=sees)
        assert e.value.field == "model" and "state" in e.value.problem


SHIPPED = [("gn_cnn", (1, 8, 8)), ("tanh_cnn", (1, 28, 28)), ("mlp", (1, 8, 8)), ("resnet9", (3, 32, 32)),
           ("wrn16_4", (3, 32, 32)), ("torchvision:resnet18", (3, 32, 32))]


@pytest.mark.parametrize(("name", "shape"), SHIPPED)
def test_every_shipped_model_proves_in_train_and_eval(name: str, shape: tuple[int, int, int]) -> None:
    config = TrialConfig(model=name, fix_batchnorm=name.startswith("torchvision:"), groups=4)
    model = checked_model(build_model(config, 10, shape), config)
    assert row_independence(model, shape, training=True, per_row=True) is None
    assert row_independence(model, shape, training=False, per_row=True) is None
    x = torch.randn(3, *shape)
    model.eval()
    with torch.no_grad():  # the eval graph is the model's eval forward, one example at a time or together
        assert torch.allclose(model(x), torch.cat([model(x[i:i + 1]) for i in range(3)]), atol=1e-5)


def test_a_custom_autograd_function_is_refused_by_name_not_silently_replaced() -> None:
    """Tracing runs a custom Function's forward as plain ops: its own backward would not train. Refused at capture,
    naming it; outside tracing the Function works as before."""

    class Doubled(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, h: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return h.clone()

        @staticmethod
        def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return 2 * g

    with pytest.raises(ConfigError) as e:
        capture(Head(lambda h: Doubled.apply(h)))
    assert e.value.field == "model" and "Doubled" in e.value.problem and "backward" in e.value.problem
    x = torch.ones(3, requires_grad=True)
    Doubled.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_the_analysis_leaves_the_global_random_state_alone() -> None:
    """It runs the train graph (dropout draws from torch's global generator): every trial runs it at its start, so it
    must not shift the trial's random stream."""
    model = capture(nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.Dropout(0.5), nn.Linear(8, 10)))
    torch.manual_seed(0)
    before = torch.rand(4)
    torch.manual_seed(0)
    assert row_independence(model, (1, 8, 8), training=True) is None
    assert torch.equal(torch.rand(4), before)
