"""RayOptions without a cluster: groups from flags and from a config file's `ray:` section, what they inherit,
which group a model is in, and the errors that name what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerserve.errors import ConfigError
from layerserve.settings import Settings, load_settings
from layerserve.transports.ray.group_router import model_of_path
from layerserve.transports.ray.options import parse_group, ray_options


def test_a_group_flag_names_its_models_replicas_and_cpus() -> None:
    assert parse_group("efficientnet*:2") == ("efficientnet", {"models": ("efficientnet*",), "replicas": 2})
    name, values = parse_group("big_*,huge:3:1.5")
    assert name == "big" and values == {"models": ("big_*", "huge"), "replicas": 3, "replica_cpus": 1.5}
    with pytest.raises(ConfigError, match="PATTERN"):
        parse_group("efficientnet*")


def test_groups_inherit_the_top_level_and_route_by_pattern() -> None:
    options = ray_options({
        "replicas": 2, "replica_cpus": 0.5, "max_replicas_per_node": 1,
        "groups": {"images": {"models": ["efficientnet*", "mobilenet"], "replicas": 3, "autoscaling": {"max": 4}}},
    })  # fmt: skip
    images = options.groups["images"]
    assert images.replicas == 3 and images.replica_cpus == 0.5 and images.max_replicas_per_node == 1
    assert images.deployment_options()["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2.0,
    }  # fmt: skip
    assert "num_replicas" not in images.deployment_options()
    assert options.deployment_options()["num_replicas"] == 2
    assert options.group_of("efficientnet_lite0") == "images" and options.group_of("mobilenet") == "images"
    assert options.group_of("mobilenet_v2") is None and options.group_of("tokens") is None


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"replicaz": 2}, "ray option 'replicaz': unknown key"),
        ({"groups": {"x": {"replicas": 2}}}, "ray option 'groups.x.models'"),
        ({"groups": {"Big Models": {"models": ["a"]}}}, "group name 'Big Models'"),
        ({"groups": {"x": {"models": ["a"], "autoscaling": {"min": 5, "max": 2}}}}, "min (5) is above max (2)"),
        ({"direct_port": 8100, "autoscaling": {"max": 4}}, "direct_port with autoscaling"),
        ({"direct_port": 70000}, "ray option 'direct_port': Input should be less than or equal to 65535"),
        ({"proxy_location": "Everywhere"}, "ray option 'proxy_location': Input should be 'HeadOnly' or 'EveryNode'"),
    ],
)
def test_bad_ray_options_name_what_is_wrong(values: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError) as error:
        ray_options(values)
    assert named in error.value.message


def test_the_ray_section_of_a_config_file_is_not_a_setting(tmp_path: Path) -> None:
    config = tmp_path / "layerserve.yaml"
    config.write_text("max_batch_size: 8\nray:\n  replicas: 2\n  groups: {big: {models: [big*]}}\n")
    assert load_settings(config_file=config).max_batch_size == 8


def test_the_models_setting_includes_and_excludes_folders() -> None:
    every = Settings()
    assert every.serves_model("anything")
    only = Settings(models="efficientnet*, mlp")
    assert only.serves_model("efficientnet_lite0") and only.serves_model("mlp") and not only.serves_model("multi")
    rest = Settings(models="!efficientnet*")
    assert rest.serves_model("mlp") and not rest.serves_model("efficientnet_lite0")


def test_the_model_of_a_request_path() -> None:
    assert model_of_path("/v2/models/efficientnet/versions/2/infer") == "efficientnet"
    assert model_of_path("/v2/repository/models/mlp/load") == "mlp"
    assert model_of_path("/v1/models/mlp:predict") == "mlp" and model_of_path("/v1/models/mlp/versions/1") == "mlp"
    assert model_of_path("/v2/models/stats") is None and model_of_path("/v2/jobs/abc") is None


def test_replicas_that_no_cluster_of_these_nodes_can_place_are_named() -> None:
    two_cores = [{"CPU": 2.0, "memory": 1e10}]
    readme = ray_options({"replicas": 2, "groups": {"efficientnet": {"models": ["efficientnet*"], "replicas": 2}}})
    assert readme.shortfall(two_cores) == (
        "the replicas need 4 CPU in all (layerserve: 2 x 1, layerserve-efficientnet: 2 x 1) and the cluster has 2"
    )
    halves = ray_options({"replicas": 2, "replica_cpus": 0.5, "groups": {"e": {"models": ["e*"], "replicas": 2}}})
    assert halves.shortfall(two_cores) is None  # the group inherits the half CPU: 2 in all
    assert halves.shortfall([{"CPU": 1.0}, {"CPU": 0.5}]) == (
        "the replicas need 2 CPU in all (layerserve: 2 x 0.5, layerserve-e: 2 x 0.5) and the cluster has 1.5"
    )
    big = ray_options({"replica_cpus": 3})
    assert big.shortfall([{"CPU": 2.0}, {"CPU": 2.0}]) == (
        "a replica of layerserve needs 3 CPU and no node has more than 2"
    )
    assert ray_options({"replica_gpus": 1}).shortfall(two_cores) == (
        "a replica of layerserve needs 1 GPU and no node has more than 0"
    )
    tagged = ray_options({"replica_cpus": 0.5, "resources": {"big_node": 1}, "replicas": 2})
    assert tagged.shortfall([{"CPU": 2.0, "big_node": 1.0}, {"CPU": 2.0}]) == (
        "the replicas need 2 big_node in all (layerserve: 2 x 1) and the cluster has 1"
    )
    assert tagged.shortfall([{"CPU": 2.0, "big_node": 1.0}, {"CPU": 2.0, "big_node": 1.0}]) is None
    scaled = ray_options({"autoscaling": {"min": 0, "max": 8}, "replica_cpus": 4})
    assert scaled.shortfall(two_cores) is None  # none needed until load comes; the autoscaler's to place
    assert ray_options({"autoscaling": {"min": 3, "max": 8}}).shortfall(two_cores) == (
        "the replicas need 3 CPU in all (layerserve: 3 x 1) and the cluster has 2"
    )
