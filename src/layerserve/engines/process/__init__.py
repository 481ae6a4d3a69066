"""Engine processes: ONNX Runtime sessions of big graphs, each in a process of its own (channel, pool, child)."""
