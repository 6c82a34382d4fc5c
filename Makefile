# Set-up and checks. `make test` is what CI runs (.ci/run) and what README.md tells a new machine to run.
PY ?= python3
PIP = $(PY) -m pip install --disable-pip-version-check -q

.PHONY: install dev test bench

install:            ## the core: estimate, models, recipes (no torch)
	$(PIP) -e .

dev:                ## everything the tests need; torch 2.13.0 first so no multi-GB CUDA build is pulled in
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev,hub]'

test: dev
	$(PY) -m pytest -q

bench:
	$(PY) benchmarks/estimate_speed.py
