"""Features: the feature cache and store, image decoding, pooling and labels."""
