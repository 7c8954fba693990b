"""The typed configuration (deployments.config), the env registry (deployments.envs) and the
reference page generated from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from deployments import envs
from deployments.app import build_app
from deployments.config import DeploymentArgs, parse
from deployments.tools import reference

ROOT = Path(__file__).resolve().parents[1]


def test_the_reference_page_is_what_the_code_says():
    assert (ROOT / "docs" / "configuration.md").read_text() == reference.render(), \
        "docs/configuration.md is stale: python -m deployments.tools.reference > docs/configuration.md"


def test_every_field_and_variable_is_documented():
    for _, model, _ in reference.SECTIONS:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
    for v in envs.VARS.values():
        assert v.doc and v.kind


def test_env_values_are_parsed_with_the_variables_name():
    assert envs.read("COLDSTART_TRITON", {}) is True
    assert envs.read("COLDSTART_TRITON", {"COLDSTART_TRITON": " off "}) is False
    assert envs.read("COLDSTART_TRITON", {"COLDSTART_TRITON": ""}) is True  # empty: the default
    with pytest.raises(ValueError, match=r"COLDSTART_PAUSE_GC='maybe': give 1 or 0"):
        envs.read("COLDSTART_PAUSE_GC", {"COLDSTART_PAUSE_GC": "maybe"})
    with pytest.raises(KeyError):
        envs.read("COLDSTART_NOT_A_VARIABLE", {})


def test_only_the_registry_reads_the_environment():
    """No module of the serving side reads os.environ itself for a COLDSTART_* variable, nor
    names a COLDSTART_* variable the registry does not know."""
    import re
    reads = re.compile(r"(environ(\.get)?|getenv)\(?\[?\s*[\"']COLDSTART_")
    named = re.compile(r"COLDSTART_[A-Z_]+")
    for path in (ROOT / "deployments").rglob("*.py"):
        text = path.read_text()
        if path.name != "envs.py":
            assert not reads.search(text), f"{path.relative_to(ROOT)} reads the environment itself"
        unknown = set(named.findall(text)) - set(envs.VARS)
        assert not unknown, f"{path.relative_to(ROOT)} names {sorted(unknown)}, which deployments/envs.py lacks"


def test_build_app_checks_args_on_the_controller(tmp_path):
    with pytest.raises(ValueError, match=r"args.engine: unknown field 'max_slot'; known: .*max_slots"):
        build_app({"model": str(tmp_path), "engine": {"max_slot": 8}})
    with pytest.raises(ValueError, match=r"args.load.read_bytes: read_bytes=1000 must be a positive multiple of 4096|"
                                         r"args.load: read_bytes=1000 must be a positive multiple of 4096"):
        build_app({"model": str(tmp_path), "load": {"read_bytes": 1000}})
    app = build_app({"model": "weights/x", "engine": {"max_slots": 4}})
    bound = app._bound_deployment.init_kwargs
    assert Path(bound["model"]).is_absolute() and bound["engine"]["max_slots"] == 4


def test_a_relative_model_is_taken_from_coldstart_home(monkeypatch, tmp_path):
    monkeypatch.setenv("COLDSTART_HOME", str(tmp_path))
    assert parse(DeploymentArgs, {"model": "weights/m"}, "args").model_path() == tmp_path / "weights" / "m"
    monkeypatch.delenv("COLDSTART_HOME")
    assert parse(DeploymentArgs, {"model": "weights/m"}, "args").model_path() == Path.cwd() / "weights" / "m"
