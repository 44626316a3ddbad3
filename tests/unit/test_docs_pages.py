"""Everything a user can meet has its page: every CRD field, every status reason and condition, every example.

The API reference is generated from the CRD at build time (docs/hooks/reference.py), so a field cannot be left
out by forgetting to write it; what can go wrong is a field the generator renders without saying anything (no
description in operator/rlkube/api) or in a shape it does not handle. This test walks the CRD on its own and checks
each field's entry: its anchor, type, default, bounds and a description. The troubleshooting page must have a
heading for every reason, condition type and phase-level Event reason the operator writes; every manifest in
examples/ must be named by a page of the site. `make docs` (tests/integration/package/test_docs_site.py) then builds the
site strictly.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

from rlkube.api.status import ConditionType
from rlkube.controller.decisions.observed import EventSource
from rlkube.lifecycle.phases import Reason

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CRD = ROOT / "crds" / "rlkube.io_trainingjobs.yaml"
TEMPLATE_ROOT = "spec.trainer.template"

EXTRA_REASONS = {
    EventSource().reason,  # EventSourceReachable's reason before the first read (controller/decisions/observed.py)
    "ForceDeleted",  # the Event of a pod force-deleted after its teardown stage (controller/decisions/teardown.py)
}


def _hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", DOCS / "hooks" / "reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fields(node: dict, path: str):
    """(path, schema, is_kubernetes_field) of every field below `node`, in the generator's path spelling."""
    for name, child in (node.get("properties") or {}).items():
        p = f"{path}.{name}"
        yield p, child
        for sub_path, sub in ((p, child), (p + "[]", child.get("items")), (p + "{}", child.get("additionalProperties"))):
            if isinstance(sub, dict) and sub.get("properties"):
                yield from fields(sub, sub_path)


def reference_problems(crd: dict, pages: dict[str, str]) -> list[str]:
    """What is wrong with the generated reference for this CRD: one line per field lacking its entry."""
    hook = _hook()
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    template = schema["properties"]["spec"]["properties"]["trainer"]["properties"]["template"]
    rows: dict[str, str] = {}
    for text in pages.values():
        for line in text.splitlines():
            m = re.match(r'\| <a id="([^"]+)"></a>', line)
            if m:
                rows[m.group(1)] = line
    out = []
    for top in ("spec", "status"):
        for path, node in fields(schema["properties"][top], top):
            in_template = ".template." in path + "."
            if in_template and not path.startswith(TEMPLATE_ROOT):
                # Another role's template: the generator links it to the shared page when it is the same schema.
                role_template = path[: path.index(".template") + len(".template")]
                if _at(schema, role_template) == template:
                    continue
            row = rows.get(hook.anchor(path))
            if row is None:
                out.append(f"{path}: no entry in the API reference")
                continue
            if not in_template and not node.get("description"):
                out.append(f"{path}: no description in the CRD (operator/rlkube/api): its reference entry says nothing")
            if hook.type_of(node).split()[0] not in row:
                out.append(f"{path}: type {hook.type_of(node)!r} missing from its entry")
            if "default" in node and json.dumps(node["default"], separators=(", ", ": ")) not in row.replace("\\|", "|"):
                out.append(f"{path}: default {node['default']!r} missing from its entry")
            for bound in hook.bounds_of(node):
                if bound.replace("|", "\\|") not in row:
                    out.append(f"{path}: bound {bound!r} missing from its entry")
    return out


def _at(schema: dict, path: str) -> dict:
    node = schema
    for part in path.split("."):
        node = node["properties"][part]
    return node


def test_every_crd_field_has_its_reference_entry():
    crd = yaml.safe_load(CRD.read_text())
    problems = reference_problems(crd, _hook().render(crd))
    assert not problems, "the API reference (docs/hooks/reference.py) lacks:\n" + "\n".join(problems)


def test_a_field_without_a_description_is_caught():
    crd = yaml.safe_load(CRD.read_text())
    trainer = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["trainer"]
    before = set(reference_problems(crd, _hook().render(crd)))
    trainer["properties"]["undocumentedField"] = {"type": "integer", "default": 3, "minimum": 1}
    problems = set(reference_problems(crd, _hook().render(crd))) - before
    assert problems == {"spec.trainer.undocumentedField: no description in the CRD (operator/rlkube/api): its "
                        "reference entry says nothing"}


def test_a_field_the_generator_drops_is_caught():
    crd = yaml.safe_load(CRD.read_text())
    pages = _hook().render(crd)
    before = set(reference_problems(crd, pages))
    page = pages["reference/trainingjob.md"]
    pages["reference/trainingjob.md"] = "\n".join(
        line for line in page.splitlines() if 'id="spec.trainer.lora.rank"' not in line)
    assert set(reference_problems(crd, pages)) - before == {"spec.trainer.lora.rank: no entry in the API reference"}


def _reasons() -> set[str]:
    names = {v for k, v in vars(Reason).items() if k.isupper() and isinstance(v, str)}
    return names | {c.value for c in ConditionType} | EXTRA_REASONS


def test_every_reason_and_condition_has_a_troubleshooting_entry():
    headings = set(re.findall(r"^#{2,4} (\S+)\s*$", (DOCS / "troubleshooting.md").read_text(), re.MULTILINE))
    missing = sorted(_reasons() - headings)
    assert not missing, f"docs/troubleshooting.md has no heading for: {missing}"


def _site_text() -> str:
    """Every page's markdown, with `--8<--` includes expanded (examples/README.md is a page that way)."""
    texts = []
    for page in DOCS.rglob("*.md"):
        text = page.read_text()
        for m in re.finditer(r'^--8<-- "([^"]+)"$', text, re.MULTILINE):
            text += (ROOT / m.group(1)).read_text()
        texts.append(text)
    return "\n".join(texts)


def test_every_example_has_its_page():
    text = _site_text()
    missing = [p.name for p in sorted((ROOT / "examples").glob("*.yaml")) if p.name not in text]
    assert not missing, f"examples no page of docs/ names: {missing}"
