"""Models from outside dptune: a user factory, torchvision by name, Opacus' ModuleValidator by layer name,
and the trial config that carries them (round trips through YAML and JSON)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn

from dptune.config import ConfigError, TrialConfig, parse_space
from dptune.config.params import trial_steps
from dptune.data import Splits, poisson_subsample
from dptune.data._splits import make_splits
from dptune.dpsgd import init_model, run_trial, validate_model

ROOT = Path(__file__).resolve().parent.parent
MODULE = "dptune_test_user_models"
USER_MODELS = '''
import torch
from torch import nn

SEEN = []


def make(num_classes, input_shape, groups, width=8):
    SEEN.append(groups)
    c, h, w = input_shape
    return nn.Sequential(nn.Conv2d(c, width, 3, padding=1), nn.GroupNorm(groups, width), nn.Tanh(),
                         nn.Flatten(), nn.Linear(width * h * w, num_classes))


class Recurrent(nn.Module):
    def __init__(self, num_classes, width):
        super().__init__()
        self.rnn = nn.LSTM(width, 16, batch_first=True)
        self.head = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.head(self.rnn(x.flatten(1, 2))[0][:, -1])


def lstm(num_classes, input_shape, groups):
    return Recurrent(num_classes, input_shape[2])


def running_stats(num_classes, input_shape, groups):
    return nn.Sequential(nn.Conv2d(input_shape[0], 4, 3), nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
                         nn.Flatten(), nn.LazyLinear(num_classes))


def inplace(num_classes, input_shape, groups):
    d = input_shape[0] * input_shape[1] * input_shape[2]
    return nn.Sequential(nn.Flatten(), nn.Linear(d, 16), nn.ReLU(inplace=True), nn.Linear(16, num_classes))


def wrong_output(num_classes, input_shape, groups):
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes + 1))


def not_a_module(num_classes, input_shape, groups):
    return "a model"


def broken(num_classes, input_shape, groups):
    raise RuntimeError("no GPU here")


NOT_CALLABLE = 3
'''


@pytest.fixture
def user_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A module the test writes, importable from tmp_path (as a user's module on PYTHONPATH would be)."""
    (tmp_path / f"{MODULE}.py").write_text(USER_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    import importlib

    return importlib.import_module(MODULE)


def _space(model: dict[str, Any], **space: Any) -> dict[str, Any]:
    raw = yaml.safe_load((ROOT / "search_spaces" / "digits.yaml").read_text())
    raw["model"] = model
    raw["fixed"].update(epochs=0.25)
    raw["space"] = {"groups": {"type": "categorical", "choices": [2, 4]}, **space}
    raw["default"] = {"groups": 2}
    return raw


def test_factory_model_builds_validates_and_trains(user_models: Any, digits: Splits) -> None:
    space = parse_space(_space({"factory": f"{MODULE}:make", "kwargs": {"width": 8}}))
    assert space.fixed.model == f"factory:{MODULE}:make" and space.fixed.model_kwargs == {"width": 8}
    for groups in (2, 4):  # what the search does before it reserves: every searched groups
        validate_model(space.fixed.replace(groups=groups), digits.num_classes, digits.input_shape)
    config = space.fixed.replace(groups=2, seed=7)
    model = init_model(config, digits)
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert [(m.num_groups, m.num_channels) for m in norms] == [(2, 8)]  # the searched groups reached it
    assert user_models.SEEN[-1] == 2
    small = poisson_subsample(digits, 0.3, seed=1)
    result = run_trial(config, small, return_model=True)  # a real DP-SGD trial (Opacus), public score here
    basis = len(small.train[1])
    assert result.steps == result.noise_additions == trial_steps(epochs=0.25, batch_size=config.batch_size, basis=basis)
    assert result.clipping_mode == "functorch"  # a user model may modify tensors in place: whole-model vmap
    assert result.model_state is not None and "1.weight" in result.model_state
    assert math.isfinite(result.score)


@pytest.mark.parametrize(("target", "at_parse"), [
    ("dptune_test_user_models.make", True),  # no ':function'
    ("1bad:make", True),
    (f"{MODULE}:", True),
    ("dptune_no_such_module_xyz:make", False),
    (f"{MODULE}:missing", False),
    (f"{MODULE}:NOT_CALLABLE", False),
    (f"{MODULE}:not_a_module", False),
    (f"{MODULE}:broken", False),
])
def test_bad_factory_names_model_factory(user_models: Any, digits: Splits, target: str, at_parse: bool) -> None:
    raw = _space({"factory": target})
    if at_parse:
        with pytest.raises(ConfigError) as e:
            parse_space(raw)
    else:
        space = parse_space(raw)
        with pytest.raises(ConfigError) as e:
            validate_model(space.fixed, digits.num_classes, digits.input_shape)
    assert e.value.field == "model.factory", e.value


def test_model_section_takes_one_kind() -> None:
    with pytest.raises(ConfigError) as e:
        parse_space(_space({"name": "gn_cnn", "torchvision": "resnet18"}))
    assert e.value.field == "model.torchvision"
    raw = _space({"name": "gn_cnn"})
    raw["fixed"]["model"] = "mlp"
    with pytest.raises(ConfigError) as e:
        parse_space(raw)
    assert e.value.field == "fixed.model"


def _rgb(data: Splits, fraction: float) -> Splits:
    """Real digits as 3-channel 8x8 images: what a torchvision ImageNet-style model expects."""
    s = poisson_subsample(data, fraction, seed=2)

    def rgb(p: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return p[0].repeat(1, 3, 1, 1), p[1]

    return make_splits(rgb(s.train), rgb(s.val), rgb(s.test), s.num_classes)


@pytest.mark.integration  # make test-slow (CI runs it): torchvision's ResNet-18 probed and trained, ~19 s
def test_torchvision_resnet18_batchnorm_refused_or_fixed(digits: Splits) -> None:
    data = _rgb(digits, 0.15)
    space = parse_space(_space({"torchvision": "resnet18"}))
    assert space.fixed.model == "torchvision:resnet18"
    with pytest.raises(ConfigError) as e:
        validate_model(space.fixed, data.num_classes, data.input_shape)
    assert e.value.field == "model" and "bn1" in e.value.problem and "BatchNorm" in e.value.problem
    assert "fix_batchnorm" in e.value.fix
    fixed = parse_space(_space({"torchvision": "resnet18", "fix_batchnorm": True})).fixed
    for groups in (2, 4):
        validate_model(fixed.replace(groups=groups), data.num_classes, data.input_shape)
    n = len(data.train[1])
    config = fixed.replace(groups=4, epochs=4 / n, batch_size=4, physical_batch_size=8, seed=3)  # one step
    result = run_trial(config, data, return_model=True)
    assert result.steps == result.noise_additions == trial_steps(epochs=4 / n, batch_size=4, basis=n) == 1
    assert result.clipping_mode == "functorch"  # torchvision's ResNets add in place (opacus issue #828)
    assert result.model_state is not None and not any("running_mean" in k for k in result.model_state)
    assert result.model_state["fc.weight"].shape == (10, 512)  # num_classes from the data, random init


def test_torchvision_bad_names_and_kwargs(digits: Splits) -> None:
    with pytest.raises(ConfigError) as e:
        validate_model(TrialConfig(model="torchvision:resnet_nonexistent"), 10, (3, 8, 8))
    assert e.value.field == "model.torchvision"
    with pytest.raises(ConfigError) as e:
        parse_space(_space({"torchvision": "resnet-18"}))
    assert e.value.field == "model.torchvision"
    with pytest.raises(ConfigError) as e:
        parse_space(_space({"torchvision": "resnet18", "kwargs": {"weights": "IMAGENET1K_V1"}}))
    assert e.value.field == "model.kwargs.weights"
    with pytest.raises(ConfigError) as e:
        validate_model(TrialConfig(model="torchvision:resnet18", model_kwargs={"colour": 1}, fix_batchnorm=True),
                       10, (3, 8, 8))
    assert e.value.field == "model.kwargs"


@pytest.mark.parametrize(("factory", "layer", "fix"), [
    ("lstm", "rnn (LSTM)", "DPLSTM"),  # Opacus 1.6: ShouldReplaceModuleError
    ("running_stats", "1 (InstanceNorm2d)", "track_running_stats=False"),  # IllegalModuleConfigurationError
])
def test_opacus_module_validator_names_the_layer(user_models: Any, digits: Splits, factory: str, layer: str,
                                                 fix: str) -> None:
    with pytest.raises(ConfigError) as e:
        validate_model(TrialConfig(model=f"factory:{MODULE}:{factory}"), digits.num_classes, digits.input_shape)
    assert e.value.field == "model"
    assert f"layer {layer}" in e.value.problem and "ModuleValidator" in e.value.problem
    assert fix in e.value.fix


def test_smoke_step_catches_what_would_crash_a_charged_trial(user_models: Any, digits: Splits) -> None:
    shape, k = digits.input_shape, digits.num_classes
    with pytest.raises(ConfigError) as e:  # in-place ReLU under Opacus' full backward hooks
        validate_model(TrialConfig(model=f"factory:{MODULE}:inplace", clipping="hooks"), k, shape)
    # (the clipping guard: hooks cannot give it per-example gradients; functorch, the mode it names, can)
    assert e.value.field == "clipping" and "hooks" in e.value.problem and "functorch" in e.value.fix
    validate_model(TrialConfig(model=f"factory:{MODULE}:inplace"), k, shape)  # auto: functorch handles it
    with pytest.raises(ConfigError) as e:
        validate_model(TrialConfig(model=f"factory:{MODULE}:wrong_output"), k, shape)
    assert e.value.field == "model" and "(2, 11)" in e.value.problem
    with pytest.raises(ConfigError) as e:  # 3 channels expected, digits have 1
        validate_model(TrialConfig(model="torchvision:resnet18", fix_batchnorm=True), k, shape)
    assert e.value.field == "model" and "forward pass" in e.value.problem
    before = torch.random.get_rng_state()
    validate_model(TrialConfig(), k, shape)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG is left alone


def test_trial_config_round_trips_yaml_and_json() -> None:
    config = TrialConfig(model=f"factory:{MODULE}:make", model_kwargs={"width": 6, "acts": ["tanh", None],
                                                                       "nested": {"a": 1.5, "b": True}})
    public = config.to_public_dict()
    assert TrialConfig.from_dict(yaml.safe_load(yaml.safe_dump(public))) == config
    assert TrialConfig.from_dict(json.loads(json.dumps(public))) == config
    tv = TrialConfig(model="torchvision:resnet18", fix_batchnorm=True)
    assert TrialConfig.from_dict(yaml.safe_load(yaml.safe_dump(tv.to_public_dict()))) == tv
    kwargs = {"width": 6}
    owned = TrialConfig(model="mlp", model_kwargs=kwargs)
    kwargs["width"] = 7
    assert owned.model_kwargs == {"width": 6}  # a frozen config owns its kwargs
    legacy = parse_space(_space({"name": "resnet9", "scale_norm": True, "fix_batchnorm": True}))
    assert (legacy.fixed.model, legacy.fixed.scale_norm, legacy.fixed.fix_batchnorm) == ("resnet9", True, True)
    assert legacy.fixed.model_kwargs == {}


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"width": {1, 2}}, "model.kwargs.width"), ({"width": (1, 2)}, "model.kwargs.width"),
    ({"w": float("nan")}, "model.kwargs.w"), ({3: 1}, "model.kwargs"), ({"groups": 4}, "model.kwargs.groups"),
    ([1, 2], "model.kwargs"),
])
def test_model_kwargs_must_be_yaml_data(kwargs: Any, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        TrialConfig(model="mlp", model_kwargs=kwargs)
    assert e.value.field == field


def test_builtin_kwargs_and_mlp(digits: Splits) -> None:
    model = init_model(TrialConfig(model="gn_cnn", model_kwargs={"width": 8}, groups=4), digits)
    assert model.classifier.in_features == 4 * 16  # type: ignore[union-attr]
    with pytest.raises(ConfigError) as e:
        init_model(TrialConfig(model="gn_cnn", model_kwargs={"depth": 3}), digits)
    assert e.value.field == "model.kwargs"
    mlp = init_model(TrialConfig(model="mlp", model_kwargs={"hidden": [12, 6]}, groups=3), digits)
    assert [m.num_groups for m in mlp.modules() if isinstance(m, nn.GroupNorm)] == [3, 3]
    with pytest.raises(ConfigError) as e:
        init_model(TrialConfig(model="mlp", model_kwargs={"hidden": [10]}, groups=4), digits)
    assert e.value.field == "groups" and "10 channels" in e.value.problem
    with pytest.raises(ConfigError) as e:
        init_model(TrialConfig(model="mlp", model_kwargs={"norm": "batch"}), digits)
    assert e.value.field == "model.kwargs.norm"


def test_tanh_cnn_the_mnist_literature_cnn_with_groupnorm() -> None:
    from dptune.models import build_model, count_parameters

    model = build_model(TrialConfig(model="tanh_cnn", groups=8), 10, (1, 28, 28))
    assert count_parameters(model) == 26_010 + 2 * (16 + 32)  # Papernot et al.'s CNN + GroupNorm affine
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ConfigError) as e:
        build_model(TrialConfig(model="tanh_cnn"), 10, (1, 8, 8))
    assert e.value.field == "model" and "16x16" in e.value.problem
    with pytest.raises(ConfigError) as e:
        build_model(TrialConfig(model="tanh_cnn", groups=3), 10, (1, 28, 28))
    assert e.value.field == "groups"


def test_only_the_users_own_code_is_shipped_to_ray_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dptune.tuning.driver import user_modules

    (tmp_path / "pkg_for_ray").mkdir()
    (tmp_path / "pkg_for_ray" / "__init__.py").write_text("def net(*a, **k): ...\n")
    (tmp_path / "single_for_ray.py").write_text("def net(*a, **k): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert user_modules("factory:pkg_for_ray:net") == (str((tmp_path / "pkg_for_ray").resolve()),)
    assert user_modules("factory:single_for_ray:net") == (str((tmp_path / "single_for_ray.py").resolve()),)
    # an installed package is on every node already: never uploaded (torchvision would be ~MBs per search)
    assert user_modules("factory:torchvision.models:resnet18") == ()
    assert user_modules("gn_cnn") == ()
    with pytest.raises(ConfigError) as e:
        user_modules("factory:no_such_module_here:net")
    assert e.value.field == "model.factory"
