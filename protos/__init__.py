"""The gRPC contracts between taco-llm's processes: the .proto files and the code generated from them.

Regenerate with `python -m taco_llm.protogen`; never edit the *_pb2* modules by hand.
"""
