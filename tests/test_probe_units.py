"""Pure parts of the prober: target parsing, the allow list on resolved addresses, config."""

from __future__ import annotations

import ipaddress
import re
import socket
from pathlib import Path

import pytest

from colossalai_exporter.errors import ConfigError
from colossalai_exporter.probe.config import ProbeConfig, apply_file
from colossalai_exporter.probe.server import effective_timeout
from colossalai_exporter.probe.targets import (
    Address,
    AllowList,
    BadTarget,
    NotAllowed,
    parse_target,
    resolve,
)
from conftest import run_cli


def addr(ip: str, port: int = 80) -> Address:
    parsed = ipaddress.ip_address(ip)
    return Address(socket.AF_INET if parsed.version == 4 else socket.AF_INET6, parsed, port)


def test_parse_target_blackbox_style() -> None:
    t = parse_target("127.0.0.1:8000", "http")
    assert (t.scheme, t.host, t.port, t.request_path("/ping")) == ("http", "127.0.0.1", 8000,
                                                                   "/ping")
    t = parse_target("https://Chat.Example:8443/prefix/?x=1", "http")
    assert (t.host, t.port, t.tls) == ("chat.example", 8443, True)
    assert t.request_path("/engine_check") == "/prefix/engine_check?x=1"
    assert t.host_header() == "chat.example:8443"
    assert parse_target("http://[::1]:80", "http").host_header() == "[::1]"
    assert parse_target("[::1]:8080", "tcp").host == "::1"
    for bad, kind in [("", "http"), ("ftp://x/", "http"), ("http://x:99999/", "http"),
                      ("http://u:p@x/", "http"), ("x", "tcp"), ("x:0", "tcp"),
                      ("http://a b/", "http")]:
        with pytest.raises(BadTarget):
            parse_target(bad, kind)


def test_allow_list_judges_resolved_addresses_not_names() -> None:
    allow = AllowList()
    target = parse_target("http://localhost.attacker.example/", "http")
    with pytest.raises(NotAllowed, match=r"10\.0\.0\.5"):
        allow.filter(target, [addr("10.0.0.5")])
    # only the allowed addresses of a mixed answer are used
    assert allow.filter(target, [addr("10.0.0.5"), addr("127.0.0.1")]) == [addr("127.0.0.1")]
    # an IPv4-mapped IPv6 literal is judged as the IPv4 address it carries
    assert resolve("::ffff:10.0.0.5", 80, 1.0)[0].ip == ipaddress.ip_address("10.0.0.5")
    with pytest.raises(NotAllowed):
        allow.filter(parse_target("http://[::ffff:10.0.0.5]/", "http"),
                     resolve("::ffff:10.0.0.5", 80, 1.0))
    with pytest.raises(NotAllowed):  # 0.0.0.0 reaches local services on Linux; not loopback
        allow.filter(parse_target("0.0.0.0:80", "tcp"), [addr("0.0.0.0")])
    vouched = AllowList(loopback=False, hosts=("*.svc.cluster.local",),
                        networks=(ipaddress.ip_network("10.20.0.0/16"),), ports=(8000,))
    svc = parse_target("http://chat.ns.svc.cluster.local:8000/", "http")
    assert vouched.filter(svc, [addr("172.16.0.9", 8000)]) == [addr("172.16.0.9", 8000)]
    assert vouched.filter(parse_target("10.20.3.4:8000", "tcp"), [addr("10.20.3.4", 8000)])
    with pytest.raises(NotAllowed):
        vouched.filter(parse_target("127.0.0.1:8000", "tcp"), [addr("127.0.0.1", 8000)])
    with pytest.raises(NotAllowed, match=r"allow\.ports"):
        vouched.filter(parse_target("10.20.3.4:22", "tcp"), [addr("10.20.3.4", 22)])


def test_effective_timeout_follows_blackbox() -> None:
    assert effective_timeout(5.0, None, 0.5) == 5.0
    assert effective_timeout(5.0, "3", 0.5) == 2.5
    assert effective_timeout(1.0, "10", 0.5) == 1.0
    with pytest.raises(ValueError, match="could not convert"):
        effective_timeout(5.0, "soon", 0.5)


@pytest.mark.parametrize(("yaml_text", "needle"), [
    ("modules: {m: {prober: ftp}}", "modules.m.prober: invalid enum value 'ftp' (one of: http,"),
    ("modules: {m: {prober: http, timeout: soon}}", "modules.m.timeout: 'soon' is not a duration"),
    ("modules: {m: {prober: http, timeout: 0s}}", "modules.m.timeout must be positive"),
    ("modules: {m: {prober: http, http: {valid_status_codes: [700]}}}",
     "modules.m.http.valid_status_codes[0]: expected `int` <= 599"),
    ("modules: {m: {prober: http, http: {colour: red}}}", "modules.m.http: unknown key `colour`"),
    ("modules: {m: {prober: http, http: {header_files: {Authorization: /nonexistent}}}}",
     "modules.m.http.header_files.Authorization: cannot read /nonexistent: No such file"),
    ("modules: {m: {prober: http, http: {json: [{field: status}]}}}",
     "modules.m.http.json[0]: missing key `equals`"),
    ("modules: {m: {prober: http, http: {path: health}}}", "modules.m.http.path: expected `str`"),
    ("modules: {m: {prober: http, http: {tls_config: {ca_file: nope.pem}}}}",
     "modules.m.http.tls_config.ca_file: cannot read"),
    ("modules: {m: {prober: http, http: {tls_config: {cert_file: c.pem}}}}",
     "modules.m.http.tls_config.key_file: is required with cert_file"),
    ("modules: {m: {prober: tcp, http: {path: /x}}}", "http is not for prober tcp"),
    ("allow: {networks: [10.0.0.0/33]}", "is not a network"),
    ("allow: {ports: [0]}", "allow.ports[0]: expected `int` >= 1"),
    ("max_concurrent: 0", "max_concurrent: expected `int` >= 1"),
    ("colour: red", "unknown key `colour`"),
])
def test_bad_module_config_names_the_key(tmp_path: Path, yaml_text: str, needle: str) -> None:
    import yaml

    with pytest.raises(ConfigError, match=re.escape(needle)):
        apply_file(ProbeConfig(), yaml.safe_load(yaml_text), tmp_path / "probe.yml")


def test_bad_config_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "probe.yml"
    bad.write_text("modules:\n  m: {prober: [\n")
    result = run_cli("probe", "--config.file", str(bad), "--web.listen-address", "127.0.0.1:0")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("colossalai-exporter: error:")
    assert "is not valid YAML" in lines[0]
    bad.write_text("modules: {m: {prober: sonar}}\n")
    result = run_cli("probe", "--config.file", str(bad))
    assert result.returncode == 2
    assert "modules.m.prober: invalid enum value 'sonar'" in result.stderr
    result = run_cli("probe", "--probe.max-concurrent", "0")
    assert result.returncode == 2
    assert "--probe.max-concurrent" in result.stderr


def test_example_config_loads(tmp_path: Path) -> None:
    import yaml

    from conftest import REPO

    example = REPO / "deploy" / "probe" / "probe.example.yml"
    data = yaml.safe_load(example.read_text())
    # The example names a secret file that exists only where it is deployed.
    secret = tmp_path / "chat-token"
    secret.write_text("Bearer x\n")
    for name in ("chat_generate", "chat_stream"):
        data["modules"][name]["http"]["header_files"]["Authorization"] = str(secret)
    config = ProbeConfig()
    apply_file(config, data, example)
    assert {"chat_health", "chat_generate", "chat_stream", "inference_models",
            "colossal_inference"} <= set(config.modules)
    stream = config.modules["chat_stream"]
    assert (stream.stream.format, stream.stream.first_token_timeout,
            stream.stream.max_token_gap) == ("openai", 10.0, 5.0)
    generate = config.modules["chat_generate"]
    assert generate.http.method == "POST"
    assert generate.timeout == 30.0
    assert config.allow.host_allowed("a.inference.svc.cluster.local")
