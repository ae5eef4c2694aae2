"""Griffe extension: signature defaults a reader can use, not the source's private names.

A dataclass field written ``shuffle_window: int = DEFAULT_WINDOW`` or
``device: torch.device = field(default_factory=_get_default_device)`` would render in the
signature as ``DEFAULT_WINDOW`` and ``_get_default_device()``: names the reader cannot see on the
page. This rewrites the default of every parameter of a class's ``__init__``:

- a name of a module-level constant with a literal value shows that value (``16``);
- a call of a private factory ``_name()`` shows ``Class.name()`` when the class has a public
  method ``name`` (the factory's public face), e.g. ``StatefulDataLoader.get_default_device()``.

It runs after griffe's dataclasses extension (which writes the dataclasses' ``__init__``), so
mkdocs.yml lists ``dataclasses`` before it under the python handler's ``extensions``.
"""

from __future__ import annotations

import ast
from typing import Any

import griffe


def _literal(value: Any) -> str | None:
    """``value`` (an attribute's value as griffe keeps it) when it is a plain literal."""
    text = str(value) if value is not None else ""
    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    return text


def _constant_value(expr: griffe.ExprName, pkg: griffe.Module) -> str | None:
    try:
        target = pkg.modules_collection.get_member(expr.canonical_path)
    except (KeyError, ValueError, AttributeError):
        return None
    while isinstance(target, griffe.Alias):
        try:
            target = target.final_target
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
    if not isinstance(target, griffe.Attribute) or not isinstance(target.parent, griffe.Module):
        return None
    return _literal(target.value)


def _public_factory(expr: griffe.ExprCall, cls: griffe.Class) -> str | None:
    if expr.arguments or not isinstance(expr.function, griffe.ExprName):
        return None
    name = expr.function.name
    public = name.lstrip("_")
    if public == name or public not in cls.members or not cls.members[public].is_function:
        return None
    return f"{cls.name}.{public}()"


def _rewrite(cls: griffe.Class, pkg: griffe.Module) -> None:
    init = cls.members.get("__init__")
    if init is None or init.is_alias or not init.is_function:
        return
    for parameter in init.parameters:  # type: ignore[union-attr]
        default = parameter.default
        shown = None
        if isinstance(default, griffe.ExprName):
            shown = _constant_value(default, pkg)
        elif isinstance(default, griffe.ExprCall):
            shown = _public_factory(default, cls)
        if shown is not None:
            parameter.default = shown


def _walk(obj: griffe.Object, pkg: griffe.Module, seen: set[str]) -> None:
    if obj.path in seen:
        return
    seen.add(obj.path)
    for member in obj.members.values():
        if member.is_alias:
            continue
        if member.is_class:
            _rewrite(member, pkg)  # type: ignore[arg-type]
            _walk(member, pkg, seen)  # type: ignore[arg-type]
        elif member.is_module:
            _walk(member, pkg, seen)  # type: ignore[arg-type]


class ReadableDefaults(griffe.Extension):
    """Rewrite the ``__init__`` defaults of every class of a loaded package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        _walk(pkg, pkg, set())
