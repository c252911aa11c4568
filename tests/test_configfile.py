"""The config layer every component reads its file through: strict keys, one duration
grammar, paths relative to the file."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from colossalai_exporter.bridge.config import DeliverySection
from colossalai_exporter.configfile import (
    ConfigPath,
    Seconds,
    Section,
    convert,
    convert_all,
    load,
    parse_duration,
    parse_prometheus_duration,
)
from colossalai_exporter.errors import ConfigError
from colossalai_exporter.node.config import GpuSection
from colossalai_exporter.probe.config import ModuleSection
from colossalai_exporter.rulesgen.config import Duration


@pytest.mark.parametrize(("text", "seconds"), [
    ("30s", 30), ("5m", 300), ("1h30m", 5400), ("500ms", 0.5), ("1d", 86400), ("2w", 1209600),
    ("0s", 0), ("1m30s", 90),
    # the single decimal value with a unit the bridge and prober took before
    ("1.5s", 1.5), ("0.25m", 15), ("5", 5),
])
def test_one_duration_grammar_for_every_config(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)
    # every component's file reads it through the layer's one Seconds type
    assert convert({"initial_backoff": text}, DeliverySection).initial_backoff == \
        pytest.approx(seconds)
    module = convert({"prober": "http", "timeout": text}, ModuleSection)
    assert module.timeout == pytest.approx(seconds)
    assert convert({"timeout_seconds": text}, GpuSection).timeout_seconds == \
        pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5 min", "-1s", "1h 30m", "ten", "1.5m30s", "s"])
def test_what_is_not_a_duration_is_refused_everywhere(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration(text)
    for section, data in ((DeliverySection, {"initial_backoff": text}),
                          (ModuleSection, {"prober": "http", "timeout": text}),
                          (GpuSection, {"timeout_seconds": text})):
        with pytest.raises(ConfigError, match=r"(not a duration|cannot be negative)"):
            convert(data, section)


def test_rule_durations_are_exactly_prometheus_grammar() -> None:
    # Written into rule files as they are: Prometheus must read them back.
    assert Duration.parse("1h30m").seconds == parse_prometheus_duration("1h30m") == 5400
    for text in ("1.5m", "5"):
        with pytest.raises(ValueError, match="not a Prometheus duration"):
            Duration.parse(text)


class Inner(Section, frozen=True):
    timeout: Seconds = Seconds(5)
    folder: ConfigPath | None = None


class Outer(Section, frozen=True):
    inner: Inner = Inner()
    items: list[Inner] = msgspec.field(default_factory=list)


def test_sections_refuse_unknown_keys_at_any_depth_and_name_the_path(tmp_path: Path) -> None:
    path = tmp_path / "x.yml"
    for text, message in [
        ("inner: {timout: 5s}", "inner: unknown key `timout`"),
        ("items: [{}, {foldr: a}]", "items[1]: unknown key `foldr`"),
        ("inner: {timeout: 5 min}", "inner.timeout:"),
        ("inner: {timeout: -3}", "inner.timeout:"),
        ("inner: {timeout: true}", "inner.timeout:"),
        ("iner: {}", "unknown key `iner`"),
    ]:
        path.write_text(text + "\n")
        with pytest.raises(ConfigError) as error:
            load(path, Outer)
        assert str(error.value).startswith(f"{path}: {message}"), error.value


def test_durations_and_paths_relative_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "conf" / "x.yml"
    path.parent.mkdir()
    path.write_text("inner: {timeout: 1m30s, folder: data}\nitems: [{folder: /abs}]\n")
    loaded = load(path, Outer)
    assert loaded.inner.timeout == 90.0
    assert loaded.inner.folder == str(tmp_path / "conf" / "data")
    assert loaded.items[0].folder == "/abs"


def test_one_way_to_read_a_secret_for_the_bridge_and_the_prober(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """configfile.secret_from_file/_env: what the bridge's KEY_file/KEY_env and the
    prober's header_files read, with the same rules and the same words."""
    from colossalai_exporter.bridge.config import load_config
    from colossalai_exporter.configfile import secret_from_env, secret_from_file
    from colossalai_exporter.flags import load_yaml_file
    from colossalai_exporter.probe.config import ProbeConfig, apply_file

    token, empty = tmp_path / "token", tmp_path / "empty"
    token.write_text("s3cret\n")
    empty.write_text(" \n")
    assert secret_from_file(token) == "s3cret"
    with pytest.raises(ConfigError, match=r"empty is empty$"):
        secret_from_file(empty)
    with pytest.raises(ConfigError, match=r"cannot read .*missing: No such file"):
        secret_from_file(tmp_path / "missing")
    monkeypatch.setenv("TOKEN", " s3cret ")
    monkeypatch.setenv("BLANK", "")
    assert secret_from_env("TOKEN") == "s3cret"
    with pytest.raises(ConfigError, match="environment variable BLANK is empty"):
        secret_from_env("BLANK")
    with pytest.raises(ConfigError, match="environment variable UNSET_TOKEN is not set"):
        secret_from_env("UNSET_TOKEN")

    # The same empty file refused by both components, in the same words.
    bridge = tmp_path / "bridge.yml"
    bridge.write_text("state_dir: state\ntargets:\n- name: wd\n  type: heartbeat\n"
                      "  url_file: empty\n")
    with pytest.raises(ConfigError, match=r"targets\[wd\]\.url_file: .*empty is empty"):
        load_config(bridge)
    probe = tmp_path / "probe.yml"
    probe.write_text("modules: {m: {prober: http, http: {header_files: {Authorization: empty}}}}\n")
    with pytest.raises(ConfigError,
                       match=r"modules\.m\.http\.header_files\.Authorization: .*empty is empty"):
        apply_file(ProbeConfig(), load_yaml_file(probe), probe)


def test_convert_all_reports_every_key_at_fault_once() -> None:
    class Part(Section, frozen=True):
        name: str
        timeout: Seconds = Seconds(1)
        retries: int = 3

    value, problems = convert_all({"name": "x", "timeout": "soon", "retries": "3", "extra": 1},
                                  Part, "f.yml", at="parts[x]")
    assert problems == [
        "f.yml: parts[x].timeout: 'soon' is not a duration (like 30s, 5m, 1h30m, 500ms)",
        "f.yml: parts[x].retries: expected `int`, got `str`",
        "f.yml: parts[x]: unknown key `extra` (known: name, timeout, retries)",
    ]
    assert value == Part(name="x")  # what the rest converted to, the faulty keys at defaults
    # a required key at fault: reported once, never as "missing" too, and no value
    value, problems = convert_all({"name": 5}, Part)
    assert (value, problems) == (None, ["name: expected `str`, got `int`"])
    assert convert_all({"name": "ok"}, Part) == (Part(name="ok"), [])
