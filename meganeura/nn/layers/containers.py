"""Containers, as torch.nn: Sequential, ModuleList, ModuleDict (children named "0", "1", ... or
by key, so state-dict names match PyTorch's)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping

from ..module import Module


class Sequential(Module):
    """Runs its modules in order (``torch.nn.Sequential``): ``Sequential(a, b)`` or
    ``Sequential(OrderedDict(name=module, ...))``."""

    def __init__(self, *args) -> None:
        super().__init__()
        if len(args) == 1 and isinstance(args[0], OrderedDict):
            for name, m in args[0].items():
                self.add_module(name, m)
        else:
            for i, m in enumerate(args):
                self.add_module(str(i), m)

    def __getitem__(self, idx):
        mods = list(self._modules.items())
        if isinstance(idx, slice):
            return Sequential(OrderedDict(mods[idx]))
        return mods[_index(idx, len(mods))][1]

    def __setitem__(self, idx: int, module: Module) -> None:
        key = list(self._modules)[_index(idx, len(self))]
        self._modules[key] = module
        self._drop_cache()

    def __delitem__(self, idx) -> None:
        keys = list(self._modules)
        doomed = keys[idx] if isinstance(idx, slice) else [keys[_index(idx, len(keys))]]
        for k in doomed:
            del self._modules[k]
        # torch renumbers the remaining children 0..n-1
        kept = list(self._modules.values())
        self._modules.clear()
        for i, m in enumerate(kept):
            self._modules[str(i)] = m
        self._drop_cache()

    def _drop_cache(self) -> None:
        from ..parameter import bump_version

        bump_version()

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())

    def append(self, module: Module) -> Sequential:
        self.add_module(str(len(self)), module)
        return self

    def forward(self, input):  # noqa: A002 - PyTorch's name
        for m in self._modules.values():
            input = m(input)
        return input


class ModuleList(Module):
    """A list of modules (``torch.nn.ModuleList``); no forward of its own."""

    def __init__(self, modules: Iterable[Module] | None = None) -> None:
        super().__init__()
        for m in modules or ():
            self.append(m)

    def __getitem__(self, idx):
        mods = list(self._modules.values())
        if isinstance(idx, slice):
            return ModuleList(mods[idx])
        return mods[_index(idx, len(mods))]

    def __setitem__(self, idx: int, module: Module) -> None:
        self.add_module(str(_index(idx, len(self))), module)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())

    def append(self, module: Module) -> ModuleList:
        self.add_module(str(len(self)), module)
        return self

    def extend(self, modules: Iterable[Module]) -> ModuleList:
        for m in modules:
            self.append(m)
        return self


class ModuleDict(Module):
    """Modules by name (``torch.nn.ModuleDict``), in insertion order."""

    def __init__(self, modules: Mapping[str, Module] | None = None) -> None:
        super().__init__()
        for k, m in (modules or {}).items():
            self.add_module(k, m)

    def __getitem__(self, key: str) -> Module:
        return self._modules[key]

    def __setitem__(self, key: str, module: Module) -> None:
        self.add_module(key, module)

    def __contains__(self, key: str) -> bool:
        return key in self._modules

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def keys(self):
        return self._modules.keys()

    def values(self):
        return self._modules.values()

    def items(self):
        return self._modules.items()


def _index(idx: int, n: int) -> int:
    if not -n <= idx < n:
        raise IndexError(f"index {idx} is out of range for {n} modules")
    return idx % n
