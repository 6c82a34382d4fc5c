# Set-up and checks. `make test` is what CI runs (.ci/run) and what README.md tells a new machine to run.
PY ?= python3
PIP = $(PY) -m pip install --disable-pip-version-check -q

.PHONY: install dev browser test test-fast bench

install:            ## the core: estimate, models, recipes (no torch)
	$(PIP) -e .

# What `dev` installs, importable and this checkout's trainmem: then nothing is reinstalled.
DEV_READY = import pathlib, sys, trainmem, torch, transformers, accelerate, matplotlib, huggingface_hub, pytest, \
	hypothesis, jsonschema, peft, bitsandbytes, fastapi, uvicorn, fastapi_offline, httpx, playwright, deepspeed, xdist; sys.exit(not pathlib.Path(trainmem.__file__).resolve().is_relative_to(pathlib.Path("src").resolve()))

dev:                ## everything the tests need; torch 2.13.0 first so no multi-GB CUDA build is pulled in
	@$(PY) -c '$(DEV_READY)' 2>/dev/null || { $(PIP) torch==2.13.0 && $(PIP) -e '.[dev,hub]'; }

test: dev browser   ## every test, one pytest worker per core (pytest-xdist; a file's tests stay on one worker, so its module fixtures are built once)
	$(PY) -m pytest -q -n auto --dist loadfile

browser:            ## Debian's chromium for the web page's browser test (Playwright drives it; its own download does not work here)
	@command -v chromium >/dev/null 2>&1 || apt-get install -y -q chromium >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } || \
		echo "chromium could not be installed: tests/test_web_page.py will be skipped, and say so"

test-fast: dev      ## the tests that run no model (under a minute): pytest -m "not slow"
	$(PY) -m pytest -q -m "not slow"

bench:
	$(PY) benchmarks/estimate_speed.py
