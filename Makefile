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

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(VENV)/bin/vla-node bench model
