# dptune — reuse an existing venv; (re)install only when pyproject.toml changed.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dptune-installed
SITE ?= site

.PHONY: venv search plan test test-fast test-slow lint docs bench clean

# pip's and setuptools' own output (an editable-install warning box, minutes before dptune says a word) goes to
# $(VENV)/install.log, shown only if the install fails.
$(STAMP): pyproject.toml
	@echo "setting up $(VENV): dptune and its dependencies (PyTorch, Opacus, Ray; minutes the first time; log: $(VENV)/install.log)"
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@{ $(BIN)/python -m pip install -q --upgrade pip && $(BIN)/python -m pip install -q -e '.[dev]'; } \
		> $(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; echo "error: installing into $(VENV) failed (above)"; exit 1; }
	@touch $(STAMP)

venv: $(STAMP)

# README main job: a private random search on the embedded digits data.
search: $(STAMP)
	$(BIN)/python -m dptune.search --space search_spaces/digits.yaml --ledger runs/ledger.sqlite --budget-epsilon 30

plan: $(STAMP)
	$(BIN)/python -m dptune.plan --space search_spaces/digits.yaml

lint: $(STAMP)
	$(BIN)/ruff check dptune tests bench examples
	$(BIN)/mypy

# README test command: lint + types + the default test suite (pyproject's addopts: every marker but slow,
# integration and gpu; one end-to-end search of the main job stays in it). tests/test_markers.py checks that these
# three commands and .ci/run leave no test out.
test: lint
	$(BIN)/python -m pytest -q

# The unit tests a developer runs often, on every core (pytest-xdist): in-process only (no subprocess, Ray, DP-SGD
# training or clipping probe, PostgreSQL server; markers set in tests/conftest.py). CI runs them inside make test,
# with the rest.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist worksteal -m "not slow and not integration and not gpu and not ray and not train and not db and not subprocess"

# What the default suite leaves out for its length (CI runs it after make test): Ray fault injection (slow) and
# whole commands, examples, notebooks and benches run end to end (integration).
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "(slow or integration) and not gpu"

# The tuning-value harness's smoke check (digits, 1 epoch, one row; report in runs/bench/): docs/results.md,
# "One harness, every command".
bench: $(STAMP)
	$(BIN)/python bench/tuning_value.py --quick

# The docs site (mkdocs.yml): strict, so a broken link or anchor, or a stale docs/spaces.md, fails the build
# (never add -q: MkDocs 1.6 then stops counting warnings). tests/test_docs.py runs this very recipe.
docs: $(STAMP)
	$(BIN)/python -m mkdocs build --strict -d $(SITE)

clean:
	rm -rf runs site .pytest_cache .mypy_cache .ruff_cache
