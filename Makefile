# cupy_symbuf: `make demo` and `make test` work on a fresh machine (they create .venv and install from PyPI what
# they run: the demo NumPy, mpi4py and MPICH, plus CuPy where a GPU is visible; the tests the test extra too).
# `make test-gpu` runs the GPU suite on a machine with GPUs and Open MPI.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MPIEXEC ?= $(VENV)/bin/mpiexec
# Every pytest run is bounded twice: per test (pytest-timeout) and per mpiexec run (timeout), so a wedged rank
# fails the run instead of hanging CI.
PYTEST := $(PY) -m pytest -q --color=no -p no:cacheprovider --timeout=300
RUN_LIMIT ?= 1200
NP ?= 4

.PHONY: install install-demo demo test lint test-unit test-mpi test-gpu bench clean soak sanitize fault-loop

install: $(VENV)/.installed

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Everything the tests need (the test extra: pytest, CuPy and the NVRTC wheels, torch's CPU build, ...).
$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e '.[mpi,test]'
	touch $@ $(VENV)/.installed-demo

# Only what the demo runs: NumPy, mpi4py and MPICH; CuPy where nvidia-smi sees a GPU.
install-demo: $(VENV)/.installed-demo

$(VENV)/.installed-demo: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e '.[mpi]'
	if nvidia-smi -L >/dev/null 2>&1; then $(PY) -m pip install -q 'cupy-cuda12x>=13'; fi
	touch $@

demo: install-demo
	timeout $(RUN_LIMIT) $(MPIEXEC) -n $(NP) $(PY) examples/alltoall.py

# Every stage runs, whatever the ones before it did; one summary line per stage at the end, and the exit status
# says whether any failed. Each stage's output is kept in $(STAGE_LOGS)/<stage>.log.
STAGE_LOGS ?= .test-logs
test: install
	@mkdir -p $(STAGE_LOGS); fail=0; : > $(STAGE_LOGS)/summary; \
	stage() { name=$$1; shift; echo "== [$$name] $$*"; t0=$$(date +%s); \
	  "$$@" 2>&1 | tee $(STAGE_LOGS)/$$name.log; rc=$${PIPESTATUS[0]}; \
	  last=$$(grep -aE "[0-9]+ (passed|failed|error)|Contracts:|no matches" $(STAGE_LOGS)/$$name.log | tail -1); \
	  echo "$$rc $$name ($$(( $$(date +%s) - t0 )) s): $$last" >> $(STAGE_LOGS)/summary; }; \
	stage lint $(MAKE) --no-print-directory lint; \
	stage unit $(MAKE) --no-print-directory test-unit; \
	for n in 1 2 4; do stage mpi$$n $(MAKE) --no-print-directory test-mpi NPS=$$n; done; \
	stage fault-loop $(MAKE) --no-print-directory fault-loop FAULT_LOOPS=1; \
	echo "== make test: one line per stage"; \
	while read rc line; do \
	  if [ "$$rc" = 0 ]; then echo "  ok      $$line"; else echo "  FAILED  $$line (exit $$rc)"; fail=1; fi; \
	done < $(STAGE_LOGS)/summary; \
	p=$$(awk 'match($$0, /[0-9]+ passed/) { s += substr($$0, RSTART, RLENGTH) + 0 } END {print s+0}' \
	  $(STAGE_LOGS)/summary); \
	f=$$(awk '{ n = match($$0, /[0-9]+ failed/) ? substr($$0, RSTART, RLENGTH) + 0 : ($$1 != 0); s += n } \
	  END {print s+0}' $(STAGE_LOGS)/summary); \
	echo "# the first pytest count of each stage's summary line added up (ranks' lines may share one line; a failed"; \
	echo "# stage with no count counts 1 failed):"; \
	echo "tests: $$p passed, $$f failed"; \
	exit $$fail

# The layering contracts of .importlinter (a layer imports only the layers below it, never a public face, never
# another package's private module); tests/test_layers.py checks the private names import-linter cannot see.
lint: install
	$(VENV)/bin/lint-imports

test-unit: install
	CUPY_SYMBUF_REQUIRE_NVRTC=1 timeout $(RUN_LIMIT) $(PYTEST) tests

# The same suite under 1, 2 and 4 ranks (NPS picks some); mpiexec fails if any rank fails; every count runs.
NPS ?= 1 2 4
test-mpi: install
	@fail=0; for n in $(NPS); do \
	  echo "== mpiexec -n $$n pytest"; \
	  CUPY_SYMBUF_REQUIRE_NVRTC=1 timeout $(RUN_LIMIT) $(MPIEXEC) -n $$n $(PYTEST) tests || fail=1; \
	done; exit $$fail

# On a GPU machine (Open MPI's mpirun, CuPy installed, run from the source tree): the whole suite at 1 rank, one
# rank per GPU (2+ GPUs), and 2, 4 and 8 ranks on GPU 0 under MPS; other stages: see .ci/device.sh.
test-gpu:
	DEVICE_BUDGET_S=0 bash .ci/device.sh gpu-all

bench: install
	timeout $(RUN_LIMIT) $(MPIEXEC) -n $(NP) $(PY) -m cupy_symbuf.bench

# Soak: mixed alltoall / alltoallv / MoE dispatch-combine iterations with sampled bitwise checks, host
# path. The full 10,000-iteration run on GPUs: mpirun -n 2 python3 examples/soak.py --backend cuda.
SOAK_ITERS ?= 2000
soak: install
	timeout $(RUN_LIMIT) $(MPIEXEC) -n $(NP) $(PY) examples/soak.py --iters $(SOAK_ITERS) --backend host --check-every 5

# The fault suite FAULT_LOOPS times under CPU load (one busy loop per core): races in bounded waits and close() show
# up as killed jobs or failed cases. One line per loop; fails if any loop failed. See tests/faults/loaded_loop.sh.
FAULT_LOOPS ?= 3
fault-loop: install
	LOOPS=$(FAULT_LOOPS) PY=$(PY) timeout $$(( $(FAULT_LOOPS) * 1500 )) bash tests/faults/loaded_loop.sh

# compute-sanitizer memcheck/racecheck/synccheck/initcheck over a small GPU soak at 1 and 2 ranks (GPU machine, Open
# MPI's mpirun, CuPy's pool off); logs in $${OUT:-/tmp}/sanitize_*.log. See tests/faults/sanitize.sh for knobs.
sanitize:
	bash tests/faults/sanitize.sh

clean:
	rm -rf $(VENV) build *.egg-info
