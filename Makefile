# Two commands do all set-up on a fresh machine: `make demo` (the main job) and `make test`.
# Both create or reuse .venv and install the project from its own files.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast lint format clean

# torch is installed first and pinned: this machine has the CPU build of 2.13.0 on disk, a GPU
# machine gets the CUDA build of the same version; an unpinned torch pulls gigabytes.
$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -c requirements.lock -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/llm-pg fit --config configs/tiny/format_copy_grpo.yaml

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) runs lightning_logs .pytest_cache
