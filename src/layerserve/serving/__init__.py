"""Serving: the registry of models and versions, a loaded version, its batchers, cuts and layer graph."""
