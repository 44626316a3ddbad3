"""lifecycle/label_syntax.py: the API server's label and annotation rules (docs/references.md §11), and the job
refused by validation naming the template field, before any child exists."""

from __future__ import annotations

import pytest
from support import specs
from rlkube.lifecycle import label_syntax
from rlkube.lifecycle.validation import SpecError, parse_spec

GOOD_KEYS = ["team", "app.kubernetes.io/name", "a", "A_b-c.d", "example.com/X", "x" * 63, "a.b/" + "y" * 63]
BAD_KEYS = ["", "/team", "team/", "a/b/c", "-team", "team-", "Example.com/x", "my team", "x" * 64,
            "a_b.com/x", ("p" * 254) + "/x"]
GOOD_VALUES = ["", "v1", "not-a-space", "x" * 63, "A.b_c"]
BAD_VALUES = ["not a label", "-v", "v-", "x" * 64, "a/b", "é"]


@pytest.mark.parametrize("key", GOOD_KEYS)
def test_keys_the_api_server_takes_pass(key):
    assert label_syntax.qualified_name_error(key) is None


@pytest.mark.parametrize("key", BAD_KEYS)
def test_keys_the_api_server_refuses_say_why(key):
    assert label_syntax.qualified_name_error(key)


@pytest.mark.parametrize("value", GOOD_VALUES)
def test_values_the_api_server_takes_pass(value):
    assert label_syntax.label_value_error(value) is None


@pytest.mark.parametrize("value", BAD_VALUES)
def test_values_the_api_server_refuses_say_why(value):
    assert label_syntax.label_value_error(value)


def test_annotation_keys_are_checked_lowercased_and_their_size_bounded():
    # Upper case in a prefix is refused in a label key but not in an annotation key (lowercased first).
    assert label_syntax.annotation_errors({"Example.com/x": "anything at all, spaces too"}) == []
    assert [k for k, _ in label_syntax.annotation_errors({"a b": "v"})] == ["a b"]
    big = {"k": "v" * label_syntax.ANNOTATIONS_MAX_BYTES}
    assert [k for k, _ in label_syntax.annotation_errors(big)] == [None]
    assert label_syntax.annotation_errors({"k": "v" * (label_syntax.ANNOTATIONS_MAX_BYTES - 1)}) == []


@pytest.mark.parametrize(("template", "field"), [
    ({"metadata": {"labels": {"team": "not a label"}}}, "spec.actor.template.metadata.labels[team]"),
    ({"metadata": {"labels": {"my team": "x"}}}, "spec.actor.template.metadata.labels[my team]"),
    ({"metadata": {"annotations": {"a/b/c": "x"}}}, "spec.actor.template.metadata.annotations[a/b/c]"),
    ({"spec": {"nodeSelector": {"pool": "gpu nodes"}}}, "spec.actor.template.spec.nodeSelector[pool]"),
])
def test_a_template_with_a_label_the_api_server_refuses_is_invalid_naming_the_field(template, field):
    with pytest.raises(SpecError) as refused:
        parse_spec(specs.spec(**{"actor.template": template}))
    assert [e.field for e in refused.value.errors] == [field]


def test_a_template_with_valid_labels_is_valid():
    template = {"metadata": {"labels": {"team": "rl", "example.com/tier": ""}, "annotations": {"Note": "a b"}},
                "spec": {"nodeSelector": {"kubernetes.io/arch": "amd64"}}}
    assert parse_spec(specs.spec(**{"actor.template": template})).actor.template is not None
