"""The HTTP layer: the app, its routes, and body reading."""
