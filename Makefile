# The two set-up commands (see README): `make port` and `make test`.
# Both create .venv from the pinned set in constraints.txt on first use; nothing else
# needs to be installed beforehand but python3 (>= 3.10) with venv and pip.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.jaxport-installed

.PHONY: port test bench install clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $@

install: $(STAMP)

port: $(STAMP)
	$(VENV)/bin/jaxport port --verify

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup tests

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
