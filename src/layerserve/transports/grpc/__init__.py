"""The gRPC door: Triton's `inference.GRPCInferenceService` (a superset of the Open Inference Protocol)."""
