"""Configuration precedence: defaults < TOML < UOMP_* environment < flags; bad settings refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway import config
from gateway.config import GatewayConfig, GuardConfig, load_section, resolve_home
from gateway.errors import ErrorCode, UompError


def test_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "config.toml"
    f.write_text(
        '[gateway]\nlisten_port = 10443\nendpoints = ["https://a.example"]\nmax_body_bytes = 5\n'
        "[guard]\naggregate_min_items = 5\n"
    )
    assert load_section(GatewayConfig, "gateway", file=None) == GatewayConfig()
    cfg = load_section(GatewayConfig, "gateway", file=f)
    assert (cfg.listen_port, cfg.endpoints, cfg.max_body_bytes) == (10443, ["https://a.example"], 5)
    monkeypatch.setenv("UOMP_GATEWAY_LISTEN_PORT", "11443")
    monkeypatch.setenv("UOMP_GATEWAY_ENDPOINTS", "https://b.example, https://c.example")
    cfg = load_section(GatewayConfig, "gateway", file=f)
    assert cfg.listen_port == 11443 and cfg.endpoints == ["https://b.example", "https://c.example"]
    cfg = load_section(GatewayConfig, "gateway", file=f, overrides={"listen_port": 12443})
    assert cfg.listen_port == 12443
    assert load_section(GuardConfig, "guard", file=f).aggregate_min_items == 5
    assert GatewayConfig().listen_host == "127.0.0.1" and GuardConfig().tcp_host == "127.0.0.1"


@pytest.mark.parametrize(
    ("text", "env", "fragment"),
    [
        ("[gateway]\nlisten_prot = 1\n", None, "'listen_prot' (did you mean 'listen_port'?)"),
        (
            "[gatway]\nlisten_port = 1\n",
            None,
            "unknown section(s) in the config file: 'gatway' (did you mean 'gateway'?)",
        ),
        ("listen_port = 1\n", None, "unknown section(s) in the config file: 'listen_port'"),
        ("[guard]\ntcp_prot = 1\n", None, "unknown setting(s) in [guard]: 'tcp_prot' (did you mean 'tcp_port'?)"),
        ("[gateway.tls]\nx = 1\n", None, "unknown setting(s) in [gateway]: 'tls'"),
        ('[anchor]\nbackend = "none"\n[dashbaord]\nport = 0\n', None, "'dashbaord' (did you mean 'dashboard'?)"),
        ('[gateway]\nlisten_port = "many"\n', None, "wrong type"),
        ('[gateway]\nallow_non_loopback = "maybe"\n', None, "wrong type"),
        ("[gateway\n", None, "cannot read config"),
        ("gateway = 3\n", None, "must be a table"),
        ("", ("UOMP_GATEWAY_LISTEN_PORT", "x"), "wrong type"),
    ],
)
def test_bad_settings_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, env: tuple[str, str] | None, fragment: str
) -> None:
    f = tmp_path / "config.toml"
    f.write_text(text)
    if env:
        monkeypatch.setenv(*env)
    with pytest.raises(UompError) as exc:
        load_section(GatewayConfig, "gateway", file=f)
    assert exc.value.code == "CONFIG_ERROR" and fragment in exc.value.message


def test_every_known_section_loads_and_a_good_file_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.config import CONFIG_SECTIONS

    monkeypatch.delenv("UOMP_DASHBOARD_PORT", raising=False)  # conftest's free-port default
    f = tmp_path / "config.toml"
    f.write_text("".join(f"[{name}]\n" for name in CONFIG_SECTIONS))
    for name, cls in CONFIG_SECTIONS.items():
        assert load_section(cls, name, file=f) == cls()
    f.write_text("[guard]\naggregate_min_items = 5\n[dashboard]\nport = 0\n")
    assert load_section(GuardConfig, "guard", file=f).aggregate_min_items == 5


def test_home_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("UOMP_HOME", str(tmp_path / "h"))
    assert resolve_home() == (tmp_path / "h").resolve()
    assert resolve_home(str(tmp_path / "cli")) == (tmp_path / "cli").resolve()
    monkeypatch.delenv("UOMP_HOME")
    assert resolve_home() == (Path.home() / ".uomp").resolve()


# Example-file entries that differ from the default on purpose (or are only named in a comment).
EXAMPLE_DIFFERS = {
    ("gateway", "endpoints"): "[] means https://localhost:<listen_port>; the example spells that out",
    ("guard", "refresh_reuse_grace_seconds"): "no longer used; the example says so in a comment",
}


def test_example_config_names_every_setting_with_its_default() -> None:
    """config/uomp.example.toml is the list of every limit: each field of each section, at its default,
    and nothing the loader would refuse."""
    import dataclasses
    import math
    import tomllib

    from gateway.config import AnchorConfig, DashboardConfig, RegistryConfig, TrustConfig, TunnelSettings

    root = Path(__file__).resolve().parents[2]
    text = (root / "config" / "uomp.example.toml").read_text(encoding="utf-8")
    doc = tomllib.loads(text)
    assert set(doc) == {"guard", "gateway", "tunnel", "anchor", "dashboard", "registry", "trust"}
    for section, cls in (
        ("guard", GuardConfig),
        ("gateway", GatewayConfig),
        ("tunnel", TunnelSettings),
        ("anchor", AnchorConfig),
        ("dashboard", DashboardConfig),
        ("registry", RegistryConfig),
        ("trust", TrustConfig),
    ):
        defaults = cls()
        names = {f.name for f in dataclasses.fields(cls)}
        assert set(doc[section]) <= names, f"[{section}] names settings the loader refuses"
        for name in sorted(names):
            if (section, name) in EXAMPLE_DIFFERS:
                assert name in text, f"[{section}] {name} is not mentioned in the example"
                continue
            assert name in doc[section], f"[{section}] {name} is missing from config/uomp.example.toml"
            value, default = doc[section][name], getattr(defaults, name)
            if isinstance(default, float):
                assert math.isclose(value, default, rel_tol=1e-3), (section, name, value, default)
            else:
                assert value == default, (section, name, value, default)


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("1", True),
        (" Yes ", True),
        ("ON", True),
        ("0", False),
        ("false", False),
        (" Off\n", False),
        ("maybe", None),
        ("", None),
    ],
)
def test_one_boolean_parser_for_settings_and_switches(raw: str, want: bool | None) -> None:
    assert config.parse_bool(raw) is want


@pytest.mark.parametrize(
    ("raw", "on"), [(None, True), ("1", True), ("off", False), (" NO ", False), ("0", False), ("maybe", True)]
)
def test_speed_switches_are_on_unless_switched_off(monkeypatch: pytest.MonkeyPatch, raw: str | None, on: bool) -> None:
    if raw is None:
        monkeypatch.delenv("UOMP_ORJSON", raising=False)
    else:
        monkeypatch.setenv("UOMP_ORJSON", raw)
    assert config.switch_on("UOMP_ORJSON") is on


def test_a_boolean_setting_takes_the_same_words_and_refuses_others(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UOMP_GATEWAY_LISTEN_REUSE_PORT", " On ")
    assert load_section(GatewayConfig, "gateway", file=None).listen_reuse_port is True
    monkeypatch.setenv("UOMP_GATEWAY_LISTEN_REUSE_PORT", "off")
    assert load_section(GatewayConfig, "gateway", file=None).listen_reuse_port is False
    monkeypatch.setenv("UOMP_GATEWAY_LISTEN_REUSE_PORT", "maybe")
    with pytest.raises(UompError) as err:
        load_section(GatewayConfig, "gateway", file=None)
    assert err.value.code is ErrorCode.CONFIG_ERROR
