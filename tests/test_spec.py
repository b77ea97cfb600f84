"""Spec files: every shipped spec loads; every broken one is refused naming file and field."""

from __future__ import annotations

import pytest

from fp32patch.patcher.spec import SpecError, load_specs, parse_spec

GOOD = """
schema = 1
id = "demo-patch"
summary = "s"
[target]
distribution = "pkg"
path = "pkg/m.py"
versions = ">=1.0"
[[edits]]
id = "e"
op = "prepend_to_body"
scope = "C.f"
code = "pass"
"""


def test_shipped_specs_load():
    specs = {s.id: s for s in load_specs()}
    assert "nemotron-h-fp32-lm-head" in specs
    spec = specs["nemotron-h-fp32-lm-head"]
    assert spec.target.distribution == "vllm" and [v.name for v in spec.variants] == [
        "with-sampling-metadata",
        "hidden-states-only",
    ]
    assert len(spec.sha256) == 64


def test_hash_changes_with_content():
    a = parse_spec(GOOD, "a.toml")
    b = parse_spec(GOOD.replace('code = "pass"', 'code = "return"'), "b.toml")
    assert a.sha256 != b.sha256 and a.sha256 == parse_spec(GOOD, "c.toml").sha256


BAD = [
    (GOOD.replace("schema = 1", "schema = 2"), "schema: this fp32patch reads schema 1"),
    (GOOD.replace('id = "demo-patch"', 'id = "Demo Patch"'), "id: 'Demo Patch' is not a lower-case"),
    (GOOD.replace('summary = "s"\n', ""), "summary: is required"),
    (GOOD.replace('path = "pkg/m.py"', 'path = "../etc/passwd"'), "target.path: must be a relative POSIX path"),
    (GOOD.replace('path = "pkg/m.py"', 'path = "/abs/m.py"'), "target.path: must be a relative POSIX path"),
    (GOOD.replace('versions = ">=1.0"', 'versions = "newest"'), "target.versions: not a version specifier"),
    (
        GOOD.replace('op = "prepend_to_body"', 'op = "rewrite_everything"'),
        "edits[0].op: unknown operation 'rewrite_everything'",
    ),
    (GOOD.replace('scope = "C.f"', 'scope = "C..f"'), "edits[0].scope: bad segment ''"),
    (GOOD.replace('scope = "C.f"\n', ""), "edits[0].scope: prepend_to_body needs the function's scope"),
    (GOOD.replace('code = "pass"', 'code = "def ("'), "not valid"),
    (GOOD + 'colour = "blue"\n', "edits[0].colour: unknown field"),
    (GOOD + "count = 0\n", "edits[0].count: must be at least 1"),
    (GOOD + 'count = "one"\n', "edits[0].count: expected integer, got string"),
    (GOOD + '[[variants]]\nname = "v"\nedits.nope.params = []\n', "variants[0].edits.nope: no edit with id 'nope'"),
    (
        GOOD + '[[variants]]\nname = "v"\nedits.e.op = "replace"\n',
        "variants[0].edits.e: a variant may not change an edit's id or op",
    ),
    (GOOD + '[[obsolete_when]]\nname = "x"\n', "obsolete_when[0].patterns: needs at least one pattern"),
    (
        GOOD + '[[obsolete_when]]\nname = "x"\npatterns = [{ regex = "(" }]\n',
        "obsolete_when[0].patterns[0].regex: not a regular expression",
    ),
    (GOOD + '[[refuse_when]]\nname = "x"\nwhy = "y"\n', "refuse_when[0].patterns: needs at least one pattern"),
    (
        GOOD + '[[refuse_when]]\nname = "x"\npatterns = [{ regex = "z" }]\n',
        "refuse_when[0].why: is required",
    ),
    ("schema = 1\nid = \n", "not valid TOML"),
]


@pytest.mark.parametrize(("text", "expected"), BAD)
def test_bad_specs_are_refused_naming_file_and_field(text, expected):
    with pytest.raises(SpecError) as info:
        parse_spec(text, "patches/broken.toml")
    message = str(info.value)
    assert message.startswith("patches/broken.toml: ")
    assert expected in message, message


def test_spec_folder_is_explicit_and_checked(tmp_path, cli):
    (tmp_path / "bad.toml").write_text(GOOD.replace('op = "prepend_to_body"', 'op = "nope"'))
    result = cli("list", "--specs", tmp_path)
    assert result.exit_code == 2 and "bad.toml: edits[0].op: unknown operation" in " ".join(result.stderr.split())
    (tmp_path / "bad.toml").write_text(GOOD)
    result = cli("list", "--specs", tmp_path, "--json")
    assert result.exit_code == 0 and '"demo-patch"' in result.stdout
