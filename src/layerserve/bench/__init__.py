"""The load generator (`layerserve bench`) and its bare-stack baseline: outside the serving path."""
