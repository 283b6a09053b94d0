"""Every class is abstract or final: only abstract classes are subclassed (the Equinox rule)."""

from __future__ import annotations

import enum
import importlib
import inspect
import pkgutil

import unison

# tf.distribute's public hierarchy, kept so that `isinstance(ops, AllReduceCrossDeviceOps)`
# holds for NCCL and hierarchical copy as in TensorFlow.
ALLOWED = {("NcclAllReduce", "AllReduceCrossDeviceOps"), ("HierarchicalCopyAllReduce", "AllReduceCrossDeviceOps")}


def _classes() -> dict[type, str]:
    found: dict[type, str] = {}
    for info in pkgutil.walk_packages(unison.__path__, "unison."):
        if "_testing" in info.name or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if inspect.isclass(value) and value.__module__ == module.__name__:
                found[value] = module.__name__
    return found


def _abstract_members(cls: type) -> set[str]:
    return {name for klass in cls.__mro__ for name, value in vars(klass).items()
            if getattr(value, "__isabstractmethod__", False)
            or getattr(getattr(value, "fget", None), "__isabstractmethod__", False)}


def _implemented(cls: type, name: str) -> bool:
    value = inspect.getattr_static(cls, name)
    target = getattr(value, "fget", value)
    return not getattr(target, "__isabstractmethod__", False)


def test_only_abstract_classes_are_subclassed():
    classes = _classes()
    offenders = []
    for cls in classes:
        for base in cls.__mro__[1:]:
            if base not in classes or issubclass(base, (BaseException, enum.Enum)):
                continue
            if getattr(base, "_is_protocol", False):  # an interface (typing.Protocol): extended, never inherited
                continue
            if not _abstract_members(base) and (cls.__name__, base.__name__) not in ALLOWED:
                offenders.append(f"{cls.__module__}.{cls.__qualname__} subclasses concrete {base.__qualname__}")
    assert not offenders, "\n".join(offenders)


def test_final_classes_implement_every_abstract_member():
    missing = []
    for cls in _classes():
        if getattr(cls, "__final__", False):
            missing += [f"{cls.__qualname__}.{name}" for name in _abstract_members(cls) if not _implemented(cls, name)]
    assert not missing, missing
