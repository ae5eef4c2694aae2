"""Every public name has a docstring, and the built API reference renders each one."""

from __future__ import annotations

import html
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import guideloom
import guideloom.types

NAMES = [n for n in guideloom.__all__ if n != "__version__"]  # a string: no docstring of its own
#: ``guideloom.types`` is public as a module: its names count too (some are not re-exported).
TYPE_NAMES = [n for n in guideloom.types.__all__ if n not in NAMES]


def public_objects() -> dict[str, Any]:
    """Public name -> object: ``guideloom.X`` and ``guideloom.types.X``."""
    objects = {name: getattr(guideloom, name) for name in NAMES}
    objects.update({name: getattr(guideloom.types, name) for name in TYPE_NAMES})
    return objects


def anchors(name: str, obj: Any) -> list[str]:
    """The heading ids under which mkdocstrings may render ``obj``: ``guideloom.X``, or its
    public module's path (the types page renders ``guideloom.types``)."""
    out = [f"guideloom.{name}"]
    module = getattr(obj, "__module__", "") or ""
    if module.startswith("guideloom") and not any(part.startswith("_") for part in module.split(".")):
        out.append(f"{module}.{name}")
    return out


def public_members(cls: type) -> dict[str, type]:
    """Public methods and properties of ``cls`` -> the guideloom class that defines them (not
    those of ``object``, ``Exception``, ``Generic`` or ``ABC``)."""
    members: dict[str, type] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("guideloom"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_"):
                continue
            if isinstance(value, classmethod | staticmethod | property) or inspect.isfunction(value):
                members[name] = klass
    return members


def _own_doc(klass: type, name: str) -> str:
    value = vars(klass).get(name)
    if value is None:
        return ""
    func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
    return (func.__doc__ or "").strip()


def member_doc(cls: type, name: str) -> str:
    """The docstring of ``cls.name``, inherited from a base class when not overridden with one."""
    for klass in cls.__mro__:
        doc = _own_doc(klass, name)
        if doc:
            return doc
    return ""


def missing_docstrings() -> set[str]:
    missing = set()
    for name, obj in public_objects().items():
        if not (inspect.getdoc(obj) or "").strip():
            missing.add(name)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for member, definer in public_members(obj).items():
                if not member_doc(obj, member):
                    missing.add(f"{definer.__name__}.{member}")
    return missing


def test_every_public_name_and_method_has_a_docstring() -> None:
    missing = missing_docstrings()
    assert not missing, f"public names without a docstring: {sorted(missing)}"


def test_the_check_sees_a_missing_docstring() -> None:
    class Undocumented:
        def method(self) -> None:
            pass

    Undocumented.__module__ = "guideloom.fake"
    assert public_members(Undocumented) == {"method": Undocumented}
    assert member_doc(Undocumented, "method") == ""


def rendered_ids(site: Path) -> dict[str, str]:
    """Every mkdocstrings heading id in the reference pages -> the text that follows it."""
    ids: dict[str, str] = {}
    for page in sorted((site / "reference").rglob("index.html")):
        text = page.read_text()
        for m in re.finditer(r'id="(guideloom\.[A-Za-z0-9_.]+)"', text):
            tail = re.sub(r"<[^>]+>", " ", text[m.end() : m.end() + 30_000])
            ids.setdefault(m.group(1), html.unescape(re.sub(r"\s+", " ", tail)))
    return ids


@pytest.mark.slow
def test_the_api_pages_render_every_public_name(built_site: Path) -> None:
    ids = rendered_ids(built_site)
    for name, obj in public_objects().items():
        found = [a for a in anchors(name, obj) if a in ids]
        assert found, f"{name} is not on any API reference page (looked for {anchors(name, obj)})"
        first_line = (inspect.getdoc(obj) or "").splitlines()[0]
        words = "".join(re.sub(r"[`*]", "", first_line).split()[:4])  # compared without spaces
        rendered = "".join(ids[found[0]].split())
        assert words in rendered, f"{name}'s docstring is not rendered ({first_line!r})"
        if not inspect.isclass(obj) or issubclass(obj, BaseException):
            continue
        # Each documented member is rendered on this class's entry or on a public base's (the
        # class whose docstring it inherits); the abstract bases show their private base's.
        public = [k for k in obj.__mro__ if getattr(guideloom, k.__name__, None) is k or k is obj]
        for member in public_members(obj):
            if member_doc(obj, member):
                where = [f"{a}.{member}" for k in public for a in anchors(k.__name__, k)]
                assert any(w in ids for w in where), f"{name}.{member} is not rendered (looked for {where})"


def test_no_sphinx_role_is_shown_literally(built_site: Path) -> None:
    role = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):")
    for page in sorted((built_site / "reference").rglob("index.html")):
        text = html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))
        shown = role.findall(text)
        assert not shown, f"{page.relative_to(built_site)} shows Sphinx roles: {shown[:5]}"


def test_roles_become_code_spans() -> None:
    import importlib.util

    pytest.importorskip("griffe", reason='the docs extra is not installed: pip install -e ".[docs]"')

    from tests.support.docs import DOCS

    spec = importlib.util.spec_from_file_location("griffe_roles", DOCS / "hooks" / "griffe_roles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = "a :class:`~guideloom.types.LoaderOptions`, :func:`open_stream` and :meth:`x <a.b.c>`"
    assert module.plain_roles(text) == "a `LoaderOptions`, `open_stream` and `x`"
