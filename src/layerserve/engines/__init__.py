"""Engines that run a version's graph: ONNX Runtime (in the server or in an engine process) and the Keras call."""
