# ddplab: every target creates what it needs on a fresh machine first.
#   make report   run every case notebook and publish reports/ (HTML, index, Markdown)
#   make test     the default suite: real process groups, one quick notebook run per case, headless Chromium
#   make test-all the default suite and the slow tests (every notebook at full size, torchrun, packaging)
#   make lab      JupyterLab with the "ddplab" kernel registered
#   make bench    benchmarks: ratios measured side by side in one run
#   make gpu-check  the nccl paths, on a machine with GPUs

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ddplab-installed
# The CPU build of torch lies on local disk; pinning it first keeps pip from
# resolving the package's range to a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=
# pytest workers: most tests wait on ranks, kernels and Chromium, so two workers keep both
# cores busy (whole test files per worker, so a module's fixtures run once). 0: one process.
TEST_JOBS ?= 2
REPORT_ARGS ?=
# Notebooks `make report` runs at once: each case keeps about one core busy.
JOBS ?= 2

.PHONY: setup report test test-all lab bench gpu-check browser clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip 2>&1 | grep -v "is ignored" || true
	$(PY) -m pip install --quiet "$(TORCH)" 2>&1 | grep -v "is ignored" || true
	$(PY) -m pip install --quiet -e ".[lab,fabric,test]" 2>&1 | grep -v "is ignored" || true
	$(PY) -c "import ddplab, torch, numba, papermill, nbconvert" 
	$(PY) -m ipykernel install --sys-prefix --name ddplab --display-name "Python (ddplab)" >/dev/null
	touch $(STAMP)

# Debian's Chromium for the report and explorer page tests; best effort when
# the machine gives no root (those tests then skip and say why).
browser:
	@command -v chromium >/dev/null 2>&1 || \
	  { apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 || \
	    { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends chromium >/dev/null 2>&1; } || \
	    echo "note: could not install chromium; browser tests will be skipped"; }

report: $(STAMP)
	$(PY) -m ddplab report --jobs $(JOBS) $(REPORT_ARGS)

# pytest exits 5 when it collects nothing (e.g. a filtered run): that is not a pass.
# The default suite leaves out tests marked slow (each case still runs one
# quick notebook end to end); test-all runs everything.
test: $(STAMP) browser
	$(PY) -m pytest -m "not slow" -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; fi; exit $$rc

test-all: $(STAMP) browser
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; fi; exit $$rc

# The lab's defaults (lab/settings/overrides.json, read as JupyterLab's application
# settings): no news feed, so no "notified about official Jupyter news?" pop-up over
# the notebook, and no update check; both stay one setting away (Settings >
# Notifications). tests/test_explore.py starts a lab with these same arguments.
LAB_ARGS := --notebook-dir=notebooks --LabApp.app_settings_dir=$(CURDIR)/lab/settings

lab: $(STAMP)
	$(VENV)/bin/jupyter lab $(LAB_ARGS)

bench: $(STAMP)
	@for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# The nccl paths, on a machine with GPUs (prints a table; skips what needs more GPUs).
gpu-check: $(STAMP)
	$(PY) bench/gpu_check.py

clean:
	rm -rf $(VENV) reports .pytest_cache
