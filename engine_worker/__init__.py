"""The engine worker: vLLM's AsyncLLM behind the gRPC service in protos/engine.proto."""
