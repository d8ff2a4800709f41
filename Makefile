# cupy_symbuf: `make demo` and `make test` work on a fresh machine (they create .venv and install everything,
# MPI included, from PyPI). `make test-gpu` runs the GPU suite on a machine with GPUs and Open MPI.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MPIEXEC ?= $(VENV)/bin/mpiexec
# Every pytest run is bounded twice: per test (pytest-timeout) and per mpiexec run (timeout), so a wedged rank
# fails the run instead of hanging CI.
PYTEST := $(PY) -m pytest -q --color=no -p no:cacheprovider --timeout=300
RUN_LIMIT ?= 1200
NP ?= 4

.PHONY: install demo lint test test-unit test-mpi test-gpu bench clean soak sanitize

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[mpi,test]'
	touch $@

demo: install
	timeout $(RUN_LIMIT) $(MPIEXEC) -n $(NP) $(PY) examples/alltoall.py

test: install lint test-unit test-mpi

# The layering contracts of .importlinter (a layer imports only the layers below it, never a public face, never
# another package's private module); tests/test_layers.py checks the private names import-linter cannot see.
lint: install
	$(VENV)/bin/lint-imports

test-unit: install
	CUPY_SYMBUF_REQUIRE_NVRTC=1 timeout $(RUN_LIMIT) $(PYTEST) tests

# The same suite under 1, 2 and 4 ranks; mpiexec fails if any rank fails.
test-mpi: install
	for n in 1 2 4; do \
	  echo "== mpiexec -n $$n pytest"; \
	  CUPY_SYMBUF_REQUIRE_NVRTC=1 timeout $(RUN_LIMIT) $(MPIEXEC) -n $$n $(PYTEST) tests || exit 1; \
	done

# On a GPU machine (Open MPI's mpirun, CuPy installed, run from the source tree): see .ci/gpu_suite.sh.
test-gpu:
	bash .ci/gpu_suite.sh

bench: install
	timeout $(RUN_LIMIT) $(MPIEXEC) -n $(NP) $(PY) -m cupy_symbuf.bench

# Soak (issue 9): mixed alltoall / alltoallv / MoE dispatch-combine iterations with sampled bitwise checks, host
# path. The full 10,000-iteration run on GPUs: mpirun -n 2 python3 examples/soak.py --backend cuda.
SOAK_ITERS ?= 2000
soak: install
	timeout $(RUN_LIMIT) $(MPIEXEC) -n $(NP) $(PY) examples/soak.py --iters $(SOAK_ITERS) --backend host --check-every 5

# compute-sanitizer memcheck/racecheck/synccheck/initcheck over a small GPU soak at 1 and 2 ranks (GPU machine, Open
# MPI's mpirun, CuPy's pool off); logs in $${OUT:-/tmp}/sanitize_*.log. See tests/faults/sanitize.sh for knobs.
sanitize:
	bash tests/faults/sanitize.sh

clean:
	rm -rf $(VENV) build *.egg-info
