"""Registries: filled by decorator or from an entry-point group, imported only when asked for."""

from __future__ import annotations

import sys
from importlib.metadata import EntryPoint

import pytest

from common import registry as registry_module
from common.errors import SplitserveError
from common.registry import Registry, UnknownNameError

GROUP = "splitserve.test_plugins"


@pytest.fixture
def entry_points(monkeypatch):
    """A fake installed group: `fractions` stands in for a plug-in module not yet imported."""
    installed = [EntryPoint("fraction", "fractions:Fraction", GROUP)]
    monkeypatch.setattr(registry_module, "entry_points",
                        lambda group: [ep for ep in installed if ep.group == group])
    monkeypatch.delitem(sys.modules, "fractions", raising=False)


def test_names_come_from_both_sources_without_importing_a_plug_in(entry_points):
    plugins = Registry("test plug-in", group=GROUP)
    plugins.register("local")(dict)
    assert plugins.names() == ["fraction", "local"] and "fraction" in plugins
    assert "fractions" not in sys.modules
    from fractions import Fraction

    assert plugins.get("fraction") is Fraction and plugins.load_all()["local"] is dict


def test_an_unknown_name_lists_the_known_ones_in_one_line(entry_points):
    plugins = Registry("test plug-in", group=GROUP)
    with pytest.raises(UnknownNameError) as caught:
        plugins.get("nope")
    assert str(caught.value) == "unknown test plug-in 'nope'; known: fraction"
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, SplitserveError)


def test_a_name_registered_twice_is_an_error():
    plugins = Registry("test plug-in")
    plugins.register("a")(dict)
    plugins.register("a")(dict)  # the same implementation again is harmless
    with pytest.raises(ValueError, match="registered twice"):
        plugins.register("a")(list)


def test_a_registry_iterates_its_names_and_forgets_a_throwaway(entry_points):
    plugins = Registry("test plug-in", group=GROUP)
    plugins.register("throwaway")(dict)
    assert list(plugins) == ["fraction", "throwaway"]  # so it serves as argparse `choices`
    plugins.unregister("throwaway")
    assert list(plugins) == ["fraction"] and "throwaway" not in plugins
