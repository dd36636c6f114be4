"""Configuration: loading, precedence, and one clear line (exit code 2) for every mistake."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tlt_stream.basics.config import Config, ConfigError, describe, load_config, redact_config, redact_text, redact_url


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tlt.toml"
    path.write_text(text)
    return path


def test_defaults_validate_and_describe_every_field() -> None:
    config = load_config(environ={})
    assert config == Config()
    assert config.topic_prefix == "tlt/default/"
    rows = describe()
    assert {"run", "bus.redis_url", "bus.block_ms"} <= {key for key, _, _ in rows}
    assert all(text for _, _, text in rows), "every field carries a description"


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, 'run = "from-file"\n[bus]\nblock_ms = 10\nread_count = 7\n')
    config = load_config(
        path,
        environ={"TLT_BUS__BLOCK_MS": "20", "TLT_RUN": "from-env", "TLT_REDIS_URL": "redis://h:1/0"},
        overrides=["bus.block_ms=30"],
        extra={("run",): "from-flag", ("bus", "mqtt_url"): None},
    )
    assert config.run == "from-flag"
    assert config.bus.block_ms == 30
    assert config.bus.read_count == 7
    assert config.bus.redis_url == "redis://h:1/0"
    assert config.bus.mqtt_url is None


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"environ": {"TLT_BUS__BLOCK_MS": "0"}}, "TLT_BUS__BLOCK_MS: bus.block_ms: expected `int` >= 1 (value: 0)"),
        ({"environ": {"TLT_BUS__BLOKC_MS": "5"}}, "unknown key 'bus.blokc_ms'; allowed keys here: redis_url"),
        ({"overrides": ["bus.read_count=lots"]}, "bus.read_count: expected `int`, got `str`"),
        ({"overrides": ["bus.read_count"]}, "expected KEY=VALUE"),
        ({"environ": {"TLT_RUN": "has space"}}, "run: expected `str` matching regex"),
        ({"environ": {"TLT_MQTT_URL": "http://user:hunter2@h"}}, "mqtt_url must start with one of mqtt://, mqtts://"),
        ({"environ": {"TLT_REDIS_URL": "http://h/0?password=hunter2"}}, "redis_url must start with one of redis://"),
        ({"environ": {"TLT_BUS__HEARTBEAT_S": "60"}}, "heartbeat_ttl_s must be greater than heartbeat_s"),
        (
            {"overrides": ["policy.prompts_per_step=2", "learner.groups_per_step=4"]},
            "learner.groups_per_step: is 4, more than the 2 groups",
        ),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(kwargs: dict, expected: str) -> None:
    kwargs.setdefault("environ", {})
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message
    assert "hunter2" not in message


def test_unknown_key_in_file_is_an_error_not_ignored(tmp_path: Path) -> None:
    path = write(tmp_path, "[bus]\nredis_ulr = 'redis://x'\n")
    with pytest.raises(ConfigError, match=r"config file .*tlt.toml: unknown key 'bus.redis_ulr'"):
        load_config(path, environ={})
    with pytest.raises(ConfigError, match="unknown key 'busses'"):
        load_config(write(tmp_path, "[busses]\nx = 1\n"), environ={})


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", environ={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[bus\n"), environ={})


def test_unrelated_environment_is_ignored() -> None:
    config = load_config(environ={"TLT_TEST_REDIS_URL": "redis://x", "PATH": "/bin", "TLTX__Y": "1"})
    assert config == Config()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("rediss://app:s3cret@host:6380/0", "rediss://app:***@host:6380/0"),
        ("redis://:s3cret@[::1]:6379/0", "redis://:***@[::1]:6379/0"),
        ("redis://host:6379/0?password=s3cret&db=1", "redis://host:6379/0?password=***&db=1"),
        ("unix:///run/redis.sock?db=0&Password=s3cret", "unix:///run/redis.sock?db=0&Password=***"),
        ("mqtts://broker?ca_file=/ca.pem&token=s3cret#x", "mqtts://broker?ca_file=/ca.pem&token=***#x"),
        ("redis://h?passwd=s3cret;pass=s3cret", "redis://h?passwd=***;pass=***"),
        ("redis://h?ssl_password=s3cret&client_secret=s3cret", "redis://h?ssl_password=***&client_secret=***"),
        ("mqtt://u:p@s3cret/x@host:1883", "mqtt://u:***@host:1883"),  # unescaped @ and / in the password
        ("redis://u:s3cret@h:notaport", "redis://u:***@h:notaport"),  # unparseable as a URL: still redacted
        ("redis://host:6379", "redis://host:6379"),
        # a user part without a colon may be the password (redis-cli reads `redis://SECRET@host` so): hidden whole
        ("redis://s3cret@host/0?db=2", "redis://***@host/0?db=2"),
        ("rediss://s3@cret@host:6380", "rediss://***@host:6380"),
    ],
)
def test_redact_url_hides_passwords(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "s3cret" not in redact_text(f"failed: {url!r}, retrying")


def test_redact_url_hides_a_user_part_without_a_colon_whatever_it_holds() -> None:
    """One value is one URL, so its user part reaches to the last `@` even through a space or a quote."""
    assert redact_url("redis://s3cret s3'cret@host:1/0") == "redis://***@host:1/0"


def test_redact_url_and_config_leave_what_holds_no_secret() -> None:
    assert redact_url(None) is None
    tree = {
        "run": "r",
        "bus": {"redis_url": "redis://:pw@h/0", "mqtt_url": None, "block_ms": 5, "mqtt_password": "pw"},
        "tls": {"key_passphrase": "", "api_key": 7, "hosts": ["mqtt://u:pw@a", "b"]},
        "other": {"password_file": "/run/pw", "tokens": 3, "store_root": "/data"},
    }
    assert redact_config(tree) == {
        "run": "r",
        "bus": {"redis_url": "redis://:***@h/0", "mqtt_url": None, "block_ms": 5, "mqtt_password": "***"},
        "tls": {"key_passphrase": "", "api_key": "***", "hosts": ["mqtt://u:***@a", "b"]},
        "other": {"password_file": "/run/pw", "tokens": 3, "store_root": "/data"},
    }
    assert redact_text("tokens=12 passed=3 author=x") == "tokens=12 passed=3 author=x"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tlt_stream.commands.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_cli_config_error_is_one_line_exit_2_no_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, "[bus]\nblock_ms = -5\n")
    result = run_cli("config", "show", "--config", str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [
        f"tlt-stream: configuration error: config file {path}: bus.block_ms: expected `int` >= 1 (value: -5)"
    ]


def test_cli_help_imports_nothing_heavy() -> None:
    code = (
        "import sys, contextlib, io\n"
        "from tlt_stream.commands.cli import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--help'])\n"
        "main(['config', 'describe'])\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'redis', 'aiomqtt', 'numpy') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "HEAVY []" in result.stdout
