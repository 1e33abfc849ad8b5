"""Fixtures for the deployment tests: the chart rendered by Helm's own engine, offline.

helm-python-sdk bundles Helm's Go SDK as a shared library (no helm binary, no cluster); the
tests skip, saying why, where that library cannot load.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The test modules import their shared helpers (deploy_support.py) from this directory.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from deploy_support import CHART, VALUES_FILES, render_values, values_of


def _load_helm():
    try:
        import helm_python
    except ImportError as exc:
        pytest.skip(f"helm-python-sdk is not installed ({exc}); it is in the dev extra")
    except OSError as exc:  # the bundled Go library has no build for this platform
        pytest.skip(f"helm-python-sdk cannot load Helm's library on this platform: {exc}")
    try:
        helm_python.helm_sdk_version()
    except (OSError, helm_python.HelmLibraryError) as exc:
        pytest.skip(f"helm-python-sdk cannot load Helm's library on this platform: {exc}")
    return helm_python


@pytest.fixture(scope="session")
def helm():
    return _load_helm()


@pytest.fixture(scope="session")
def chart(helm):
    loaded = helm.Chart.load(str(CHART))
    yield loaded
    loaded.close()


@pytest.fixture(scope="session")
def rendered(chart):
    """The chart rendered with each values file, once per session."""
    return {case: render_values(chart, values_of(case)) for case in VALUES_FILES}


@pytest.fixture(scope="session")
def render(chart):
    """Render with ad-hoc values (merged over the chart defaults by Helm)."""
    return lambda values: render_values(chart, values)
