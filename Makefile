# The two set-up commands of the README: `make demo` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/vla-node demo

# Everything but the realtime tests in parallel processes (one per core, at most 4; whole files, in collection order:
# tests/conftest.py puts the slow ones first), then the realtime tests one at a time on an otherwise idle machine; both
# always run, and either failing fails the target.
test: $(VENV)/.installed
	$(PY) -m pytest -q -m "not realtime" -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder; parallel=$$?; \
	$(PY) -m pytest -q -m realtime; realtime=$$?; \
	test $$parallel -eq 0 && test $$realtime -eq 0

bench: $(VENV)/.installed
	$(VENV)/bin/vla-node bench model
