"""A version's life before it serves: the repository scan, the reloader, loading and preparing."""
