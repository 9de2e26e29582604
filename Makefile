# The two set-up commands (see README): `make port` and `make test`.
# Both create .venv from the pinned set in constraints.txt on first use; nothing else
# needs to be installed beforehand but python3 >= 3.11 (jax >= 0.8 and the pinned numpy 2.4
# need it) with venv and pip.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.jaxport-installed

.PHONY: port test bench install clean

# A fresh machine downloads ~3 GB (torch's CUDA-enabled build and its libraries). A download
# that breaks off fails pip even after its own resume retries (seen on 2026-11-30: triton's
# wheel stopped at 111 of 248 MB six times in a row, then downloaded in 2 s a minute later), so
# each pip command gets three tries, 30 s apart; pip skips what it already installed.
RETRY := for try in 1 2 3; do if
DONE  := ; then break; fi; test $$try = 3 && exit 1; \
	echo "pip failed (try $$try of 3); retrying in 30 s" >&2; sleep 30; done

# uv installs the same set as pip from the same constraints in less than half the time (fresh
# caches, 2026-12-06: 39 s against 92 s), downloading and unpacking in parallel. Unlike pip it
# compiles no bytecode unless asked: these machines set PYTHONDONTWRITEBYTECODE=1, so without
# --compile-bytecode every process compiled torch's and jax's sources at import (11.7 s against
# 4.5 s), and the suite took 1903 s instead of ~1560. It reads no pip configuration (pip.conf's
# find-links or extra index, PIP_* variables), so where it cannot install (no uv wheel for the
# platform, a registry reachable only through pip's settings), pip does, as before.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	if $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt uv \
		&& $(PY) -m uv pip install --quiet --compile-bytecode --python $(PY) -c constraints.txt -e '.[test]'; then :; else \
	echo "uv could not install the set; installing with pip" >&2; \
	$(RETRY) $(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip $(DONE); \
	$(RETRY) $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]' $(DONE); fi
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
