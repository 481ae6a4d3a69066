"""build_app without a cluster: the deployment's options, and the warning about per-replica caches."""

from __future__ import annotations

import logging

import pytest

from layerserve.settings import Settings
from layerserve.transports.ray.deployment import RayOptions, build_app


def test_the_deployment_reserves_what_it_is_told(caplog: pytest.LogCaptureFixture) -> None:
    options = RayOptions(replicas=3, replica_cpus=0.5, replica_gpus=0.25, max_replicas_per_node=1)
    with caplog.at_level(logging.WARNING):
        app = build_app(Settings(model_repository="models"), options)
    deployment = app._bound_deployment  # Ray Serve's Application holds the deployment it was bound from
    assert deployment.num_replicas == 3 and deployment.ray_actor_options["num_cpus"] == 0.5
    assert deployment.ray_actor_options["num_gpus"] == 0.25
    assert "each replica has a feature cache and store of its own" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        build_app(Settings(model_repository="models", redis_url="redis://127.0.0.1:6379/0"), options)
    assert "feature cache" not in caplog.text


def test_the_config_file_builder_takes_options_and_settings() -> None:
    from layerserve.errors import ConfigError
    from layerserve.transports.ray.app import build

    app = build({"model_repository": "models", "redis_url": "redis://127.0.0.1:6379/0", "replicas": "3"})
    assert app._bound_deployment.num_replicas == 3
    with pytest.raises(ConfigError, match="unknown key"):
        build({"replicaz": 2})
    with pytest.raises(ConfigError, match=r"ray option .replicas.: Input should be a valid integer"):
        build({"replicas": "many"})


def test_each_group_is_a_deployment_of_its_own() -> None:
    from layerserve.transports.ray.options import ray_options

    options = ray_options({"replicas": 2, "groups": {"images": {"models": ["efficientnet*"], "replicas": 3}}})
    app = build_app(Settings(model_repository="models", models="!legacy*"), options)
    ingress = app._bound_deployment
    assert ingress.name == "layerserve" and ingress.num_replicas == 2
    board, groups = ingress.init_args
    images = groups["images"]._bound_deployment
    assert images.name == "layerserve-images" and images.num_replicas == 3
    assert board._bound_deployment.name == "layerserve-board"
    served = Settings.model_validate_json(images.init_args[1])
    assert served.serves_model("efficientnet_lite0") and not served.serves_model("mlp")


def test_model_affinity_is_every_deployments_request_router_unless_turned_off() -> None:
    from layerserve.transports.ray.affinity import ROUTING_STATS_PERIOD_S
    from layerserve.transports.ray.model_router import ModelAffinityRouter

    groups = {"images": {"models": ["efficientnet*"], "replicas": 1}}
    for affinity in (True, False):
        ingress = build_app(Settings(model_repository="models"), RayOptions(groups=groups, model_affinity=affinity))
        deployments = [ingress._bound_deployment, ingress._bound_deployment.init_args[1]["images"]._bound_deployment]
        for deployment in deployments:  # Ray Serve's DeploymentConfig holds it
            config = deployment._deployment_config.request_router_config
            assert (config.get_request_router_class() is ModelAffinityRouter) is affinity, deployment.name
            assert (config.request_routing_stats_period_s == ROUTING_STATS_PERIOD_S) is affinity
