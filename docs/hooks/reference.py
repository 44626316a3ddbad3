"""The API reference pages, generated from the CRD at every `make docs` so they cannot drift from the schema.

A mkdocs hook (mkdocs.yml `hooks:`): `on_files` adds reference/trainingjob.md and reference/pod-template.md,
rendered from crds/rlkube.io_trainingjobs.yaml (itself generated from operator/rlkube/api and checked by
tests/unit/test_crd.py); `on_config` expands the nav entry `guide/*.md` into the pages found there, so a page
added under docs/guide/ joins the site without editing mkdocs.yml. tests/unit/test_docs_pages.py imports
`render` and walks the CRD on its own to check that every field has its entry.

Each object of the schema gets a section whose anchor is its path (`#spec.trainer.lora`), and each field a row
with an anchor of its own (`#spec.trainer.lora.rank`): type, default, bounds, description. The pod template is the
same schema under every role, so it is written once (its own page) and the roles link to it; a role whose
template schema differs is written out in full where it stands.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "rlkube.io_trainingjobs.yaml"
PAGE = "reference/trainingjob.md"
CLI_PAGE = "reference/cli.md"
TEMPLATE_PAGE = "reference/pod-template.md"
TEMPLATE_ROOT = "spec.trainer.template"
"""The template schema written on its own page; every role's `template` is compared with it."""
GUIDE_GLOB = "guide/*.md"

BOUNDS = (
    ("minimum", ">= {}"),
    ("exclusiveMinimum", "> {}"),
    ("maximum", "<= {}"),
    ("exclusiveMaximum", "< {}"),
    ("minLength", "length >= {}"),
    ("maxLength", "length <= {}"),
    ("minItems", "items >= {}"),
    ("maxItems", "items <= {}"),
    ("pattern", "pattern `{}`"),
)


def load_schema(crd: Path = CRD) -> dict[str, Any]:
    doc = yaml.safe_load(crd.read_text())
    return doc


def anchor(path: str) -> str:
    """The HTML id of a field or object path: `[]` (an array's items) and `{}` (a map's values) become words."""
    return path.replace("[]", ".items").replace("{}", ".values")


def type_of(node: dict[str, Any]) -> str:
    """The field's type as a reader writes it: `integer`, `array of string`, `map of string to integer`."""
    if node.get("x-kubernetes-int-or-string"):
        return "integer or string"
    t = node.get("type")
    if t == "array":
        items = node.get("items") or {}
        return f"array of {type_of(items)}" if items else "array"
    if t == "object":
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and not node.get("properties"):
            return f"map of string to {type_of(extra)}"
        if node.get("x-kubernetes-preserve-unknown-fields") and not node.get("properties"):
            return "object (any fields)"
        return "object"
    if t is None and node.get("x-kubernetes-preserve-unknown-fields"):
        return "any"
    fmt = node.get("format")
    return f"{t} ({fmt})" if fmt else str(t)


def default_of(node: dict[str, Any]) -> str:
    if "default" not in node:
        return ""
    return f"`{json.dumps(node['default'], separators=(', ', ': '))}`"


def bounds_of(node: dict[str, Any]) -> list[str]:
    out = [fmt.format(node[key]) for key, fmt in BOUNDS if key in node]
    if "enum" in node:
        out.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
    return out


def _cell(text: str) -> str:
    """Table-safe text: pipes escaped, newlines folded."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _object_children(node: dict[str, Any]) -> dict[str, Any]:
    return node.get("properties") or {}


def _nested(path: str, node: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The object a field leads to (its own properties, its items', or its map values'), with that object's path."""
    if node.get("properties"):
        return path, node
    items = node.get("items")
    if isinstance(items, dict) and items.get("properties"):
        return path + "[]", items
    extra = node.get("additionalProperties")
    if isinstance(extra, dict) and extra.get("properties"):
        return path + "{}", extra
    return None


class _Writer:
    def __init__(self, template: dict[str, Any] | None, template_link: str) -> None:
        self.lines: list[str] = []
        self.template = template
        self.template_link = template_link

    def section(self, path: str, node: dict[str, Any], level: int) -> None:
        """One object: its heading, description, a row per field, then a section per nested object."""
        self.lines += ["", f"{'#' * min(level, 6)} `{path}` {{#{anchor(path)}}}", ""]
        if node.get("description"):
            self.lines += [_cell(node["description"]), ""]
        required = set(node.get("required") or [])
        self.lines += ["| Field | Type | Default | Bounds | Description |", "|---|---|---|---|---|"]
        nested: list[tuple[str, dict[str, Any]]] = []
        for name, child in _object_children(node).items():
            fpath = f"{path}.{name}"
            kind = type_of(child)
            sub = _nested(fpath, child)
            shared = self.template is not None and name == "template" and child == self.template
            if shared:
                kind = f"[object]({self.template_link})"
            elif sub is not None:
                kind = kind.replace("object", f"[object](#{anchor(sub[0])})", 1)
                nested.append(sub)
            desc = child.get("description") or "Kubernetes field: see the Kubernetes API reference of the same name."
            flags = ["**required**"] if name in required else []
            if shared:
                flags.append(f"same schema for every role: [pod template]({self.template_link})")
            self.lines.append(
                f'| <a id="{html.escape(anchor(fpath))}"></a>`{name}` | {_cell(kind)} | {_cell(default_of(child))} | '
                f"{_cell('; '.join(bounds_of(child)))} | {_cell(' '.join([desc] + flags))} |"
            )
        for sub_path, sub_node in nested:
            self.section(sub_path, sub_node, level + 1)


def _printer_columns(version: dict[str, Any]) -> list[str]:
    lines = ["| Column | JSON path | Shown | Description |", "|---|---|---|---|"]
    for col in version.get("additionalPrinterColumns", []):
        shown = "`-o wide`" if col.get("priority", 0) else "always"
        lines.append(f"| {col['name']} | `{col['jsonPath']}` | {shown} | {_cell(col.get('description', ''))} |")
    return lines


def render(crd: dict[str, Any] | None = None) -> dict[str, str]:
    """The reference pages, by their path under docs/: {PAGE: markdown, TEMPLATE_PAGE: markdown}."""
    crd = crd or load_schema()
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    group, names = crd["spec"]["group"], crd["spec"]["names"]
    spec = schema["properties"]["spec"]
    template = (spec["properties"].get("trainer") or {}).get("properties", {}).get("template")
    w = _Writer(template, "pod-template.md")
    w.lines += [
        "# TrainingJob API reference",
        "",
        "<!-- Generated from crds/rlkube.io_trainingjobs.yaml by docs/hooks/reference.py; do not edit. -->",
        "",
        f"`apiVersion: {group}/{version['name']}`, `kind: {names['kind']}` (short name "
        f"`{', '.join(names.get('shortNames', []))}`, scope {crd['spec']['scope']}). This page is generated from "
        "the CRD at every build of this site, so every field the API server accepts is here with its type, default, "
        "bounds and description. The API server enforces the types, enums and bounds (HTTP 422 naming the field); "
        "unknown fields are pruned by the API server and refused by `rlkube validate` and `rlkube local`. "
        "Rules that need two fields at once are checked by the operator and the admission webhook "
        "([validation](../concepts/validation.md)).",
        "",
        "## Printer columns",
        "",
        *_printer_columns(version),
    ]
    for top in ("spec", "status"):
        w.section(top, schema["properties"][top], 2)
    pages = {PAGE: "\n".join(w.lines) + "\n"}
    if template is not None:
        t = _Writer(None, "")
        t.lines += [
            "# Pod template reference",
            "",
            "<!-- Generated from crds/rlkube.io_trainingjobs.yaml by docs/hooks/reference.py; do not edit. -->",
            "",
            "`spec.<role>.template` of every role (trainer, inference, actor, preprocessor, redis) has this schema, "
            "shown here under `spec.trainer.template`. It is a subset of a Kubernetes PodTemplateSpec; how it is "
            "merged into the operator's pods is in [pod templates](../operations/pod-templates.md).",
        ]
        t.section(TEMPLATE_ROOT, template, 2)
        pages[TEMPLATE_PAGE] = "\n".join(t.lines) + "\n"
    return pages


def render_cli() -> str:
    """The command line reference: every `rlkube` command's own --help, from the parser the CLI runs."""
    import argparse
    import os
    import sys

    sys.path.insert(0, str(ROOT / "operator"))
    from rlkube.cli import build_parser

    os.environ.setdefault("COLUMNS", "100")  # argparse wraps at the terminal's width: fixed, for a stable page
    lines = ["# Command line reference", "",
             "<!-- Generated from rlkube.cli.build_parser by docs/hooks/reference.py; do not edit. -->", "",
             "Every command's `--help`, generated from the parser `rlkube` runs."]

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        lines.extend(["", f"## `{name}`", "", "```text", parser.format_help().rstrip(), "```"])
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(sub, f"{name} {sub_name}")

    walk(build_parser(), "rlkube")
    return "\n".join(lines) + "\n"


# --- mkdocs hook events ---


def on_config(config, **kwargs):
    """Expand the nav's `guide/*.md` entry into the guide pages present at build time (sorted by title)."""
    docs = Path(config["docs_dir"])

    def expand(items):
        out = []
        for item in items:
            if isinstance(item, dict):
                (title, value), = item.items()
                if value == GUIDE_GLOB:
                    value = [{_title(p): p.relative_to(docs).as_posix()} for p in sorted(docs.glob(GUIDE_GLOB))]
                    if not value:
                        continue
                elif isinstance(value, list):
                    value = expand(value)
                out.append({title: value})
            else:
                out.append(item)
        return out

    if config.get("nav"):
        config["nav"] = expand(config["nav"])
    return config


def _title(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem.replace("-", " ").capitalize()


def on_files(files, config, **kwargs):
    from mkdocs.structure.files import File

    for src_uri, content in {**render(), CLI_PAGE: render_cli()}.items():
        files.append(File.generated(config, src_uri, content=content))
    return files
