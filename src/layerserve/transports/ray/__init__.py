"""The Ray Serve door: replicas of the same app (create_app over a Runtime) placed and restarted by Ray Serve."""
