"""Every method of the package that overrides a Lightning (or torch) base class's method says so with ``@override``,
as Lightning's own callbacks do: a hook Lightning renames then shows up in the type check, not as a hook that is
silently never called."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from lightning.pytorch import Callback, LightningDataModule, LightningModule
from lightning.pytorch.strategies import Strategy

import lightning_memguard
from lightning_memguard._lightning.privates import BeforeModelWrapped

BASES = (Callback, LightningModule, LightningDataModule, Strategy, BeforeModelWrapped)


def _classes() -> list[type]:
    found = []
    for info in pkgutil.walk_packages(lightning_memguard.__path__, "lightning_memguard."):
        if info.name.endswith("_kernels"):  # Triton's source, compiled where Triton is
            continue
        module = importlib.import_module(info.name)
        found += [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == module.__name__]
    return found


def overriding_without_the_mark(cls: type) -> list[str]:
    """The methods ``cls`` defines that a base class from Lightning, torch or the Lightning-facing layer defines too,
    and that do not carry ``@override``."""
    missing = []
    for name, member in vars(cls).items():
        function = member.__func__ if isinstance(member, staticmethod | classmethod) else member
        if not inspect.isfunction(function) or name.startswith("__"):
            continue
        bases = [b for b in cls.__mro__[1:] if name in vars(b)]
        ours = [b for b in bases if b.__module__.startswith(("lightning.", "torch.")) or b is BeforeModelWrapped]
        if ours and not getattr(function, "__override__", False):
            missing.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    return missing


def test_a_hook_without_the_mark_is_found():
    class Marked(Callback):
        def on_fit_start(self, trainer, pl_module):  # no @override
            pass

        def own_method(self):
            pass

    assert overriding_without_the_mark(Marked) == [f"{__name__}.{Marked.__qualname__}.on_fit_start"]


def test_every_hook_the_package_overrides_carries_override():
    classes = [c for c in _classes() if issubclass(c, BASES) or any(issubclass(c, b) for b in BASES)]
    assert len(classes) > 10
    assert [m for c in classes for m in overriding_without_the_mark(c)] == []
