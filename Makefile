# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs what it needs (CPU PyTorch from the pinned wheel).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/tour.py
	$(PY) examples/pretrain_demo.py
	$(PY) examples/finetune_demo.py
	$(PY) examples/translate_demo.py
	$(PY) examples/lm_demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The attention page's tests drive Debian's chromium; its heatmaps draw Chinese with Noto CJK.
test: lint
	command -v chromium >/dev/null || { $(SUDO) apt-get update && $(SUDO) apt-get install -y chromium; }
	dpkg -s fonts-noto-cjk >/dev/null 2>&1 || $(SUDO) apt-get install -y fonts-noto-cjk
	$(VENV)/bin/pytest

bench: $(STAMP)
	$(PY) bench/embed.py
	$(PY) bench/pretrain.py --preset bert-small --batch-size 32 --seq-len 128
	$(PY) bench/pretrain.py --preset bert-base --batch-size 8 --seq-len 128
	$(PY) bench/finetune.py --train-limit 4000
	$(PY) bench/translate.py --preset transformer-small

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache src/*.egg-info
