"""What the deployment tests share: paths, the values files, and a rendered chart's documents."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "splitserve"
# Named after the files. (Not "gpu": tests/conftest.py skips tests with a `gpu` keyword.)
VALUES_FILES = {
    "defaults": None,
    "values-gpu": DEPLOY / "helm" / "values-gpu.yaml",
    "values-many": DEPLOY / "helm" / "values-many.yaml",
}
RELEASE = "demo"
NAMESPACE = "llm"


class Rendered:
    """One rendering: the manifests by template, the documents, and lookups by kind and name."""

    def __init__(self, manifests: dict[str, str]) -> None:
        self.manifests = manifests
        self.notes = next((text for path, text in manifests.items()
                           if path.endswith("NOTES.txt")), "")
        # (template path, document) for every non-empty YAML document.
        self.entries: list[tuple[str, dict]] = []
        for path, text in sorted(manifests.items()):
            if path.endswith("NOTES.txt"):
                continue
            self.entries += [(path, doc) for doc in yaml.safe_load_all(text) if doc]
        self.docs = [doc for _, doc in self.entries]

    def of_kind(self, kind: str) -> list[dict]:
        return [doc for doc in self.docs if doc["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        for doc in self.of_kind(kind):
            if doc["metadata"]["name"] == name:
                return doc
        raise KeyError(f"no {kind} named {name}; have "
                       f"{[(d['kind'], d['metadata']['name']) for d in self.docs]}")

    def configmap_data(self) -> dict[str, str]:
        (config,) = self.of_kind("ConfigMap")
        return config["data"]


def render_values(chart, values: dict | None) -> Rendered:
    return Rendered(chart.render(values, name=RELEASE, namespace=NAMESPACE))


def values_of(case: str) -> dict | None:
    path = VALUES_FILES[case]
    return None if path is None else yaml.safe_load(path.read_text())
