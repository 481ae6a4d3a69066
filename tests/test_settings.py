"""Settings precedence and validation; ModelConfig validation and version policies."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from layerserve.errors import ConfigError, NotFoundError
from layerserve.settings import VersionPolicy, load_settings, read_model_config, settings_table


def test_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    config = tmp_path / "layerserve.yaml"
    config.write_text("port: 9001\nengine: keras\nmax-body-bytes: 123\n")
    env = {"LAYERSERVE_PORT": "9002", "LAYERSERVE_ENGINE": "onnx"}
    settings = load_settings({"port": 9003}, config, env)
    assert (settings.port, settings.engine, settings.max_body_bytes) == (9003, "onnx", 123)
    assert load_settings({}, config, env).port == 9002
    assert load_settings({}, config, {}).port == 9001


def test_toml_config_file(tmp_path: Path) -> None:
    config = tmp_path / "layerserve.toml"
    config.write_text('engine = "keras"\ntrust_models = true\n')
    settings = load_settings({}, config, {})
    assert settings.engine == "keras" and settings.trust_models is True


def test_unknown_and_invalid_settings_name_the_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("prot: 1\n")
    with pytest.raises(ConfigError, match="setting 'prot': unknown key"):
        load_settings({}, config, {})
    with pytest.raises(ConfigError, match="setting 'engine'"):
        load_settings({"engine": "tpu"}, None, {})
    with pytest.raises(ConfigError, match="setting 'port'"):
        load_settings({}, None, {"LAYERSERVE_PORT": "many"})


def test_http_and_grpc_on_one_port_is_refused_at_start() -> None:
    # Before, the gRPC service took the port and the HTTP server then failed to bind it.
    with pytest.raises(ConfigError, match="'port' and 'grpc_port' are both 8001: the HTTP and gRPC services need"):
        load_settings({"port": 8001}, None, {})
    with pytest.raises(ConfigError, match="are both 9000"):
        load_settings({}, None, {"LAYERSERVE_PORT": "9000", "LAYERSERVE_GRPC_PORT": "9000"})
    assert load_settings({"port": 8001, "grpc_port": 0}, None, {}).grpc_port == 0
    assert load_settings({"port": 0, "grpc_port": 0}, None, {}).port == 0  # two free ports, each its own


def test_model_config_unknown_key_is_named(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("description: x\nmax_batch_sise: 8\n")
    with pytest.raises(ConfigError, match="'max_batch_sise': unknown key"):
        read_model_config(path)
    path.write_text("engine: gpu\n")
    with pytest.raises(ConfigError, match="'engine'"):
        read_model_config(path)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        read_model_config(path)


def test_missing_or_empty_model_config_means_defaults(tmp_path: Path) -> None:
    assert read_model_config(tmp_path / "absent.yaml").engine is None
    (tmp_path / "empty.yaml").write_text("")
    assert read_model_config(tmp_path / "empty.yaml").version_policy.select([1, 2, 3]) == [3]


def test_version_policies(tmp_path: Path) -> None:
    assert VersionPolicy(latest=2).select([3, 1, 2]) == [2, 3]
    assert VersionPolicy(all=True).select([3, 1, 2]) == [1, 2, 3]
    assert VersionPolicy(specific=[1, 5]).select([3, 1, 2]) == [1]
    (tmp_path / "config.yaml").write_text("version_policy: all\n")
    assert read_model_config(tmp_path / "config.yaml").version_policy.all


def test_version_labels_are_validated(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("version_labels: {stable: 1, canary-2: 2, a_b: 3}\n")
    config = read_model_config(path)
    assert config.version_labels == {"stable": 1, "canary-2": 2, "a_b": 3}
    assert config.version_for_label("m", "canary-2") == 2
    with pytest.raises(NotFoundError, match="model 'm' has no version label 'beta'; labels: a_b, canary-2, stable"):
        config.version_for_label("m", "beta")
    for text, message in (
        ("version_labels: {Stable: 1}", "key 'version_labels': Value error, label 'Stable' must match"),
        ("version_labels: {2nd: 1}", "label '2nd' must match"),
        ("version_labels: {stable: 0}", "label 'stable': the version must be a positive integer, got 0"),
        ("version_labels: {stable: true}", "key 'version_labels.stable': Input should be a valid integer"),
        ("version_labels: {stable: '1'}", "key 'version_labels.stable': Input should be a valid integer"),
        ("version_labels: [stable]", "key 'version_labels': Input should be a valid dictionary"),
    ):
        path.write_text(text + "\n")
        with pytest.raises(ConfigError, match=re.escape(message)):
            read_model_config(path)


def test_the_settings_table_of_the_docs_is_generated_from_the_settings() -> None:
    readme = (Path(__file__).parent.parent / "docs" / "cli.md").read_text(encoding="utf-8")
    start = readme.index("<!-- settings table")
    table = readme[readme.index("\n", start) + 1 : readme.index("<!-- end of settings table -->")]
    assert table == settings_table(), "docs/cli.md's settings table drifted: paste layerserve.settings.settings_table()"


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"tls_cert_file": "server.crt"}, "'tls_cert_file' is set without 'tls_key_file'"),
        ({"tls_key_file": "server.key"}, "'tls_key_file' is set without 'tls_cert_file'"),
        ({"grpc_tls_cert_file": "grpc.crt"}, "'grpc_tls_cert_file' is set without 'grpc_tls_key_file'"),
        ({"tls_client_ca_file": "ca.crt"}, "'tls_client_ca_file' (ca.crt) is set without 'tls_cert_file'"),
        ({"grpc_tls_client_ca_file": "ca.crt"}, "'grpc_tls_client_ca_file' (ca.crt) is set without a certificate"),
        ({"tls_min_version": "1.1"}, "tls_min_version"),
        ({"otlp_endpoint": "collector:4318"}, "expected an http:// or https:// URL of an OpenTelemetry collector"),
        ({"otlp_protocol": "http/json"}, "otlp_protocol"),
        ({"trace_sampling_ratio": "1.5"}, "trace_sampling_ratio"),
    ],
)
def test_tls_and_trace_settings_that_cannot_serve_are_refused_naming_them(values: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_settings(values, environ={})
    assert named in str(raised.value)


def test_traces_are_set_from_the_environment_and_off_by_default() -> None:
    environ = {"LAYERSERVE_OTLP_ENDPOINT": "http://collector:4318", "LAYERSERVE_TRACE_SAMPLING_RATIO": "0.25"}
    settings = load_settings({}, environ=environ)
    assert (settings.otlp_endpoint, settings.otlp_protocol, settings.trace_sampling_ratio) == (
        "http://collector:4318", "http/protobuf", 0.25,
    )  # fmt: skip
    assert load_settings({}, environ={}).otlp_endpoint is None
