"""The settings registry: every ECHONCCL_* variable of the tree is registered and read through
`settings.get`, values parse one way, and the README's table is the registry's."""
from __future__ import annotations

import re

import pytest
from mpi4py import MPI

import echonccl
from echonccl import codec, config, settings
from echonccl.feedback import Feedback
from launch import ROOT

_NAME = re.compile(r"\bECHONCCL_[A-Z0-9_]*[A-Z0-9]\b")


def _tree_files():
    for d in ("echonccl", "tools", "tests", "studies", "mpi_examples", ".ci"):
        yield from (p for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in (".py", ".sh", ".md", ""))
    yield from (ROOT / n for n in ("Makefile", "README.md", "pyproject.toml", "setup.py"))


def test_every_variable_in_the_tree_is_registered():
    used = {}
    for p in _tree_files():
        for name in _NAME.findall(p.read_text(errors="replace")):
            used.setdefault(name, p.relative_to(ROOT).as_posix())
    unknown = {n: where for n, where in used.items() if n not in settings.BY_NAME and n != "ECHONCCL_DEV"}
    assert not unknown, f"unregistered variables (name: first file): {unknown}"
    assert all(s.name.startswith("ECHONCCL_DEV_") != s.user for s in settings.SETTINGS), \
        "developer settings are named ECHONCCL_DEV_*, and only they"


def test_the_package_reads_them_only_through_settings():
    for p in (ROOT / "echonccl").rglob("*.py"):
        if p.name == "settings.py":
            continue
        for ln in p.read_text().splitlines():
            if "environ" in ln or "getenv" in ln:
                assert not _NAME.search(ln), f"{p.name}: {ln.strip()}"


def test_readme_settings_table_is_the_registry():
    readme = (ROOT / "README.md").read_text()
    assert settings.markdown_table(user=True) in readme
    assert settings.markdown_table(user=False) in readme


def test_each_option_variable_defaults_to_the_option_default():
    """The registry (standard library only) writes the defaults again: they must be `Config`'s
    (which takes the codec's and `Feedback`'s own)."""
    cfg = config.Config()
    for option, var in config.ENV.items():
        assert settings.BY_NAME[var].default == getattr(cfg, option), (var, option)
    assert cfg.codec == codec.DEFAULT_CODEC and cfg.feedback_rounding is Feedback().rounding


def test_values_parse_one_way():
    get = settings.get
    assert get("ECHONCCL_FUSED", {"ECHONCCL_FUSED": "Off"}) is False
    assert get("ECHONCCL_FUSED", {"ECHONCCL_FUSED": " yes "}) is True
    assert get("ECHONCCL_FUSED", {"ECHONCCL_FUSED": ""}) is True          # empty: unset
    for bad in ("2", "enabled", "nope"):
        with pytest.raises(ValueError, match=f"ECHONCCL_FUSED={bad!r}: not a boolean"):
            get("ECHONCCL_FUSED", {"ECHONCCL_FUSED": bad})
    assert get("ECHONCCL_CACHE_BYTES", {"ECHONCCL_CACHE_BYTES": "64M"}) == 64 << 20
    assert get("ECHONCCL_CACHE_BYTES", {"ECHONCCL_CACHE_BYTES": "4096"}) == 4096
    assert get("ECHONCCL_CROSSOVER_BYTES", {"ECHONCCL_CROSSOVER_BYTES": "2GiB"}) == 2 << 30
    with pytest.raises(ValueError, match="ECHONCCL_CACHE_BYTES='1.5G': not a byte count"):
        get("ECHONCCL_CACHE_BYTES", {"ECHONCCL_CACHE_BYTES": "1.5G"})
    with pytest.raises(ValueError, match="ECHONCCL_ENGINE='tpu': not one of auto, gpu, cpu"):
        get("ECHONCCL_ENGINE", {"ECHONCCL_ENGINE": "tpu"})
    assert get("ECHONCCL_DEBUG", {"ECHONCCL_DEBUG": "info"}) == "INFO"
    assert get("ECHONCCL_TIMEOUT", {}) == 300.0
    with pytest.raises(KeyError):
        get("ECHONCCL_" + "NOT_A_SETTING", {})


def test_options_keyword_then_environment(monkeypatch):
    for var in config.ENV.values():
        monkeypatch.delenv(var, raising=False)
    assert config.resolve(rounds=2, fused=False).rounds == 2
    monkeypatch.setenv("ECHONCCL_ROUNDS", "3")
    monkeypatch.setenv("ECHONCCL_FUSED", "on")
    cfg = config.resolve(rounds=2, fused=False)
    assert cfg.rounds == 3 and cfg.fused is True
    monkeypatch.setenv("ECHONCCL_ROUNDS", "9")
    with pytest.raises(ValueError, match=r"rounds must be an int from 1 to 4, got 9 \(set: ECHONCCL_ROUNDS"):
        config.resolve()
    monkeypatch.setenv("ECHONCCL_ROUNDS", "two")
    with pytest.raises(ValueError, match="ECHONCCL_ROUNDS='two'"):
        config.resolve()
    monkeypatch.delenv("ECHONCCL_ROUNDS")
    monkeypatch.setenv("ECHONCCL_FEEDBACK_ROUNDING", "on")
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu") as c:
        assert c.config.feedback_rounding is True and c.new_feedback().rounding is True
