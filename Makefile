# Resin: `make install`, `make test`, `make bench`, `make serve`.
# Everything installs into .venv/ in the repo root.

PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.deps-stamp
# The MLX runner's package: Metal wheels on macOS, the CPU wheels elsewhere (CI on Linux).
MLX_PKG := $(if $(filter Darwin,$(shell uname -s)),mlx>=0.29,mlx[cpu]>=0.29)

.PHONY: install develop lint test test-rust test-python test-wheel wheel bench serve clean

$(VPY):
	$(PY) -m venv $(VENV)

$(STAMP): pyproject.toml | $(VPY)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "maturin>=1.7,<2" "numpy>=1.26" "typer>=0.12" "pytest>=8" "mypy>=1.10" \
		"jinja2>=3.1" "tokenizers>=0.20" "safetensors>=0.4" "transformers>=4.45" "torch>=2.4" \
		"fastapi>=0.110" "uvicorn>=0.29" "uvloop>=0.19" "httptools>=0.6" "httpx>=0.27" "openai>=1.40" "anthropic>=0.40" "matplotlib>=3.8" "ruff>=0.6" "xgrammar>=0.1.20" "llguidance>=1.0" \
		"$(MLX_PKG)"
	touch $(STAMP)

# Editable install with a release build of the extension (resin/_core.*.so).
install: $(STAMP)
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/maturin develop --release -q

develop: install

# Debug build on purpose: every schedule/update/abort also runs check_integrity().
test-rust:
	cargo test -p resin-core -p resin-kernels

test-python: install
	$(VPY) -m pytest -q

test: test-rust test-python

# The habits the code keeps, enforced (CI runs this before the tests): ruff lint + format,
# mypy on the package, rustfmt, clippy with warnings as errors.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VPY) -m mypy resin/
	cargo fmt --all -- --check
	cargo clippy -q --workspace --all-targets -- -D warnings

# The release wheel (what `pip install .` builds) into .whl/; reuses target/ from `make install`.
wheel: install
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/maturin build --release -q -o .whl

# Just the installed-wheel check (also part of test-python): build the wheel, install it into a
# clean venv, serve the shipped tiny gpt-oss without transformers, run resin new-model.
test-wheel: install
	$(VPY) -m pytest -q tests/test_wheel.py

# Engine overhead per step: through Python (the issue's measure), then the Rust core alone.
bench: install
	$(VPY) benchmarks/engine_overhead.py
	cargo run -q --release -p resin-core --example decode_overhead -- 256 1024

# The bundled demo checkpoint: a tiny random-weight Qwen3 (fast, answers in noise). Serve a real
# model with: .venv/bin/resin serve /path/to/hf-checkpoint --served-model-name NAME
DEMO_MODEL ?= tests/fixtures/qwen3
HOST ?= 127.0.0.1
PORT ?= 8000

serve: install
	$(VENV)/bin/resin serve $(DEMO_MODEL) --served-model-name demo --host $(HOST) --port $(PORT)

clean:
	rm -rf target $(VENV) resin/_core*.so
