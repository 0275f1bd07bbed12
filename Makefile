# Both targets work from a fresh clone: they create .venv and install into it.
PY ?= python3
VENV := .venv
PIP := $(VENV)/bin/pip
# The CPU wheel of torch first: a plain `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test lint clean images

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	touch $@

# The tests' MLflow tracking server (tests/test_tracking.py): full mlflow pins pyarrow<26, so it gets its own venv.
MLFLOW_SERVER_VENV := $(VENV)/mlflow-server
$(MLFLOW_SERVER_VENV)/.installed: tests/mlflow-server-constraints.txt
	$(PY) -m venv $(MLFLOW_SERVER_VENV)
	$(MLFLOW_SERVER_VENV)/bin/pip install -q -c tests/mlflow-server-constraints.txt mlflow
	touch $@

install: $(VENV)/.installed $(MLFLOW_SERVER_VENV)/.installed

demo: install
	$(VENV)/bin/moerl demo

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# Container images with docker buildx; needs a running Docker engine (images/build.sh says so otherwise).
# make images REGISTRY=<account>.dkr.ecr.<region>.amazonaws.com/moerl [IMAGE_TAG=..] [ROLES=..] [DRY_RUN=1]
images:
	bash images/build.sh
