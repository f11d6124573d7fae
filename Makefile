# Two commands for a newcomer: `make demo` and `make test`. Both go through
# scripts/kvtier.sh, which installs missing Debian packages, configures and
# builds first.
.PHONY: demo demo-pd demo-store demo-cluster test build deps bench bench-vllm asan fuzz gpu-bundle clean

demo:
	scripts/kvtier.sh demo

# Prefill on one worker, decode on another: each round handed off layer by
# layer (docs/transfer.md), then the same run on one worker for comparison.
demo-pd:
	PD=1 scripts/kvtier.sh demo

# kvtier-store alone: segments, spills, one batched recall, kill -9 and restart.
demo-store: build
	scripts/store_demo.sh build

# A controller, 3 stores (R = 2) and 2 workers on this machine; one store and
# one worker are killed partway through (docs/cluster.md).
demo-cluster: build
	scripts/cluster_demo.sh build

test:
	scripts/kvtier.sh test

build:
	scripts/kvtier.sh build

deps:
	scripts/kvtier.sh deps

# The store benchmark; writes docs-ready CSV to build/bench-store.csv.
bench: build
	build/bench/kvtier-bench store --csv build/bench-store.csv
	build/bench/kvtier-bench store-scale

# kvtier's vLLM connector on Gemma 3 270M beside vLLM alone: time to first
# token per turn, bytes per codec, shared prefixes, the load path
# (bench/vllm_bench.py, docs/vllm.md). Builds the vLLM venv on first use.
bench-vllm: build
	scripts/vllm_python.sh bench/vllm_bench.py --store_binary build/services/store/kvtier-store \
	  --model $$(scripts/kvtier.sh vllm-model)

# The test suite under AddressSanitizer + UBSan, in its own build tree.
asan:
	BUILD_DIR=build-asan KVTIER_SANITIZE=address KVTIER_CUDA=OFF scripts/kvtier.sh test

# libFuzzer over every fuzz target (fuzz/), FUZZ_SECONDS each (default 60),
# clang + ASan + UBSan, in build-fuzz/.
fuzz:
	scripts/fuzz.sh

# The GPU checks packed for a machine with a GPU but without kvtier's Debian
# libraries: gpu-bundle.tar.xz (docs/gpu.md).
gpu-bundle: build
	scripts/gpu_bundle.sh build

clean:
	rm -rf build build-asan build-fuzz gpu-bundle gpu-bundle.tar.xz
