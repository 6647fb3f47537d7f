# The README's two commands: `make demo` and `make test`. Both set everything up on a fresh machine.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The optional compiled ring loop's sources (setup.py): a changed one reinstalls, which recompiles it in place.
CSOURCES := $(wildcard spark_hvd/core/transport/*.c spark_hvd/core/transport/*.h)
# pip -q hides a failed optional compile: say which loop this install runs.
RINGLOOP_REPORT := import importlib.util as u; print("ring loop:", "compiled" if u.find_spec("spark_hvd.core.transport._ringloop") \
	else "Python (the C one did not build: pip install -v -e . shows why)")

export SPARK_LOCAL_IP ?= 127.0.0.1
export PYSPARK_PYTHON := $(abspath $(PY))
export PYSPARK_DRIVER_PYTHON := $(abspath $(PY))
export OMP_NUM_THREADS ?= 1

.PHONY: setup demo test test-fast hostloss legs legs-all leg-floor leg-spark40 leg-16.4 leg-18 bench lint lock clean

setup: $(STAMP)

# Installs exactly the lock (constraints.txt, every version pinned; tools/lock.py), then checks the venv against it.
$(STAMP): setup.py setup.cfg constraints.txt $(CSOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt pip setuptools wheel
	$(PY) -m pip install -q -c constraints.txt -e '.[all,test]'
	$(PY) tools/lock.py check
	@test ! -f spark_hvd/core/transport/_ringloop.c || $(PY) -c '$(RINGLOOP_REPORT)'
	touch $(STAMP)

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) tools/lock.py check
	$(PY) -m pytest

# The edit-test loop for a change that touches no Spark code: no Spark session, no simulated hosts, no Ray cluster,
# nothing marked slow. Not a substitute for `make test`.
test-fast: setup
	$(PY) -m pytest -q -m "not spark and not slow and not multihost and not ray"

# What `make test` leaves out for its time: a worker host's link lost on simulated hosts, under Spark standalone
# (tests/multihost/test_lost_host.py, marker hostloss: ~3 min a test on 2 cores; needs root) and the fault soak
# (marker soak). Run once per change to the runner, core or store.
hostloss: setup
	$(PY) -m pytest -m "hostloss or soak" -s --durations=0 tests/multihost

# RayExecutor on real Ray clusters started with `ray start`: on three simulated hosts, one of them lost mid-training
# and started again (tests/multihost/test_ray_hosts.py, ~3 min; root), and Ray on Spark on a local[2] session
# (tests/ray/test_ray_on_spark.py, ~4 min), at load ~30-50 on 2 cores. Marker raycluster for their time: not in
# `make test`.
.PHONY: ray-clusters
ray-clusters: setup
	$(PY) -m pytest -m raycluster -s --durations=0 tests/multihost/test_ray_hosts.py tests/ray/test_ray_on_spark.py

# Horovod-compat estimator fits on local[2] (marker horovodfit, tens of seconds each at load): not in `make test`.
.PHONY: horovod-fits
horovod-fits: setup
	$(PY) -m pytest -m horovodfit --durations=0 tests/estimators

# The runtime legs (tools/leg.py; CI runs them after `make test`): each builds .venv-<leg> from runtimes/<leg>.txt,
# installs spark_hvd into it as a user would, fails if that changed a runtime package, then runs `pytest -m compat`.
leg-floor:
	$(PYTHON) tools/leg.py runtimes/dbr-15.4-ml.txt

leg-spark40:
	$(PYTHON) tools/leg.py runtimes/dbr-17.3-ml.txt

legs: leg-floor leg-spark40

# Two more supported runtimes, not in CI (its time): 16.4 LTS ML (Spark 3.5.2, numpy 1.26, Keras 3.9) and 18 LTS ML
# (Spark 4.1.0, Keras 3.12, pyarrow 21). `make legs-all` runs every leg.
leg-16.4:
	$(PYTHON) tools/leg.py runtimes/dbr-16.4-ml.txt

leg-18:
	$(PYTHON) tools/leg.py runtimes/dbr-18-ml.txt

legs-all: legs leg-16.4 leg-18

bench: setup
	$(PY) benchmarks/allreduce.py

lock:
	$(PYTHON) tools/lock.py regenerate

lint: setup
	$(VENV)/bin/ruff check spark_hvd tests benchmarks examples tools

clean:
	rm -rf $(VENV) .venv-dbr-* dist build *.egg-info .pytest_cache spark_hvd/core/transport/*.so
