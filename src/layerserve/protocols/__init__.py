"""Wire formats: KServe V2 / Open Inference Protocol and TF Serving REST."""
