"""LoRA: low-rank adapters on the Linear layers of a model, for fine-tuning (Hu et al., "LoRA:
Low-Rank Adaptation of Large Language Models", ICLR 2022, arXiv 2106.09685).

A target ``Linear`` (weight W [out, in]) becomes a :class:`LoRALinear` computing
``base_layer(x) + lora_B(lora_A(dropout(x))) * (lora_alpha / r)`` with lora_A [r, in] and
lora_B [out, r]; only lora_A and lora_B train. The layout, the initialization and the files are
Hugging Face PEFT's (``peft.tuners.lora.layer.Linear``), so adapters move both ways:

* module tree: ``<path>.base_layer`` (the original Linear, its parameters frozen),
  ``<path>.lora_A``, ``<path>.lora_B`` (Linear, no bias), ``<path>.lora_dropout`` (Dropout, or
  Identity for p = 0); PEFT's tree has one more level (``lora_A.default``), the adapter's name;
* adapter files: a folder with ``adapter_model.safetensors`` holding
  ``base_model.model.<path>.lora_A.weight`` and ``.lora_B.weight`` (PEFT's
  ``get_peft_model_state_dict`` names) and ``adapter_config.json`` (``LoraConfig``'s fields).

Invariants: :func:`apply_lora` freezes every parameter but the adapters' (PEFT's ``bias="none"``);
the base weights keep their Parameter objects, so a model already on the GPU keeps its buffers
and the Trainer never differentiates, updates or keeps optimizer state for them.
:func:`load_lora` checks every tensor before it changes anything. :func:`merge_lora` gives back
plain Linear modules, so the state dict has the base model's names again. Every change to the
module tree changes the model's traced signature, so the next call or step recompiles.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import safetensors.numpy

from ..io.checkpoint import write_atomic
from ..io.safetensors_io import load_file
from . import functional as F
from . import init
from .layers.dropout import Dropout
from .layers.linear import Identity, Linear
from .module import Module, StateDictError
from .parameter import bump_version

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "PEFT_PREFIX",
    "LoRALinear",
    "LoraConfig",
    "apply_lora",
    "load_lora",
    "lora_state_dict",
    "merge_lora",
    "save_lora",
]

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's SAFETENSORS_WEIGHTS_NAME
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's CONFIG_NAME
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the wrapped model


# PEFT LoraConfig options that change which tensors exist or what they compute; a file that
# sets any of them is refused by name rather than loaded wrongly.
_UNSUPPORTED = (
    "use_dora",
    "use_rslora",
    "rank_pattern",
    "alpha_pattern",
    "fan_in_fan_out",
    "modules_to_save",
    "layers_to_transform",
    "exclude_modules",
    "lora_bias",
    "layer_replication",
    "target_parameters",
    "trainable_token_indices",
)


@dataclass
class LoraConfig:
    """The adapter's settings, with the names of PEFT's ``LoraConfig`` (its
    ``adapter_config.json``).

    Attributes:
        r: rank, > 0.
        lora_alpha: the update is scaled by ``lora_alpha / r``.
        target_modules: module names: a module is a target when its dotted path equals a name
            or ends with ``"." + name``; a single string is a regular expression the whole
            path must match (PEFT's rule).
        lora_dropout: dropout probability on the adapter's input, in [0, 1).
        bias: only ``"none"`` (biases stay frozen).
        base_model_name_or_path, task_type: written to adapter_config.json for PEFT.
    """

    r: int = 8
    lora_alpha: float = 16
    target_modules: tuple[str, ...] | str = ("q_proj", "v_proj")
    lora_dropout: float = 0.0
    bias: str = "none"
    base_model_name_or_path: str | None = None
    task_type: str | None = "CAUSAL_LM"
    extra: dict = field(default_factory=dict)  # other PEFT keys, kept as read

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, list):
            self.target_modules = tuple(self.target_modules)
        _check_settings(self.r, self.lora_alpha, self.lora_dropout, self.target_modules)
        if self.bias != "none":
            raise ValueError(f"LoRA bias={self.bias!r} is not supported; only 'none'")

    def to_dict(self) -> dict:
        """The adapter_config.json contents (PEFT's LoraConfig keys, plain LoRA)."""
        d = {k: v for k, v in asdict(self).items() if k != "extra"}
        targets = self.target_modules
        d["target_modules"] = targets if isinstance(targets, str) else sorted(targets)
        return {
            "peft_type": "LORA",
            "fan_in_fan_out": False,
            "init_lora_weights": True,
            "inference_mode": True,
            "modules_to_save": None,
            "rank_pattern": {},
            "alpha_pattern": {},
            "use_rslora": False,
            "use_dora": False,
            **self.extra,
            **d,
        }

    @classmethod
    def from_dict(cls, d: Mapping, source: str = "adapter config") -> LoraConfig:
        """A config from adapter_config.json's contents.

        Raises:
            ValueError: not a LoRA adapter, or a PEFT option meganeura does not implement
                set (any of ``_UNSUPPORTED``: DoRA, rsLoRA, per-module ranks, layer
                selection, extra trained modules ...; a bias other than "none"), named with
                its value.
        """
        if d.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{source}: peft_type {d['peft_type']!r} is not 'LORA'")
        unsupported = {k: d[k] for k in _UNSUPPORTED if d.get(k)}
        if d.get("bias", "none") != "none":
            unsupported["bias"] = d["bias"]
        if unsupported:
            raise ValueError(f"{source}: unsupported LoRA options {unsupported}")
        if "target_modules" not in d or d["target_modules"] is None:
            raise ValueError(f"{source}: no target_modules")
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        return cls(**known, extra={k: v for k, v in d.items() if k not in names})


class LoRALinear(Module):
    """A Linear layer plus a trainable low-rank update (PEFT's ``lora.Linear``):
    ``base_layer(x) + lora_B(lora_A(lora_dropout(x))) * scaling``, ``scaling = lora_alpha / r``.

    Shapes: input [*, in_features] -> [*, out_features]; lora_A.weight [r, in_features]
    (kaiming-uniform with a = sqrt(5), as ``torch.nn.Linear`` and PEFT), lora_B.weight
    [out_features, r] (zeros, so the model starts as the base model). float32 adapters; an input
    of another floating dtype is cast to float32 for the adapter and its result cast back.

    Args:
        base_layer: the Linear to adapt; its parameters are frozen (``requires_grad=False``).
        r, lora_alpha, lora_dropout: as :class:`LoraConfig`.

    Raises:
        TypeError: ``base_layer`` is not a Linear. ValueError: bad r, alpha or dropout.
    """

    def __init__(
        self, base_layer: Linear, r: int = 8, lora_alpha: float = 16, lora_dropout: float = 0.0
    ) -> None:
        super().__init__()
        if not isinstance(base_layer, Linear):
            raise TypeError(f"LoRALinear adapts a Linear, got {type(base_layer).__name__}")
        _check_settings(r, lora_alpha, lora_dropout)
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.r, self.lora_alpha, self.lora_dropout_p = int(r), lora_alpha, float(lora_dropout)
        self.scaling = lora_alpha / r
        base_layer.requires_grad_(False)
        self.base_layer = base_layer
        self.lora_dropout = Dropout(self.lora_dropout_p) if lora_dropout > 0 else Identity()
        with init.empty_weights():  # drawn below, once, as PEFT's reset_lora_parameters
            self.lora_A = Linear(self.in_features, self.r, bias=False)
            self.lora_B = Linear(self.r, self.out_features, bias=False)
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        """lora_A ~ kaiming_uniform(a=sqrt(5)), lora_B = 0 (PEFT's ``init_lora_weights=True``)."""
        init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        init.zeros_(self.lora_B.weight)

    def forward(self, input):  # noqa: A002 - PyTorch's name
        result = self.base_layer(input)
        x = self.lora_dropout(input)
        if x.dtype != self.lora_A.weight.dtype:
            x = F.cast(x, self.lora_A.weight.dtype)
        update = self.lora_B(self.lora_A(x)) * self.scaling
        if update.dtype != result.dtype:
            update = F.cast(update, result.dtype)
        return result + update

    def delta_weight(self) -> np.ndarray:
        """``scaling * lora_B.weight @ lora_A.weight``: what merging adds to the base weight,
        float64 [out_features, in_features]."""
        a = self.lora_A.weight.data.astype(np.float64)
        b = self.lora_B.weight.data.astype(np.float64)
        return self.scaling * (b @ a)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
            f"lora_alpha={self.lora_alpha}, lora_dropout={self.lora_dropout_p}"
        )


def _check_settings(r, alpha, dropout, targets=None) -> None:
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r <= 0:
        raise ValueError(f"LoRA rank r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"lora_alpha must be a positive number, got {alpha!r}")
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora_dropout must be in [0, 1), got {dropout!r}")
    if targets is not None:
        if isinstance(targets, str):
            try:
                re.compile(targets)
            except re.error as e:
                raise ValueError(
                    f"target_modules {targets!r} is not a regular expression: {e}"
                ) from None
        elif not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(
                f"target_modules must be a non-empty sequence of module names or one regular "
                f"expression, got {targets!r}"
            )


def _is_target(path: str, targets: Sequence[str] | str) -> bool:
    if isinstance(targets, str):  # PEFT: a string is a regex over the whole path
        return re.fullmatch(targets, path) is not None
    return any(path == t or path.endswith("." + t) for t in targets)


def _lora_modules(model: Module) -> list[tuple[str, LoRALinear]]:
    """(path, module) of every LoRALinear, each path it is reachable by."""
    return [
        (p, m) for p, m in model.named_modules(remove_duplicate=False) if isinstance(m, LoRALinear)
    ]


def _find_targets(model: Module, targets: Sequence[str] | str) -> list[tuple[str, Linear]]:
    """(path, Linear) of every module ``targets`` selects, without changing anything.

    Raises:
        TypeError: a selected module is not a Linear. ValueError: nothing is selected.
    """
    found = []
    for path, m in model.named_modules(remove_duplicate=False):
        if not path or not _is_target(path, targets):
            continue
        if not isinstance(m, Linear):
            raise TypeError(
                f"target module {path!r} is a {type(m).__name__}; LoRA adapts Linear layers only"
            )
        found.append((path, m))
    if not found:
        linears = [p for p, m in model.named_modules() if isinstance(m, Linear)]
        leaves = sorted({p.rpartition(".")[2] for p in linears})
        raise ValueError(
            f"target_modules {targets!r} match no module of {type(model).__name__}; "
            f"its Linear layers are named {leaves}"
        )
    return found


def _replace(model: Module, path: str, new: Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    # in place, not add_module: the child keeps its position (state-dict and Sequential order)
    parent._modules[name] = new
    bump_version()


def apply_lora(
    model: Module,
    target_modules: Sequence[str] | str = ("q_proj", "v_proj"),
    r: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
) -> Module:
    """Replace the selected Linear layers of ``model`` in place by :class:`LoRALinear` and
    freeze every other parameter (PEFT's ``get_peft_model`` with ``bias="none"``).

    Args:
        model: any Module; apply LoRA before building the Trainer that trains it.
        target_modules: as :attr:`LoraConfig.target_modules` (names matched against the end of
            each dotted module path, or one regular expression for the whole path).
        r: rank (> 0). alpha: ``lora_alpha``; the update is scaled by ``alpha / r``.
        dropout: dropout probability on the adapters' input, in [0, 1).

    Returns:
        ``model``, whose trainable parameters are now exactly the adapters'.

    Raises:
        ValueError: bad r, alpha, dropout or target_modules; no module matched (the message
            lists the model's Linear names); the model already has LoRA adapters.
        TypeError: a matched module is not a Linear.
        Nothing is changed when any of these is raised.
    """
    if isinstance(target_modules, list):
        target_modules = tuple(target_modules)
    _check_settings(r, alpha, dropout, target_modules)
    if _lora_modules(model):
        raise ValueError(
            f"{type(model).__name__} already has LoRA adapters at "
            f"{[p for p, _ in _lora_modules(model)]}; merge_lora first, or load_lora into them"
        )
    found = _find_targets(model, target_modules)
    model.requires_grad_(False)
    adapted: dict[int, LoRALinear] = {}  # a Linear reachable by two paths gets one adapter
    for path, linear in found:
        if id(linear) not in adapted:
            adapted[id(linear)] = LoRALinear(linear, r, alpha, dropout)
        _replace(model, path, adapted[id(linear)])
    return model


def lora_state_dict(model: Module) -> OrderedDict[str, np.ndarray]:
    """The adapters' weights under PEFT's names, ``base_model.model.<path>.lora_A.weight``
    [r, in] and ``.lora_B.weight`` [out, r], as float32 NumPy copies in module order.

    Raises:
        ValueError: the model has no LoRA adapters.
    """
    out = OrderedDict()
    for path, m in _require_lora(model):
        out[f"{PEFT_PREFIX}{path}.lora_A.weight"] = m.lora_A.weight.numpy()
        out[f"{PEFT_PREFIX}{path}.lora_B.weight"] = m.lora_B.weight.numpy()
    return out


def _require_lora(model: Module) -> list[tuple[str, LoRALinear]]:
    found = _lora_modules(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters (apply_lora first)")
    return found


def _model_config(model: Module) -> LoraConfig:
    """The config that selects exactly the model's adapters: their leaf names when those pick
    no other Linear, else their full paths."""
    found = _require_lora(model)
    settings = {(m.r, m.lora_alpha, m.lora_dropout_p) for _, m in found}
    if len(settings) > 1:
        raise ValueError(
            "the model's adapters differ in (r, lora_alpha, lora_dropout): "
            f"{sorted(settings)}; one adapter_config.json describes one setting"
        )
    (r, alpha, dropout) = settings.pop()
    paths = {p for p, _ in found}
    leaves = {p.rpartition(".")[2] for p in paths}
    others = [
        p
        for p, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, Linear) and p not in paths and not _inside_lora(p, paths)
    ]
    picks_others = any(_is_target(p, tuple(leaves)) for p in others)
    targets = tuple(sorted(paths if picks_others else leaves))
    return LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=dropout)


def _inside_lora(path: str, lora_paths: set[str]) -> bool:
    return any(path.startswith(p + ".") for p in lora_paths)


def save_lora(model: Module, path: str | Path, config: LoraConfig | Mapping | None = None) -> None:
    """Write the adapters as PEFT does (``save_pretrained``): ``<path>/adapter_model.safetensors``
    (:func:`lora_state_dict`, float32, header metadata ``{"format": "pt"}``) and
    ``<path>/adapter_config.json``, each atomically (temporary file + rename, ``io.checkpoint``).

    Args:
        model: a model with LoRA adapters.
        path: the folder (created if missing).
        config: None to describe the model's adapters; or a LoraConfig or a dict of
            adapter_config.json keys (``base_model_name_or_path``, ``task_type`` ...), whose
            r, lora_alpha and lora_dropout must be the model's. ``target_modules`` is always
            the one that selects exactly the model's adapters.

    Raises:
        ValueError: no adapters; adapters of different settings; a config whose r,
            lora_alpha or lora_dropout differ from the model's (named with both values).
    """
    cfg = _model_config(model)
    if config is not None:
        given = config.to_dict() if isinstance(config, LoraConfig) else dict(config)
        for key in ("r", "lora_alpha", "lora_dropout"):
            if key in given and given[key] != getattr(cfg, key):
                raise ValueError(
                    f"config {key}={given[key]!r} but the model's adapters have "
                    f"{key}={getattr(cfg, key)!r}"
                )
        for key in ("base_model_name_or_path", "task_type"):
            if key in given:
                setattr(cfg, key, given[key])
        skip = {f.name for f in fields(LoraConfig)} | {"target_modules"}
        cfg.extra = {k: v for k, v in given.items() if k not in skip}
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    payload = safetensors.numpy.save(dict(lora_state_dict(model)), metadata={"format": "pt"})
    write_atomic(folder / ADAPTER_WEIGHTS, payload)
    text = json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n"
    write_atomic(folder / ADAPTER_CONFIG, text.encode())


def load_lora(model: Module, path: str | Path) -> Module:
    """Load adapters saved by :func:`save_lora` or by PEFT's ``save_pretrained``.

    A model without adapters gets them first, as ``adapter_config.json`` describes
    (``PeftModel.from_pretrained``); a model that has them must have the file's. Every tensor
    is checked before anything changes.

    Args:
        model: the base model (weights already loaded), or a model with adapters.
        path: the adapter folder, or its ``.safetensors`` file (then the config is read from
            the same folder when present).

    Returns:
        ``model``.

    Raises:
        FileNotFoundError: no adapter weights at ``path``; no config for a model without
            adapters.
        StateDictError: missing or unexpected adapter tensors (listed), or a tensor of another
            shape, named with the file's and the model's shape (a different r or layer size).
        ValueError: a config that is not plain LoRA, or whose lora_alpha differs from the
            model's adapters'.
        Nothing is changed when any of these is raised.
    """
    path = Path(path)
    file = path / ADAPTER_WEIGHTS if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"no LoRA adapter weights at {file}")
    config_file = file.parent / ADAPTER_CONFIG
    cfg = None
    if config_file.exists():
        cfg = LoraConfig.from_dict(json.loads(config_file.read_text()), str(config_file))
    tensors = load_file(file)
    existing = _lora_modules(model)
    if existing:
        plan = [(p, m.in_features, m.out_features, m.r) for p, m in existing]
    elif cfg is None:
        raise FileNotFoundError(
            f"{type(model).__name__} has no LoRA adapters and there is no {config_file} to say "
            "where they go (apply_lora first)"
        )
    else:
        found = _find_targets(model, cfg.target_modules)
        plan = [(p, m.in_features, m.out_features, cfg.r) for p, m in found]
    expected = {}
    for p, n_in, n_out, r in plan:
        expected[f"{PEFT_PREFIX}{p}.lora_A.weight"] = (r, n_in)
        expected[f"{PEFT_PREFIX}{p}.lora_B.weight"] = (n_out, r)
    problems = []
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    if missing:
        problems.append(f"missing adapter tensors: {missing}")
    if unexpected:
        problems.append(f"unexpected adapter tensors: {unexpected}")
    for k, shape in expected.items():
        if k in tensors and tuple(tensors[k].shape) != shape:
            problems.append(
                f"size mismatch for {k}: the file has shape {tuple(tensors[k].shape)}, "
                f"the model {shape}"
            )
        elif k in tensors and tensors[k].dtype.kind != "f":
            problems.append(f"{k}: dtype {tensors[k].dtype} is not floating")
    if problems:
        raise StateDictError(
            f"cannot load the LoRA adapters of {file}:\n  " + "\n  ".join(problems)
        )
    if existing and cfg is not None:
        for p, m in existing:
            if m.lora_alpha != cfg.lora_alpha:
                raise ValueError(
                    f"{config_file}: lora_alpha={cfg.lora_alpha!r} but the adapter at {p!r} has "
                    f"lora_alpha={m.lora_alpha!r}"
                )
    if not existing:
        apply_lora(model, cfg.target_modules, cfg.r, cfg.lora_alpha, cfg.lora_dropout)
    for p, m in _lora_modules(model):
        m.lora_A.weight.copy_(tensors[f"{PEFT_PREFIX}{p}.lora_A.weight"])
        m.lora_B.weight.copy_(tensors[f"{PEFT_PREFIX}{p}.lora_B.weight"])
    return model


def merge_lora(model: Module) -> Module:
    """Fold every adapter into its base weight, ``W += (lora_alpha / r) * lora_B @ lora_A``
    (computed in float64, stored as float32), and put the base Linear back in its place
    (PEFT's ``merge_and_unload``): the state dict has the base model's names again, and the
    forward equals the adapted one up to float32 rounding.

    The base parameters stay frozen (``requires_grad=False``, as apply_lora left them);
    ``model.requires_grad_(True)`` unfreezes them.

    Returns:
        ``model``.

    Raises:
        ValueError: the model has no LoRA adapters.
    """
    done: set[int] = set()
    for path, m in _require_lora(model):
        if id(m) not in done:
            w = m.base_layer.weight
            w.copy_(w.data.astype(np.float64) + m.delta_weight())
            done.add(id(m))
        _replace(model, path, m.base_layer)
    return model
