# The README's two commands: `make demo` and `make test`. Both set everything up on a fresh machine.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export SPARK_LOCAL_IP ?= 127.0.0.1
export PYSPARK_PYTHON := $(abspath $(PY))
export PYSPARK_DRIVER_PYTHON := $(abspath $(PY))
export OMP_NUM_THREADS ?= 1

.PHONY: setup demo test bench lint lock clean

setup: $(STAMP)

# Installs exactly the lock (constraints.txt, every version pinned; tools/lock.py), then checks the venv against it.
$(STAMP): setup.py setup.cfg constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt pip setuptools wheel
	$(PY) -m pip install -q -c constraints.txt -e '.[all,test]'
	$(PY) tools/lock.py check
	touch $(STAMP)

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) tools/lock.py check
	$(PY) -m pytest

bench: setup
	$(PY) benchmarks/allreduce.py

lock:
	$(PYTHON) tools/lock.py regenerate

lint: setup
	$(VENV)/bin/ruff check spark_hvd tests benchmarks examples tools

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
